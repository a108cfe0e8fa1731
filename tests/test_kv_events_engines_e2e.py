"""Real engines' KV events end to end: the testkit's SGLang and vLLM servers publish over
ZMQ as the engines do (`--kv-events-config`), a worker in front of each subscribes
(`--engine-kv-events`, `--engine-kv-events-replay`) and relays onto NATS
(`genmesh.<ns>.kv.<wid>`, real nats-server), where the events key as a router keys the
prompts that caused them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import nats
import pytest

from genmesh.client import request
from genmesh.codecs import get_codec
from genmesh.shared.bus import flush_in_order
from genmesh.shared.kv_events import (
    ROOT_SEED,
    AllBlocksCleared,
    BlockStored,
    EngineHash,
    KvEventsMessage,
    request_block_keys,
    stored_keys,
)
from genmesh.shared.subjects import Subjects
from tests.conftest import unique_namespace
from tests.inproc import InProcessMesh

pytestmark = pytest.mark.inproc

BLOCK = 4
WID = "wzmq"
PROMPT = list(range(200, 213))  # three full blocks of 4, and one token
MSGPACK = get_codec(None)


def kv_events_config(engine: str) -> str:
    local = "tcp://127.0.0.1:*"
    if engine == "sglang":
        return json.dumps({"publisher": "zmq", "endpoint": local, "replay_endpoint": local})
    return json.dumps({"enable_kv_cache_events": True, "endpoint": local, "replay_endpoint": local})


@pytest.fixture(params=["sglang", "vllm"])
def engine_mesh(
    request: pytest.FixtureRequest, nats_url: str
) -> Iterator[tuple[str, InProcessMesh]]:
    engine = request.param
    mesh = InProcessMesh(nats_url, unique_namespace(f"kvzmq-{engine}"))
    try:
        _, url = mesh.spawn_engine_server(
            engine, "--kv-events-config", kv_events_config(engine), "--block-size", str(BLOCK)
        )
        endpoints = asyncio.run(kv_endpoints(url))
        mesh.add_frontend()
        mesh.add_worker(
            WID,
            engine=engine,
            engine_url=url,
            extra_args=(
                "--engine-kv-events", endpoints["endpoint"],
                "--engine-kv-events-replay", endpoints["replay_endpoint"],
            ),
        )  # fmt: skip
        yield engine, mesh
    finally:
        mesh.stop()


async def kv_endpoints(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(url + "/testkit/kv_events") as r:
        assert r.status == 200
        return dict(await r.json())


async def generate(engine: str, mesh: InProcessMesh, prompt: list[int]) -> None:
    if engine == "sglang":
        path = "/generate"
        body: dict[str, Any] = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}}
    else:
        path = "/inference/v1/generate"
        body = {"token_ids": prompt, "sampling_params": {"max_tokens": 1}}
    async with aiohttp.ClientSession() as s, s.post(mesh.http_url + path, json=body) as r:
        assert r.status == 200, await r.text()


def router_keys(messages: list[KvEventsMessage]) -> set[int]:
    """Every block key the stored events give, as a router's index chains them."""
    keys: dict[EngineHash, int] = {}
    for message in messages:
        for event in message.events:
            if isinstance(event, BlockStored):
                parent = ROOT_SEED if event.parent_hash is None else keys[event.parent_hash]
                for h, key in zip(event.block_hashes, stored_keys(event, parent), strict=True):
                    keys[h] = key
    return set(keys.values())


async def test_a_real_engines_events_reach_nats_numbered_and_keyed_as_the_router_keys(
    engine_mesh: tuple[str, InProcessMesh],
) -> None:
    engine, mesh = engine_mesh
    messages: list[KvEventsMessage] = []
    nc = await nats.connect(mesh.nats_url)
    try:

        async def on_message(msg: Any) -> None:
            messages.append(KvEventsMessage.from_wire(MSGPACK.decode(msg.data)))

        await nc.subscribe(Subjects(mesh.namespace).kv_events(WID), cb=on_message)
        await flush_in_order(nc)
        await generate(engine, mesh, PROMPT)
        wanted = set(request_block_keys(request(PROMPT), BLOCK))
        # A batch the worker's SUB socket missed while it connected is replayed when
        # the next one arrives: more requests until the prompt's blocks are all there.
        async with asyncio.timeout(15):
            n = 0
            while not wanted <= router_keys(messages):
                await generate(engine, mesh, [900 + n] * BLOCK)
                n += 1
                await asyncio.sleep(0.05)
    finally:
        await nc.close()
    assert [m.seq for m in messages] == list(range(1, len(messages) + 1))
    assert {m.worker for m in messages} == {WID}
    events = [e for m in messages for e in m.events]
    assert AllBlocksCleared() not in events  # nothing was lost for good
    stored = [e for e in events if isinstance(e, BlockStored)]
    first = next(e for e in stored if list(e.token_ids[:BLOCK]) == PROMPT[:BLOCK])
    assert first.parent_hash is None
    assert all(isinstance(h, int) for e in stored for h in e.block_hashes)
    assert {e.medium for e in stored} == ({None} if engine == "sglang" else {"GPU"})

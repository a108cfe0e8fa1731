"""The mock SGLang and vLLM servers' KV events (`--kv-events-config`), published over ZMQ
as the engines publish them, and the engine adapters' subscription to them (real HTTP,
real ZMQ sockets, in-process servers): the wire form each engine sends, what the adapters
hand on, `cached_tokens` from the cache, a gap filled by replay and one that cannot be."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from genmesh.client import request
from genmesh.engines.base import EngineOutput
from genmesh.engines.http import HttpEngineBase, HttpEngineConfig
from genmesh.engines.sglang import SglangEngine
from genmesh.engines.vllm import VllmEngine
from genmesh.engines.zmq_events import ZmqEventsConfig
from genmesh.shared.kv_events import (
    AllBlocksCleared,
    BlockStored,
    KvEventBatch,
    request_block_keys,
    stored_keys,
)
from genmesh.testkit.common import serving
from genmesh.testkit.config import MockServerConfig
from genmesh.testkit.kv_events import PUBLISHER, parse_kv_events_config
from genmesh.testkit.sglang import build_app as sglang_app
from genmesh.testkit.vllm import build_app as vllm_app
from tests.http_util import post

pytestmark = pytest.mark.inproc

BLOCK = 4
PROMPT = list(range(100, 110))  # 10 tokens: two full blocks of 4, then 2
CONFIG = MockServerConfig(vocab_size=1000, eos_token_id=7, block_size=BLOCK)
LOCAL = "tcp://127.0.0.1:*"
JSON = {"Content-Type": "application/json"}


def kv_config(engine: str, *, replay: bool = True) -> str:
    settings: dict[str, Any] = {"endpoint": LOCAL, "topic": "kv"}
    if replay:
        settings["replay_endpoint"] = LOCAL
    if engine == "sglang":
        settings["publisher"] = "zmq"
    else:
        settings["enable_kv_cache_events"] = True
    return json.dumps(settings)


@dataclass
class Server:
    """A mock server with KV events, its adapter subscribed to them."""

    engine: str
    url: str
    app: web.Application
    adapter: HttpEngineBase
    got: list[KvEventBatch] = field(default_factory=list)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    # Batches before this index came from `joined`'s requests.
    seen: int = 0

    @property
    def stored(self) -> list[BlockStored]:
        """The stored events since `seen`."""
        batches = self.got[self.seen :]
        return [e for b in batches for e in b.events if isinstance(e, BlockStored)]

    async def generate(self, prompt: list[int], tokens: int = 3) -> list[EngineOutput]:
        env = request(prompt, max_tokens=tokens, ignore_eos=True)
        return [out async for out in self.adapter.generate(env)]  # type: ignore[attr-defined]

    async def wait(self, predicate: Any) -> None:
        async with asyncio.timeout(10):
            while not predicate(self.got):
                self.arrived.clear()
                await self.arrived.wait()


@contextlib.asynccontextmanager
async def server(engine: str, *, replay: bool = True, **options: Any) -> AsyncIterator[Server]:
    config = replace(CONFIG, kv_events_config=kv_config(engine, replay=replay), **options)
    app = sglang_app(config) if engine == "sglang" else vllm_app(config)
    async with serving(app) as url:
        publisher = app[PUBLISHER]
        events = ZmqEventsConfig(
            endpoint=publisher.endpoint,
            replay_endpoint=publisher.replay_endpoint,
            topic="kv",
            replay_timeout_s=0.5,
        )
        adapter_type = SglangEngine if engine == "sglang" else VllmEngine
        adapter = adapter_type(HttpEngineConfig(url=url, kv_events=events))
        await adapter.start()
        assert await adapter.healthy()
        srv = Server(engine, url, app, adapter)
        batches = adapter.kv_events()
        assert batches is not None

        async def collect() -> None:
            async for batch in batches:
                srv.got.append(batch)
                srv.arrived.set()

        task = asyncio.create_task(collect())
        try:
            yield srv
        finally:
            await adapter.close()
            await asyncio.wait_for(task, 5)


async def joined(srv: Server) -> int:
    """Requests until the adapter's SUB socket has received a batch (ZMQ's slow joiner:
    what is published before it has connected never reaches it); how many batches it
    holds then, from which `srv.stored` counts."""
    async with asyncio.timeout(10):
        n = 0
        while not srv.got:
            await srv.generate([900 + n] * BLOCK, tokens=1)
            n += 1
            await asyncio.sleep(0.02)
    srv.seen = len(srv.got)
    return srv.seen


def chain(stored: list[BlockStored]) -> list[int]:
    """The tokens of a chain of stored blocks, checking each links to the one before."""
    tokens: list[int] = []
    for before, event in zip([None, *stored], stored, strict=False):
        if before is not None:
            assert event.parent_hash == before.block_hashes[-1]
        tokens.extend(event.token_ids)
    return tokens


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_the_adapter_relays_what_the_server_caches_and_cached_tokens_follow(
    engine: str,
) -> None:
    async with server(engine, enable_prompt_tokens_details=True) as srv:
        await joined(srv)
        first = await srv.generate(PROMPT, tokens=3)
        # Prompt blocks after the prefill, then the block the output filled: 10 + 3
        # tokens, 12 computed (the last token's KV is computed at the next step).
        await srv.wait(lambda got: sum(len(e.token_ids) for e in srv.stored) >= 12)
        outputs = [t for out in first for t in out.tokens]
        stored = srv.stored
        assert stored[0].parent_hash is None
        assert chain(stored) == PROMPT + outputs[:2]
        assert {e.block_size for e in stored} == {BLOCK}
        assert all(isinstance(h, int) for e in stored for h in e.block_hashes)
        if engine == "sglang":  # one event per page
            assert [len(e.block_hashes) for e in stored] == [1, 1, 1]
            assert {e.medium for e in stored} == {None}
        else:  # one event per run of blocks, on the GPU
            assert {e.medium for e in stored} == {"GPU"}
        second = await srv.generate(PROMPT, tokens=3)
    # The second run finds the prompt's two full blocks (it computes the rest itself).
    assert first[-1].usage is not None
    assert first[-1].usage["cached_tokens"] == 0
    assert second[-1].usage is not None
    assert second[-1].usage["cached_tokens"] == 8


async def replayed_payloads(endpoint: str) -> list[tuple[int, bytes]]:
    """Everything the replay socket holds, asked as a subscriber asks."""
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    got: list[tuple[int, bytes]] = []
    try:
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        async with asyncio.timeout(5):
            while True:
                empty, seq, payload = await dealer.recv_multipart()
                assert empty == b""
                number = int.from_bytes(seq, "big", signed=True)
                if number == -1:
                    assert payload == b""
                    return got
                got.append((number, payload))
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_the_wire_form_is_the_engines_own(engine: str) -> None:
    async with server(engine) as srv:
        await joined(srv)
        await srv.generate(PROMPT[: BLOCK + 1], tokens=1)  # one full prompt block
        await srv.wait(lambda got: srv.stored)
        replay = srv.app[PUBLISHER].replay_endpoint
        assert replay is not None
        payloads = await replayed_payloads(replay)
    assert [seq for seq, _ in payloads] == list(range(len(payloads)))
    batch = msgpack.unpackb(payloads[-1][1])
    h = srv.stored[0].block_hashes[0]
    tokens = PROMPT[:BLOCK]
    if engine == "sglang":
        # sglang/srt/disaggregation/kv_events.py: [ts, events], BlockStored ending at lora_id
        assert batch[1:] == [[["BlockStored", [h], None, tokens, BLOCK, None]]]
    else:
        # vllm/distributed/kv_events.py (v0.20): positional, then medium, lora_name and
        # per-block extra_keys; the publisher stamps data_parallel_rank 0.
        assert batch[1:] == [
            [["BlockStored", [h], None, tokens, BLOCK, None, "GPU", None, [None]]],
            0,
        ]
    assert isinstance(batch[0], float)


async def test_vllm_events_carry_the_cache_salt_as_the_first_blocks_extra_key() -> None:
    async with server("vllm") as srv:
        await joined(srv)
        reply = await post(
            srv.url + "/inference/v1/generate",
            {"token_ids": PROMPT, "sampling_params": {"max_tokens": 1}, "cache_salt": "tenant-a"},
            headers=JSON,
        )
        assert reply.status == 200, reply.body
        await srv.wait(lambda got: srv.stored)
    assert srv.stored[0].extra_keys == [("tenant-a",), None]


async def test_vllm_events_key_multimodal_blocks_as_a_router_keys_the_request() -> None:
    # An image on tokens 2-7 touches blocks 0 and 1: each carries (its hash, its offset
    # from the block's start), as vLLM's generate_block_hash_extra_keys gives them.
    features = {
        "mm_hashes": {"image": ["img-1"]},
        "mm_placeholders": {"image": [{"offset": 2, "length": 6}]},
        "kwargs_data": {"image": [None]},
    }
    async with server("vllm") as srv:
        await joined(srv)
        reply = await post(
            srv.url + "/inference/v1/generate",
            {"token_ids": PROMPT, "sampling_params": {"max_tokens": 1}, "features": features},
            headers=JSON,
        )
        assert reply.status == 200, reply.body
        await srv.wait(lambda got: srv.stored)
    stored = srv.stored[0]
    assert stored.extra_keys == [(["img-1", 2],), (["img-1", -2],)]
    env = request(PROMPT, max_tokens=1)
    env.format, env.engine = "vllm", {"features": features}
    assert stored_keys(stored) == request_block_keys(env, BLOCK)  # the first block: no parent


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_a_gap_is_filled_by_replay(engine: str) -> None:
    async with server(engine) as srv:
        seen = await joined(srv)
        publisher = srv.app[PUBLISHER]
        publisher.drop = 1  # the SUB socket never sees the next batch
        await srv.generate(PROMPT, tokens=1)
        await srv.generate([5] * 2 * BLOCK, tokens=1)
        await srv.wait(lambda got: any(5 in e.token_ids for e in srv.stored))
    assert not [b for b in srv.got[seen:] if AllBlocksCleared() in b.events]
    assert chain([e for e in srv.stored if 5 not in e.token_ids]) == PROMPT[:8]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_a_gap_without_replay_clears_the_cache_view(engine: str) -> None:
    async with server(engine, replay=False) as srv:
        seen = await joined(srv)
        srv.app[PUBLISHER].drop = 1
        await srv.generate(PROMPT, tokens=1)  # its prompt blocks: lost
        await srv.generate([5] * 2 * BLOCK, tokens=1)
        await srv.wait(lambda got: any(5 in e.token_ids for e in srv.stored))
    after = srv.got[seen:]
    assert after[0].events == [AllBlocksCleared()]
    assert not [
        e for b in after for e in b.events if isinstance(e, BlockStored) and 100 in e.token_ids
    ]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_a_flush_is_published_as_all_blocks_cleared(engine: str) -> None:
    async with server(engine) as srv:
        await joined(srv)
        await srv.generate(PROMPT, tokens=1)
        await srv.wait(lambda got: srv.stored)
        await srv.adapter.flush_cache()  # type: ignore[attr-defined]
        await srv.wait(lambda got: AllBlocksCleared() in got[-1].events)
        srv.seen = len(srv.got)
        again = await srv.generate(PROMPT, tokens=1)
        await srv.wait(lambda got: srv.stored)
    # Stored again from the root: the flush forgot the blocks.
    assert srv.stored[0].parent_hash is None
    assert list(srv.stored[0].token_ids[:BLOCK]) == PROMPT[:BLOCK]
    assert again[-1].usage is not None
    assert again[-1].usage["cached_tokens"] == 0


async def test_eviction_is_published_as_block_removed() -> None:
    # Room for three blocks: a second prompt of two blocks evicts the first one's.
    config = replace(CONFIG, max_total_num_tokens=3 * BLOCK, kv_events_config=kv_config("sglang"))
    app = sglang_app(config)
    async with serving(app) as url:
        publisher = app[PUBLISHER]
        adapter = SglangEngine(
            HttpEngineConfig(url=url, kv_events=ZmqEventsConfig(
                publisher.endpoint, publisher.replay_endpoint, "kv", replay_timeout_s=0.5
            ))
        )  # fmt: skip
        srv = Server("sglang", url, app, adapter)
        for prompt in (PROMPT[:9], [1] * 9):
            await srv.generate(prompt, tokens=1)
        replay = publisher.replay_endpoint
        assert replay is not None
        payloads = await replayed_payloads(replay)
        await adapter.close()
    events = [e for _, p in payloads for e in msgpack.unpackb(p)[1]]
    assert [e[0] for e in events].count("BlockRemoved") >= 1
    assert all(len(e) == 2 for e in events if e[0] == "BlockRemoved")  # hashes only


def test_kv_events_config_is_validated_as_each_engine_does() -> None:
    with pytest.raises(ValueError, match="Unknown event publisher") as sglang:
        parse_kv_events_config("sglang", '{"publisher": "kafka"}')
    assert str(sglang.value) == "Unknown event publisher 'kafka'"
    assert not parse_kv_events_config("sglang", '{"endpoint": "tcp://*:5557"}').publishes
    assert parse_kv_events_config("sglang", '{"publisher": "zmq", "x": 1}').publishes
    with pytest.raises(ValueError, match="--kv-events-config") as vllm:
        parse_kv_events_config("vllm", '{"enable_kv_cache_events": true, "publish": "zmq"}')
    assert "publish\n  Extra inputs are not permitted" in str(vllm.value)
    assert parse_kv_events_config("vllm", '{"enable_kv_cache_events": true}').publishes
    assert not parse_kv_events_config("vllm", '{"publisher": "zmq"}').publishes


async def test_vllm_says_what_was_cached_only_with_prompt_tokens_details() -> None:
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 1}}
    for details in (False, True):
        async with server("vllm", enable_prompt_tokens_details=details) as srv:
            replies = [
                await post(srv.url + "/inference/v1/generate", body, headers=JSON) for _ in range(2)
            ]
        usages = [r.body["usage"] for r in replies]
        # vLLM leaves the details out when nothing was cached, and without the flag.
        assert usages[0]["prompt_tokens_details"] is None
        assert usages[1]["prompt_tokens_details"] == ({"cached_tokens": 8} if details else None)


def test_without_kv_events_config_a_server_keeps_no_cache() -> None:
    assert PUBLISHER not in sglang_app(CONFIG)
    assert PUBLISHER not in vllm_app(CONFIG)


async def test_the_drop_hook_refuses_what_is_not_a_count() -> None:
    async with server("sglang") as srv:
        for body in ({"drop": -1}, {"drop": True}, [1], "x"):
            reply = await post(srv.url + "/testkit/kv_events", body)
            assert (reply.status, reply.body) == (400, {"error": 'send {"drop": n}, n >= 0'})
        reply = await post(srv.url + "/testkit/kv_events", {"drop": 2})
        assert reply.status == 200
        assert reply.body["drop"] == 2

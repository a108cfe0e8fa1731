"""Workers in front of engine servers (the testkit's mock SGLang and vLLM servers, over real
sockets): the whole path HTTP -> frontend -> NATS -> router -> worker -> engine, in process."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from genmesh.client import request
from genmesh.engines.mock import MockEngine
from tests.conftest import unique_namespace
from tests.http_util import post, stream
from tests.inproc import InProcessMesh
from tests.mesh import wait_until

pytestmark = pytest.mark.inproc

ENGINES = ("sglang", "vllm")


@pytest.fixture(params=ENGINES)
def engine_mesh(request: pytest.FixtureRequest, nats_url: str) -> Iterator[Any]:
    """A router, a frontend, a mock engine server and one worker in front of it."""
    engine = request.param
    mesh = InProcessMesh(nats_url, unique_namespace(engine))
    try:
        _, url = mesh.spawn_engine_server(engine)
        mesh.add_router()
        mesh.add_frontend()
        worker = mesh.add_worker(engine=engine, engine_url=url)
        yield engine, mesh, url, worker
    finally:
        mesh.stop()


async def expected_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    engine = MockEngine()  # the servers' default token model
    env = request(prompt, max_tokens=max_tokens, ignore_eos=True)
    return [t async for out in engine.generate(env) for t in out.tokens]


async def admin(url: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s:
        if body is None:
            async with s.get(url + path) as r:
                return dict(await r.json())
        async with s.post(url + path, json=body) as r:
            return dict(await r.json())


def generate_body(engine: str, prompt: list[int], max_tokens: int, **extra: Any) -> tuple[str, Any]:
    if engine == "sglang":
        sp = {"max_new_tokens": max_tokens, "ignore_eos": True}
        return "/generate", {"input_ids": prompt, "sampling_params": sp, **extra}
    sp = {"max_tokens": max_tokens, "ignore_eos": True}
    return "/inference/v1/generate", {"token_ids": prompt, "sampling_params": sp, **extra}


def output_tokens(engine: str, body: Any) -> list[int]:
    if engine == "sglang":
        return list(body["output_ids"])
    return list(body["choices"][0]["token_ids"])


JSON = {"Content-Type": "application/json"}


async def test_unary_and_stream_through_the_engine(engine_mesh: Any) -> None:
    engine, mesh, _, _ = engine_mesh
    path, body = generate_body(engine, [3, 4, 5], 9)
    reply = await post(mesh.http_url + path, body, headers=JSON)
    assert reply.status == 200, reply.body
    assert output_tokens(engine, reply.body) == await expected_tokens([3, 4, 5], 9)
    sse = await stream(mesh.http_url + path, body, headers=JSON)
    assert sse.status == 200
    assert sse.events[-1] == "[DONE]"
    chunks = [e for e in sse.events[:-1] if e.get("choices", [None]) or "output_ids" in e]
    streamed = [
        t
        for c in chunks
        for t in (c["output_ids"] if engine == "sglang" else c["choices"][0]["token_ids"])
    ]
    assert streamed == output_tokens(engine, reply.body)


async def test_engine_errors_reach_the_client(engine_mesh: Any) -> None:
    engine, mesh, url, _ = engine_mesh
    path, body = generate_body(engine, [1, 2], 4)
    await admin(url, "/testkit/faults", {"kind": "http_error", "status": 400, "message": "no!"})
    reply = await post(mesh.http_url + path, body, headers=JSON)
    assert reply.status == 400
    assert "no!" in json.dumps(reply.body)
    # A 5xx is retryable: the request goes again, here to the same worker (the only one).
    await admin(url, "/testkit/faults", {"kind": "http_error", "status": 500})
    reply = await post(mesh.http_url + path, body, headers=JSON)
    assert reply.status == 200
    assert (await admin(url, "/testkit/state"))["faults_pending"] == []
    # Once the migration limit (3) is spent, the fourth 5xx in a row reaches the client.
    for _ in range(4):
        await admin(url, "/testkit/faults", {"kind": "http_error", "status": 500})
    reply = await post(mesh.http_url + path, body, headers=JSON)
    assert reply.status == 503
    assert (await admin(url, "/testkit/state"))["faults_pending"] == []
    assert (await post(mesh.http_url + path, body, headers=JSON)).status == 200


async def test_a_disconnect_aborts_the_engine_request(engine_mesh: Any) -> None:
    engine, mesh, url, _ = engine_mesh
    await admin(url, "/testkit/config", {"token_delay_ms": 30})
    path, body = generate_body(engine, [1, 2], 5000, stream=True)
    async with (
        aiohttp.ClientSession() as s,
        s.post(mesh.http_url + path, json=body, headers=JSON) as r,
    ):
        assert r.status == 200
        await r.content.readuntil(b"\n\n")
    started = time.monotonic()

    async def stopped() -> bool:
        state = await admin(url, "/testkit/state")
        return not state["running"] and bool(state["aborted"] or state["disconnected"])

    while not await stopped():
        assert time.monotonic() - started < 3, await admin(url, "/testkit/state")
        await asyncio.sleep(0.02)
    state = await admin(url, "/testkit/state")
    assert state["completed"] == 0


async def test_the_worker_follows_its_engines_health(engine_mesh: Any) -> None:
    engine, mesh, url, worker = engine_mesh
    await admin(url, "/testkit/config", {"healthy": False})
    mesh.wait_for_workers(lambda ids: worker.name not in ids, timeout=5, what="the worker to leave")
    path, body = generate_body(engine, [1, 2], 3)
    assert (await post(mesh.http_url + path, body, headers=JSON)).status == 503
    await admin(url, "/testkit/config", {"healthy": True})
    mesh.wait_for_workers(lambda ids: worker.name in ids, timeout=5, what="the worker to return")
    await asyncio.to_thread(wait_until, lambda: mesh._http_ok("/health"), 5.0, 0.05, "ready")
    assert (await post(mesh.http_url + path, body, headers=JSON)).status == 200


def test_a_worker_waits_for_its_engine(nats_url: str) -> None:
    mesh = InProcessMesh(nats_url, unique_namespace("wait"))
    try:
        mesh.add_router()
        mesh.add_frontend()
        # Nothing listens there yet: the worker starts, waits, and is not announced.
        from tests.mesh import free_port

        port = free_port()
        worker = mesh.add_worker(engine="sglang", engine_url=f"http://127.0.0.1:{port}", wait=False)
        wait_until(lambda: "waiting for its sglang engine" in worker.log(), what="the wait")
        assert mesh.worker_ids() == set()
        assert worker.alive
    finally:
        mesh.stop()

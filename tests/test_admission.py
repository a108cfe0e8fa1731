"""Admission control over a real mesh (real NATS, HTTP over sockets, the mock engine in
real time): workers announce their load, requests wait in the frontend's or a router's
queue for a slow mesh and all complete, past the bound the HTTP client gets 503 with
Retry-After in SGLang's and vLLM's shapes, and nothing is lost.

The queue's rules one by one: tests/unit/test_admission.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from genmesh.client import MeshClient, request
from genmesh.engines.mock import MockConfig, MockEngine
from genmesh.routing.busy import AdmissionConfig
from genmesh.services.frontend.serve import start_frontend
from genmesh.services.router.service import Router
from genmesh.services.worker.service import Worker, WorkerConfig
from genmesh.shared import frames, tracing
from genmesh.shared.bus import connect
from genmesh.shared.subjects import Subjects
from genmesh.shared.tracing import ADMISSION_WAIT_MS
from tests.conftest import unique_namespace
from tests.http_util import Reply, post
from tests.inproc import InProcessMesh
from tests.mesh import frontend_options, wait_until

pytestmark = pytest.mark.inproc

# ~110 ms on the mock in real time (a 16 ms prefill, 16 decode steps of ~6 ms).
SLOW = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}}
VLLM_SLOW = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 16, "ignore_eos": True}}


def cards(mesh: InProcessMesh) -> list[dict[str, Any]]:
    workers: list[dict[str, Any]] = mesh.server_info()["genmesh"]["workers"]
    return workers


async def metric(mesh: InProcessMesh, name: str, labels: str = "") -> float:
    async with aiohttp.ClientSession() as s, s.get(mesh.http_url + "/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith(f"genmesh_frontend_{name}{labels} "):
            return float(line.split()[-1])
    raise AssertionError(f"no genmesh_frontend_{name}{labels} in /metrics")


async def test_cards_announce_running_queued_and_kv_blocks(empty_mesh: InProcessMesh) -> None:
    empty_mesh.add_frontend()
    empty_mesh.add_worker(speedup=1.0)
    (card,) = cards(empty_mesh)
    assert (card["running"], card["queued"]) == (0, 0)
    # The mock's KV without --mock-kv-blocks: 1,048,576 tokens in blocks of 16, none held.
    assert (card["kv_blocks_used"], card["kv_blocks_total"]) == (0, 65_536)
    long = {"input_ids": list(range(1, 41)), "sampling_params": {"max_new_tokens": 64}}
    task = asyncio.create_task(post(empty_mesh.http_url + "/generate", long))
    # While it decodes: running, and its blocks held (40 prompt tokens and more: >= 3).
    await asyncio.to_thread(
        wait_until,
        lambda: cards(empty_mesh)[0]["running"] == 1,
        5.0,
        0.01,
        "the request to run",
    )
    assert cards(empty_mesh)[0]["kv_blocks_used"] >= 3
    assert (await task).status == 200


async def test_a_slow_mesh_queues_requests_and_serves_them_all(empty_mesh: InProcessMesh) -> None:
    empty_mesh.add_frontend("--admission-queue", "32")
    workers = [empty_mesh.add_worker(speedup=1.0, max_concurrency=1).name for _ in range(2)]
    replies = await asyncio.gather(
        *(post(empty_mesh.http_url + "/generate", SLOW) for _ in range(12))
    )
    assert [r.status for r in replies] == [200] * 12, [r.body for r in replies]
    assert all(len(r.body["output_ids"]) == 16 for r in replies)
    stats = {c["id"]: c["stats"] for c in cards(empty_mesh)}
    # Every request ran once, none was refused by a worker: they waited in the frontend.
    assert sum(s["admitted"] for s in stats.values()) == 12
    assert all(s["rejected"] == 0 for s in stats.values())
    assert set(stats) == set(workers)
    assert await metric(empty_mesh, "admission_queued_total") >= 10
    assert await metric(empty_mesh, "admission_queue_depth") == 0


async def test_tiny_thresholds_hold_requests_back_and_all_complete(
    empty_mesh: InProcessMesh,
) -> None:
    # Room for 64 each, but busy with any request waiting in the engine, or past a quarter
    # of 16 KV blocks (the mock's cache, which a size turns on): the frontend holds the
    # rest back.
    empty_mesh.add_frontend(
        "--admission-queue", "64", "--busy-queued", "0", "--busy-kv-usage", "0.25"
    )
    for _ in range(2):
        empty_mesh.add_worker(
            speedup=1.0, max_concurrency=64, extra_args=("--mock-kv-blocks", "16")
        )
    # 40 prompt tokens + 16 new: 3 blocks, then 4, of 16; two at once pass a quarter.
    # Prompts apart, so that no two requests share a cached block.
    bodies = [{**SLOW, "input_ids": list(range(100 * i + 1, 100 * i + 41))} for i in range(12)]
    replies = await asyncio.gather(*(post(empty_mesh.http_url + "/generate", b) for b in bodies))
    assert [r.status for r in replies] == [200] * 12, [r.body for r in replies]
    stats = [c["stats"] for c in cards(empty_mesh)]
    assert sum(s["admitted"] for s in stats) == 12
    assert all(s["rejected"] == 0 for s in stats)
    assert await metric(empty_mesh, "admission_queued_total") >= 8
    assert await metric(empty_mesh, "admission_queue_depth") == 0


async def test_without_a_queue_a_full_mesh_answers_503_at_once(empty_mesh: InProcessMesh) -> None:
    # The default: no queue; the refusal is the one of every release before this.
    empty_mesh.add_frontend("--migration-limit", "0")
    empty_mesh.add_worker(speedup=1.0, max_concurrency=1)
    first = asyncio.create_task(post(empty_mesh.http_url + "/generate", SLOW))
    await asyncio.to_thread(
        wait_until, lambda: cards(empty_mesh)[0]["inflight"] == 1, 5.0, 0.01, "one running"
    )
    refused = await post(empty_mesh.http_url + "/generate", SLOW)
    assert refused.status == 503
    assert refused.body["message"] == "all 1 eligible workers are at capacity"
    assert (await first).status == 200


async def _past_the_bound(mesh: InProcessMesh, path: str, body: dict[str, Any]) -> Reply:
    """One long request running, two waiting (the bound), the fourth refused; the first
    three complete afterwards. Returns the refusal."""
    # ~400 ms: what the others wait for (64 tokens, in the format's own words).
    budget = "max_new_tokens" if "max_new_tokens" in body["sampling_params"] else "max_tokens"
    long = {**body, "sampling_params": {**body["sampling_params"], budget: 64}}
    json_type = {"Content-Type": "application/json"}  # vLLM requires it
    waiting = [asyncio.create_task(post(mesh.http_url + path, long, headers=json_type))]
    await asyncio.to_thread(
        wait_until,
        lambda: cards(mesh)[0]["inflight"] == 1,
        5.0,
        0.01,
        "one request running",
    )
    waiting += [
        asyncio.create_task(post(mesh.http_url + path, body, headers=json_type)) for _ in range(2)
    ]
    await asyncio.to_thread(
        wait_until,
        lambda: asyncio.run(metric(mesh, "admission_queue_depth")) == 2,
        5.0,
        0.01,
        "two requests waiting",
    )
    refused = await post(mesh.http_url + path, body, headers=json_type)
    done = await asyncio.gather(*waiting)
    assert [r.status for r in done] == [200, 200, 200]  # nothing queued was lost
    assert cards(mesh)[0]["stats"]["admitted"] == 3  # and the refused one never ran
    assert await metric(mesh, "admission_refusals_total", '{reason="queue_full"}') == 1
    return refused


async def test_past_the_bound_sglang_answers_503_with_retry_after(
    empty_mesh: InProcessMesh,
) -> None:
    empty_mesh.add_frontend("--admission-queue", "2")
    empty_mesh.add_worker(speedup=1.0, max_concurrency=1)
    refused = await _past_the_bound(empty_mesh, "/generate", SLOW)
    assert refused.status == 503
    assert refused.headers["Retry-After"] == "1"
    # SGLang's shape for a 503 it raises (its own queue full: engine-apis.md).
    message = "the admission queue is full (2 requests wait for a free worker)"
    assert refused.body == {
        "object": "error",
        "message": message,
        "type": "503",
        "param": None,
        "code": 503,
    }


async def test_past_the_bound_vllm_answers_503_with_retry_after(
    empty_mesh: InProcessMesh,
) -> None:
    empty_mesh.add_frontend("--admission-queue", "2")
    empty_mesh.add_worker(speedup=1.0, max_concurrency=1)
    refused = await _past_the_bound(empty_mesh, "/inference/v1/generate", VLLM_SLOW)
    assert refused.status == 503
    assert refused.headers["Retry-After"] == "1"
    assert refused.body == {
        "error": {
            "message": "the admission queue is full (2 requests wait for a free worker)",
            "type": "ServiceUnavailableError",
            "param": None,
            "code": 503,
        }
    }


async def test_a_client_that_leaves_while_queued_leaves_the_queue(
    empty_mesh: InProcessMesh,
) -> None:
    empty_mesh.add_frontend("--admission-queue", "8")
    empty_mesh.add_worker(speedup=1.0, max_concurrency=1)
    long = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}}
    first = asyncio.create_task(post(empty_mesh.http_url + "/generate", long))
    await asyncio.to_thread(
        wait_until, lambda: cards(empty_mesh)[0]["inflight"] == 1, 5.0, 0.01, "one running"
    )
    timeout = aiohttp.ClientTimeout(total=0.15)
    with contextlib.suppress(TimeoutError):
        async with (
            aiohttp.ClientSession(timeout=timeout) as s,
            s.post(empty_mesh.http_url + "/generate", json=SLOW) as r,
        ):
            await r.read()
        raise AssertionError("the queued request was answered before the client left")
    await asyncio.to_thread(
        wait_until,
        lambda: asyncio.run(metric(empty_mesh, "admission_queue_depth")) == 0,
        5.0,
        0.01,
        "the queue to empty",
    )
    assert (await first).status == 200
    await asyncio.sleep(0.2)  # the worker is free: had it stayed queued, it would run now
    assert cards(empty_mesh)[0]["stats"]["admitted"] == 1


async def test_a_router_holds_requests_past_the_clients_ack_timeout(
    empty_mesh: InProcessMesh, nats_url: str
) -> None:
    empty_mesh.add_router(extra_args=("--admission-queue", "16"))
    empty_mesh.add_frontend()  # for the cards only
    empty_mesh.add_worker(speedup=1.0, max_concurrency=1)
    # An ack timeout shorter than the wait: the router's held keep-alives keep it alive.
    async with await MeshClient.connect(
        nats_url, empty_mesh.namespace, ack_timeout_s=0.8
    ) as client:

        async def one() -> list[frames.Frame | Any]:
            envelope = request([1, 2, 3], max_tokens=16, ignore_eos=True)
            return [f async for f in client.generate(envelope)]

        # 10 requests of ~110 ms on one worker: the last waits about 1 s.
        streams = await asyncio.gather(*(one() for _ in range(10)))
        assert client.migrations == 0  # none timed out waiting for its ack
    assert [s[-1]["t"] for s in streams] == ["end"] * 10
    assert all(s[0]["t"] == "ack" for s in streams)  # held keep-alives never reach callers
    stats = cards(empty_mesh)[0]["stats"]
    assert (stats["admitted"], stats["rejected"]) == (10, 0)


async def test_shutdown_refuses_what_waits_with_a_retryable_503(
    empty_mesh: InProcessMesh,
) -> None:
    frontend = empty_mesh.add_frontend("--admission-queue", "8")
    empty_mesh.add_worker(speedup=1.0, max_concurrency=1)
    # ~1.5 s: longer than the frontend's own retries of the refusal (0.1 + 0.2 + 0.4 s),
    # which would otherwise find the worker free and serve it after all.
    long = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 256, "ignore_eos": True}}
    running = asyncio.create_task(post(empty_mesh.http_url + "/generate", long))
    await asyncio.to_thread(
        wait_until, lambda: cards(empty_mesh)[0]["inflight"] == 1, 5.0, 0.01, "one running"
    )
    waiting = asyncio.create_task(post(empty_mesh.http_url + "/generate", SLOW))
    await asyncio.to_thread(
        wait_until,
        lambda: asyncio.run(metric(empty_mesh, "admission_queue_depth")) == 1,
        5.0,
        0.01,
        "one request waiting",
    )
    await asyncio.to_thread(empty_mesh.stop_service, frontend)
    refused = await waiting
    assert refused.status == 503
    assert refused.headers["Retry-After"] == "1"
    assert refused.body["message"] == "the frontend is shutting down"
    assert (await running).status == 200  # what ran is not cut off


async def test_a_cancel_takes_a_request_out_of_a_routers_queue(
    empty_mesh: InProcessMesh, nats_url: str
) -> None:
    router = empty_mesh.add_router(extra_args=("--admission-queue", "8")).value
    empty_mesh.add_frontend()  # for the cards only
    empty_mesh.add_worker(speedup=1.0, max_concurrency=1)
    async with await MeshClient.connect(nats_url, empty_mesh.namespace) as client:

        async def one(tokens: int) -> list[Any]:
            envelope = request([1, 2, 3], max_tokens=tokens, ignore_eos=True)
            return [f async for f in client.generate(envelope)]

        running = asyncio.create_task(one(64))  # ~400 ms
        await asyncio.to_thread(
            wait_until, lambda: router.admission.depth == 0 and sum(router.decisions.values())
        )
        given_up = asyncio.create_task(one(16))
        await asyncio.to_thread(wait_until, lambda: router.admission.depth == 1)
        given_up.cancel()  # its stream closes: the client publishes `cancel`
        with contextlib.suppress(asyncio.CancelledError):
            await given_up
        await asyncio.to_thread(wait_until, lambda: router.admission.depth == 0)
        assert (await running)[-1]["t"] == "end"
    await asyncio.sleep(0.2)  # the worker is free: had it stayed queued, it would go now
    assert sum(router.decisions.values()) == 1  # never forwarded
    assert router.admission.refusals.total() == 0


async def test_the_time_a_request_waited_is_on_its_trace(nats_url: str) -> None:
    """Tracing on, every service in this process: the request that waited has
    `genmesh.admission.wait_ms` on the frontend's server span (the frontend routes), and
    on the router's span (a frontend with --routing routers)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    namespace = unique_namespace("admtr")
    subjects = Subjects(namespace)
    nc = await connect(nats_url, name="admission-trace-test")
    queue = AdmissionConfig(queue_size=4)
    worker = Worker(nc, subjects, MockEngine(MockConfig(speedup=1.0)), WorkerConfig("w-adm", 1))
    router = Router(nc, subjects, router_id="r-adm", admission=queue)
    await worker.start()
    await router.start()
    frontends = [
        await start_frontend(frontend_options(nats_url, namespace, admission=queue)),
        await start_frontend(frontend_options(nats_url, namespace, routing="routers")),
    ]
    try:

        def server_span(span: ReadableSpan) -> bool:
            return span.kind is SpanKind.SERVER

        def router_span(span: ReadableSpan) -> bool:
            return "genmesh.router" in (span.attributes or {})

        for frontend, hop in zip(frontends, (server_span, router_span), strict=True):
            await asyncio.to_thread(
                wait_until, lambda f=frontend: f.state.backend.not_ready_reason() is None
            )
            url = f"http://127.0.0.1:{frontend.port}/generate"
            exporter.clear()
            replies = await asyncio.gather(post(url, SLOW), post(url, SLOW))
            assert [r.status for r in replies] == [200, 200]
            await asyncio.sleep(0.1)  # the spans end as the responses go out
            spans = [s for s in exporter.get_finished_spans() if hop(s)]
            assert len(spans) == 2, [s.name for s in spans]
            # One went at once (no attribute); the other waited for it (~110 ms).
            waited = sorted(
                (dict(s.attributes or {}).get(ADMISSION_WAIT_MS) for s in spans),
                key=lambda ms: ms is not None,
            )
            assert waited[0] is None
            assert isinstance(waited[1], float)
            assert waited[1] > 50.0
    finally:
        for frontend in frontends:
            await frontend.close()
        await router.stop()
        await worker.stop()
        await nc.drain()
        tracing.install(None)
        provider.shutdown()

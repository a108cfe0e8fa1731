"""Prometheus metrics: the frontend observer on synthetic frames (exact values), then the
frontend's /metrics and the routers' and workers' --metrics-port on real meshes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import nats
import pytest
from prometheus_client.parser import text_string_to_metric_families

from genmesh.client import MigFrame, MigrationReason
from genmesh.services.frontend import metrics as frontend_metrics
from genmesh.services.frontend.metrics import FrontendMetrics
from genmesh.services.frontend.observers import Observation, RequestInfo
from genmesh.shared.envelope import Envelope
from genmesh.shared.errors import ErrorCode
from genmesh.shared.metrics import metrics_response
from genmesh.shared.subjects import Subjects
from tests.conftest import unique_namespace
from tests.http_util import post, stream
from tests.inproc import InProcessMesh
from tests.mesh import free_port

pytestmark = pytest.mark.unit

# ---------------------------------------------------------------------------- unit


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(frontend_metrics, "_now", clock)
    return clock


def info(clock: Clock, fmt: str = "sglang", endpoint: str = "/generate") -> RequestInfo:
    return RequestInfo(fmt, "POST", endpoint, clock.now, 0.0)


def items(*prompt_lengths: int) -> list[Envelope]:
    return [Envelope(id=f"r{i}", token_ids=list(range(n))) for i, n in enumerate(prompt_lengths)]


def value(metrics: FrontendMetrics, name: str, **labels: str) -> float:
    found = metrics.registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


ROUTE = {"format": "sglang", "endpoint": "/generate"}


def out(*tokens: int) -> dict[str, Any]:
    return {"t": "out", "id": "x", "seq": 1, "tokens": list(tokens)}


def end(*tokens: int) -> dict[str, Any]:
    return {"t": "end", "id": "x", "seq": 2, "tokens": list(tokens), "finish": {"reason": "eos"}}


def err(code: ErrorCode) -> dict[str, Any]:
    return {"t": "err", "id": "x", "seq": 1, "code": code.value, "message": "m"}


def test_a_unary_request_exactly(clock: Clock) -> None:
    metrics = FrontendMetrics()
    request = info(clock)
    obs = Observation([metrics], request)
    assert value(metrics, "genmesh_frontend_inflight_requests", **ROUTE) == 1
    request.items = items(3, 5)
    obs.dispatched()
    assert value(metrics, "genmesh_frontend_input_sequence_tokens_count", **ROUTE) == 2
    assert value(metrics, "genmesh_frontend_input_sequence_tokens_sum", **ROUTE) == 8
    assert value(metrics, "genmesh_frontend_input_tokens_total", **ROUTE) == 8
    obs.frame(0, {"t": "ack", "id": "r0", "seq": 0, "worker": "w"})
    obs.frame(1, {"t": "ack", "id": "r1", "seq": 0, "worker": "w"})
    clock.now += 0.25
    obs.frame(1, out(11))  # the request's first token: TTFT 0.25
    clock.now += 0.5
    obs.frame(0, out(21, 22))  # item 0's first tokens: no ITL, no second TTFT
    clock.now += 0.2
    obs.frame(0, out(23, 24))  # 2 tokens after 0.2 s: ITL 0.1, twice
    obs.frame(0, {"t": "ka", "id": "r0", "seq": 3})
    clock.now += 0.05
    obs.frame(0, end(25))  # ITL 0.05
    clock.now += 0.5
    obs.frame(1, end())  # no tokens: nothing but the completed length
    clock.now += 0.01
    obs.finished(200, None)

    assert value(metrics, "genmesh_frontend_inflight_requests", **ROUTE) == 0
    labels = {**ROUTE, "status": "200", "error_type": "none"}
    assert value(metrics, "genmesh_frontend_requests_total", **labels) == 1
    assert value(metrics, "genmesh_frontend_time_to_first_token_seconds_count", **ROUTE) == 1
    assert value(metrics, "genmesh_frontend_time_to_first_token_seconds_sum", **ROUTE) == 0.25
    ttft_le = {**ROUTE, "le": "0.3"}
    assert value(metrics, "genmesh_frontend_time_to_first_token_seconds_bucket", **ttft_le) == 1
    ttft_le = {**ROUTE, "le": "0.2"}
    assert value(metrics, "genmesh_frontend_time_to_first_token_seconds_bucket", **ttft_le) == 0
    assert value(metrics, "genmesh_frontend_inter_token_latency_seconds_count", **ROUTE) == 3
    assert value(
        metrics, "genmesh_frontend_inter_token_latency_seconds_sum", **ROUTE
    ) == pytest.approx(0.25)
    assert value(metrics, "genmesh_frontend_output_tokens_total", **ROUTE) == 6
    assert value(metrics, "genmesh_frontend_output_sequence_tokens_count", **ROUTE) == 2
    assert value(metrics, "genmesh_frontend_output_sequence_tokens_sum", **ROUTE) == 6
    assert value(metrics, "genmesh_frontend_output_sequence_tokens_bucket", **ROUTE, le="1.0") == 1
    assert value(metrics, "genmesh_frontend_request_duration_seconds_count", **ROUTE) == 1
    assert value(metrics, "genmesh_frontend_request_duration_seconds_sum", **ROUTE) == (
        pytest.approx(1.51)
    )
    assert value(metrics, "genmesh_frontend_cancellations_total") == 0
    assert value(metrics, "genmesh_frontend_disconnected_clients_total") == 0


def test_cached_tokens_count_the_first_report_of_each_completed_generation(
    clock: Clock,
) -> None:
    """The prefix cache's hits, as the engines report them (protocol.md §6.3): SGLang and
    the mock on the first output frame, vLLM in the end frame's usage."""
    metrics = FrontendMetrics()
    request = info(clock)
    obs = Observation([metrics], request)
    request.items = items(48, 40, 40, 40)
    obs.dispatched()
    obs.frame(0, {**out(1), "cached_tokens": 32})
    obs.frame(0, {**end(2), "cached_tokens": 48})  # not the first figure: ignored
    obs.frame(1, {**end(3), "usage": {"prompt_tokens": 40, "cached_tokens": 16}})
    obs.frame(2, {**out(4), "cached_tokens": 0})
    obs.frame(2, end(5))
    obs.frame(3, {**out(6), "cached_tokens": 40})
    obs.frame(3, err(ErrorCode.UNAVAILABLE))  # did not complete: not counted
    obs.finished(200, ErrorCode.UNAVAILABLE.value)
    assert value(metrics, "genmesh_frontend_cached_tokens_total", **ROUTE) == 32 + 16
    assert value(metrics, "genmesh_frontend_input_tokens_total", **ROUTE) == 168


def test_a_refused_request_is_counted_but_not_timed(clock: Clock) -> None:
    metrics = FrontendMetrics()
    obs = Observation([metrics], info(clock, "vllm", "/inference/v1/generate"))
    obs.finished(400, ErrorCode.INVALID_ARGUMENT.value)
    route = {"format": "vllm", "endpoint": "/inference/v1/generate"}
    labels = {**route, "status": "400", "error_type": "invalid_argument"}
    assert value(metrics, "genmesh_frontend_requests_total", **labels) == 1
    assert value(metrics, "genmesh_frontend_inflight_requests", **route) == 0
    assert value(metrics, "genmesh_frontend_request_duration_seconds_count", **route) == 0
    assert value(metrics, "genmesh_frontend_input_sequence_tokens_count", **route) == 0
    assert value(metrics, "genmesh_frontend_requests_total", **ROUTE, status="400") == 0


@pytest.mark.parametrize(
    ("frames", "status", "error_type", "cancelled", "disconnected"),
    [
        # The client went away: the handler reports 499 cancelled, no err frame came.
        ([out(1)], 499, "cancelled", 1, 1),
        # The mesh cancelled it (unary): the err frame came, the 499 is not a departure.
        ([out(1), err(ErrorCode.CANCELLED)], 499, "cancelled", 1, 0),
        # The same in-band, after a 200 went out.
        ([out(1), err(ErrorCode.CANCELLED)], 200, "cancelled", 1, 0),
        # Other failures are neither.
        ([err(ErrorCode.UNAVAILABLE)], 503, "unavailable", 0, 0),
    ],
)
def test_cancellations_and_disconnects(
    clock: Clock,
    frames: list[dict[str, Any]],
    status: int,
    error_type: str,
    cancelled: int,
    disconnected: int,
) -> None:
    metrics = FrontendMetrics()
    request = info(clock)
    obs = Observation([metrics], request)
    request.items = items(2)
    obs.dispatched()
    for frame in frames:
        obs.frame(0, frame)
    obs.finished(status, error_type)
    obs.finished(status, error_type)  # Observation guards against a second report
    labels = {**ROUTE, "status": str(status), "error_type": error_type}
    assert value(metrics, "genmesh_frontend_requests_total", **labels) == 1
    assert value(metrics, "genmesh_frontend_cancellations_total") == cancelled
    assert value(metrics, "genmesh_frontend_disconnected_clients_total") == disconnected
    assert value(metrics, "genmesh_frontend_inflight_requests", **ROUTE) == 0
    assert value(metrics, "genmesh_frontend_output_sequence_tokens_count", **ROUTE) == 0


# Every cause of a migration, and the label it counts under (docs/observability.md).
MIGRATION_LABELS = {
    MigrationReason.WORKER_GONE: "ping",
    MigrationReason.NOT_RUNNING: "ping",
    MigrationReason.LEFT_DISCOVERY: "left_discovery",
    MigrationReason.ACK_TIMEOUT: "timeout",
    MigrationReason.IDLE_TIMEOUT: "timeout",
    MigrationReason.RETRYABLE_ERROR: "retryable_error",
    MigrationReason.NO_ROUTER: "retryable_error",
    MigrationReason.PUBLISH_FAILED: "retryable_error",
    MigrationReason.FRAMES_LOST: "retryable_error",
}


def mig(reason: MigrationReason, attempt: int = 2, delivered: int = 0) -> MigFrame:
    return {
        "t": "mig",
        "id": "r0",
        "attempt": attempt,
        "reason": reason,
        "message": f"what the failure said ({reason})",
        "from_worker": "w1",
        "delivered": delivered,
    }


def test_every_migration_reason_has_its_label() -> None:
    assert set(MIGRATION_LABELS) == set(MigrationReason)


@pytest.mark.parametrize(("reason", "label"), MIGRATION_LABELS.items())
def test_a_migration_counts_under_the_label_of_its_reason(
    clock: Clock, reason: MigrationReason, label: str
) -> None:
    metrics = FrontendMetrics()
    request = info(clock)
    obs = Observation([metrics], request)
    request.items = items(4)
    obs.dispatched()
    obs.frame(0, mig(reason))
    obs.finished(200, None)
    for other in set(MIGRATION_LABELS.values()):
        expected = 1 if other == label else 0
        assert value(metrics, "genmesh_frontend_migrations_total", reason=other) == expected


def test_migrations_keep_timing_across_attempts(clock: Clock) -> None:
    metrics = FrontendMetrics()
    for reason in ("ping", "left_discovery", "timeout", "retryable_error"):
        assert value(metrics, "genmesh_frontend_migrations_total", reason=reason) == 0
    request = info(clock)
    obs = Observation([metrics], request)
    request.items = items(4)
    obs.dispatched()
    clock.now += 0.1
    obs.frame(0, out(1))
    clock.now += 0.1
    obs.frame(0, out(2))
    obs.frame(0, mig(MigrationReason.RETRYABLE_ERROR, delivered=2))
    clock.now += 1.0
    obs.frame(0, {"t": "ack", "id": "r0", "seq": 0, "worker": "w2"})
    obs.frame(0, end(3))  # after the move: one ITL sample of 1.0 s, no second TTFT
    obs.finished(200, None)
    assert value(metrics, "genmesh_frontend_migrations_total", reason="retryable_error") == 1
    assert value(metrics, "genmesh_frontend_migrations_total", reason="timeout") == 0
    assert value(metrics, "genmesh_frontend_time_to_first_token_seconds_count", **ROUTE) == 1
    assert value(metrics, "genmesh_frontend_inter_token_latency_seconds_count", **ROUTE) == 2
    assert value(
        metrics, "genmesh_frontend_inter_token_latency_seconds_sum", **ROUTE
    ) == pytest.approx(1.1)
    assert value(metrics, "genmesh_frontend_output_sequence_tokens_sum", **ROUTE) == 3


def test_two_frontends_in_one_process_do_not_collide(clock: Clock) -> None:
    one, two = FrontendMetrics(), FrontendMetrics()
    Observation([one], info(clock)).finished(200, None)
    labels = {**ROUTE, "status": "200", "error_type": "none"}
    assert value(one, "genmesh_frontend_requests_total", **labels) == 1
    assert value(two, "genmesh_frontend_requests_total", **labels) == 0


def test_exposition() -> None:
    metrics = FrontendMetrics()
    response = metrics_response(metrics.registry)
    assert response.headers["Content-Type"].startswith("text/plain; version=")
    assert response.body is not None
    text = bytes(response.body).decode()  # type: ignore[arg-type]
    names = {family.name for family in text_string_to_metric_families(text)}
    assert {
        "genmesh_frontend_requests",
        "genmesh_frontend_inflight_requests",
        "genmesh_frontend_time_to_first_token_seconds",
        "genmesh_frontend_inter_token_latency_seconds",
        "genmesh_frontend_request_duration_seconds",
        "genmesh_frontend_input_sequence_tokens",
        "genmesh_frontend_output_sequence_tokens",
        "genmesh_frontend_input_tokens",
        "genmesh_frontend_output_tokens",
        "genmesh_frontend_migrations",
        "genmesh_frontend_cancellations",
        "genmesh_frontend_disconnected_clients",
        "process_cpu_seconds",
    } <= names


# ---------------------------------------------------------------------------- end to end

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(url: str) -> Samples:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def get(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return get(after, name, **labels) - get(before, name, **labels)


class Scraper:
    """The frontend's, the router's and each worker's metrics."""

    def __init__(self, mesh: InProcessMesh, router_port: int, worker_ports: dict[str, int]) -> None:
        self.mesh = mesh
        self.router = f"http://127.0.0.1:{router_port}/metrics"
        self.workers = {w: f"http://127.0.0.1:{p}/metrics" for w, p in worker_ports.items()}

    async def frontend(self) -> Samples:
        return await scrape(self.mesh.http_url + "/metrics")

    async def worker(self, worker_id: str | None = None) -> Samples:
        return await scrape(self.workers[worker_id or next(iter(self.workers))])

    async def all(self) -> tuple[Samples, Samples, Samples]:
        return await asyncio.gather(self.frontend(), scrape(self.router), self.worker())

    async def settled(self, what: str = "") -> tuple[Samples, Samples, Samples]:
        """Metrics once nothing is in flight anywhere (handlers and workers end a little
        after their client has its answer)."""
        for _ in range(200):
            front, router, worker = await self.all()
            busy = sum(v for (n, _), v in front.items() if n.endswith("inflight_requests"))
            if not busy and not get(worker, "genmesh_worker_inflight_requests"):
                return front, router, worker
            await asyncio.sleep(0.025)
        raise TimeoutError(f"the mesh did not settle {what}")


def start(nats_url: str, workers: int) -> tuple[InProcessMesh, Scraper, dict[str, int], int]:
    mesh = InProcessMesh(nats_url, unique_namespace("metrics"))
    try:
        router_port = free_port()
        mesh.add_router(extra_args=("--metrics-port", str(router_port)))
        worker_ports: dict[str, int] = {}
        for _ in range(workers):
            port = free_port()
            service = mesh.add_worker(
                vocab_size=1000,
                eos_token_id=7,
                testkit_faults=True,
                wait=False,
                extra_args=("--metrics-port", str(port)),
            )
            worker_ports[service.name] = port
        mesh.add_frontend("--routing", "routers")  # the router's metrics are under test
        mesh.wait_for_workers(lambda ids: set(worker_ports) <= ids, what="the workers")
    except BaseException:
        print(mesh.logs())
        mesh.stop()
        raise
    return mesh, Scraper(mesh, router_port, worker_ports), worker_ports, router_port


@pytest.fixture(scope="module")
def one_worker(nats_url: str) -> Iterator[tuple[InProcessMesh, Scraper]]:
    """A router and one fault-taking worker, each with a metrics port, and a frontend."""
    mesh, scraper, _, _ = start(nats_url, 1)
    yield mesh, scraper
    mesh.stop()


@pytest.fixture
def mesh(one_worker: tuple[InProcessMesh, Scraper]) -> InProcessMesh:
    return one_worker[0]  # named `mesh` so that a failure shows its logs


@pytest.fixture
def scraper(one_worker: tuple[InProcessMesh, Scraper]) -> Scraper:
    return one_worker[1]


async def inject(mesh: InProcessMesh, worker_id: str, fault: dict[str, Any]) -> dict[str, Any]:
    nc = await nats.connect(mesh.nats_url)
    try:
        subject = Subjects(mesh.namespace).testkit(worker_id)
        msg = await nc.request(subject, json.dumps(fault).encode(), timeout=5)
        answer: dict[str, Any] = json.loads(msg.data)
    finally:
        await nc.close()
    assert "error" not in answer, answer
    return answer


SGLANG = {"format": "sglang", "endpoint": "/generate"}
OK = {**SGLANG, "status": "200", "error_type": "none"}
TOKENS = 5
BODY = {
    "input_ids": [1, 2, 3],
    "sampling_params": {"max_new_tokens": TOKENS, "ignore_eos": True},
}


@pytest.mark.inproc
@pytest.mark.parametrize("streaming", [False, True], ids=["unary", "sse"])
async def test_a_request_end_to_end(mesh: InProcessMesh, scraper: Scraper, streaming: bool) -> None:
    front0, router0, worker0 = await scraper.settled("before")
    if streaming:
        reply = await stream(mesh.http_url + "/generate", BODY)
        assert reply.events[-1] == "[DONE]"
        tokens = sum(len(e["output_ids"]) for e in reply.events[:-1])
    else:
        unary = await post(mesh.http_url + "/generate", BODY)
        assert unary.status == 200, unary.body
        tokens = len(unary.body["output_ids"])
    assert tokens == TOKENS
    front, router, worker = await scraper.settled("after")

    assert delta(front0, front, "genmesh_frontend_requests_total", **OK) == 1
    assert get(front, "genmesh_frontend_inflight_requests", **SGLANG) == 0
    for name, change in [
        ("genmesh_frontend_time_to_first_token_seconds_count", 1),
        ("genmesh_frontend_request_duration_seconds_count", 1),
        ("genmesh_frontend_input_sequence_tokens_count", 1),
        ("genmesh_frontend_input_sequence_tokens_sum", 3),
        ("genmesh_frontend_input_tokens_total", 3),
        ("genmesh_frontend_output_tokens_total", TOKENS),
        ("genmesh_frontend_output_sequence_tokens_count", 1),
        ("genmesh_frontend_output_sequence_tokens_sum", TOKENS),
        # The mock sends one token per frame: every token but the first has an ITL.
        ("genmesh_frontend_inter_token_latency_seconds_count", TOKENS - 1),
    ]:
        assert delta(front0, front, name, **SGLANG) == change, name
    for name in ("migrations_total", "cancellations_total", "disconnected_clients_total"):
        assert delta(front0, front, f"genmesh_frontend_{name}") == 0

    (worker_id,) = scraper.workers
    decision = {"policy": "round_robin", "worker": worker_id}
    assert delta(router0, router, "genmesh_router_decisions_total", **decision) == 1
    assert get(router, "genmesh_router_workers") == 1
    assert get(router, "genmesh_router_info", router=_router_id(router), policy="round_robin")

    assert delta(worker0, worker, "genmesh_worker_requests_total", outcome="completed") == 1
    assert get(worker, "genmesh_worker_engine_up") == 1
    assert get(worker, "genmesh_worker_queued_requests") == 0
    assert get(worker, "genmesh_worker_capacity") == 256
    assert get(worker, "genmesh_worker_info", worker=worker_id, engine="mock", model="genmesh-mock")
    assert get(worker, "process_resident_memory_bytes") > 0


def _router_id(samples: Samples) -> str:
    for (name, labels), _ in samples.items():
        if name == "genmesh_router_info":
            return dict(labels)["router"]
    raise KeyError("genmesh_router_info")


@pytest.mark.inproc
async def test_a_validation_error(mesh: InProcessMesh, scraper: Scraper) -> None:
    front0, router0, worker0 = await scraper.settled()
    reply = await post(mesh.http_url + "/generate", {"sampling_params": {}})
    assert reply.status == 400
    front, router, worker = await scraper.settled()
    labels = {**SGLANG, "status": "400", "error_type": "invalid_argument"}
    assert delta(front0, front, "genmesh_frontend_requests_total", **labels) == 1
    # Refused before dispatch: not timed, nothing reached the mesh.
    for name in ("request_duration_seconds_count", "input_sequence_tokens_count"):
        assert delta(front0, front, f"genmesh_frontend_{name}", **SGLANG) == 0
    assert total(router, "genmesh_router_decisions_total") == total(
        router0, "genmesh_router_decisions_total"
    )
    assert total(worker, "genmesh_worker_requests_total") == total(
        worker0, "genmesh_worker_requests_total"
    )


def total(samples: Samples, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


@pytest.mark.inproc
async def test_an_engine_error_and_a_router_rejection(
    mesh: InProcessMesh, scraper: Scraper
) -> None:
    (worker_id,) = scraper.workers
    front0, router0, worker0 = await scraper.settled()
    await inject(mesh, worker_id, {"kind": "http_error", "status": 400, "message": "no"})
    reply = await post(mesh.http_url + "/generate", BODY)
    assert reply.status == 400
    # vLLM's route names a model; the router answers not_found itself.
    vllm = await post(
        mesh.http_url + "/inference/v1/generate",
        {"token_ids": [1, 2], "model": "nope", "sampling_params": {"max_tokens": 2}},
        headers={"Content-Type": "application/json"},
    )
    assert vllm.status == 404, vllm.body
    front, router, worker = await scraper.settled()

    labels = {**SGLANG, "status": "400", "error_type": "invalid_argument"}
    assert delta(front0, front, "genmesh_frontend_requests_total", **labels) == 1
    assert delta(front0, front, "genmesh_frontend_request_duration_seconds_count", **SGLANG) == 1
    vllm_route = {"format": "vllm", "endpoint": "/inference/v1/generate"}
    labels = {**vllm_route, "status": "404", "error_type": "not_found"}
    assert delta(front0, front, "genmesh_frontend_requests_total", **labels) == 1

    assert delta(router0, router, "genmesh_router_rejections_total", code="not_found") == 1
    assert delta(worker0, worker, "genmesh_worker_requests_total", outcome="failed") == 1
    code = {"code": "invalid_argument"}
    assert delta(worker0, worker, "genmesh_worker_engine_errors_total", **code) == 1
    assert delta(worker0, worker, "genmesh_worker_aborts_total") == 0


@pytest.mark.inproc
@pytest.mark.parametrize("streaming", [False, True], ids=["unary", "sse"])
async def test_a_client_disconnect(mesh: InProcessMesh, scraper: Scraper, streaming: bool) -> None:
    (worker_id,) = scraper.workers
    front0, _, worker0 = await scraper.settled()
    # One token, then the engine hangs until it is aborted.
    await inject(mesh, worker_id, {"kind": "hang", "after_tokens": 1})
    body = {**BODY, "stream": streaming}
    async with aiohttp.ClientSession() as session:
        if streaming:
            async with session.post(mesh.http_url + "/generate", json=body) as resp:
                assert resp.status == 200
                await resp.content.readuntil(b"\n\n")  # the first token
                # Leaving the block drops the connection mid-stream.
        else:
            timeout = aiohttp.ClientTimeout(total=0.5)
            with pytest.raises(asyncio.TimeoutError):
                await _read(session, mesh.http_url + "/generate", body, timeout)
    front, _, worker = await scraper.settled("after the disconnect")

    labels = {**SGLANG, "status": "499", "error_type": "cancelled"}
    assert delta(front0, front, "genmesh_frontend_requests_total", **labels) == 1
    assert delta(front0, front, "genmesh_frontend_cancellations_total") == 1
    assert delta(front0, front, "genmesh_frontend_disconnected_clients_total") == 1
    assert delta(front0, front, "genmesh_frontend_output_tokens_total", **SGLANG) == 1
    assert delta(front0, front, "genmesh_frontend_time_to_first_token_seconds_count", **SGLANG) == 1
    # Not completed: no output length.
    assert delta(front0, front, "genmesh_frontend_output_sequence_tokens_count", **SGLANG) == 0
    assert delta(front0, front, "genmesh_frontend_request_duration_seconds_count", **SGLANG) == 1

    assert delta(worker0, worker, "genmesh_worker_requests_total", outcome="cancelled") == 1
    assert delta(worker0, worker, "genmesh_worker_aborts_total") == 1


async def _read(
    session: aiohttp.ClientSession, url: str, body: Any, timeout: aiohttp.ClientTimeout
) -> bytes:
    async with session.post(url, json=body, timeout=timeout) as resp:
        return await resp.read()


@pytest.mark.inproc
async def test_a_queued_request_is_seen_on_the_worker(
    mesh: InProcessMesh, scraper: Scraper
) -> None:
    """Before its first output a request counts as queued; after it, only as in flight."""
    (worker_id,) = scraper.workers
    await scraper.settled()
    await inject(mesh, worker_id, {"kind": "hang", "after_tokens": 0})  # hangs before output
    task = asyncio.create_task(post(mesh.http_url + "/generate", BODY, headers=_timeout(1.5)))
    try:
        seen: list[tuple[float, float]] = []
        for _ in range(100):
            worker = await scraper.worker()
            seen.append(
                (
                    get(worker, "genmesh_worker_inflight_requests"),
                    get(worker, "genmesh_worker_queued_requests"),
                )
            )
            if seen[-1] == (1, 1):
                break
            await asyncio.sleep(0.02)
        assert seen[-1] == (1, 1), seen
    finally:
        reply = await task
    assert reply.status == 504  # the deadline ends the hang
    _, _, worker = await scraper.settled()
    assert get(worker, "genmesh_worker_queued_requests") == 0


def _timeout(seconds: float) -> dict[str, str]:
    return {"X-Request-Timeout": str(seconds)}


@pytest.mark.inproc
async def test_a_migration(nats_url: str) -> None:
    own, scraper, worker_ports, _ = await asyncio.to_thread(start, nats_url, 2)
    try:
        await _migration(own, scraper, sorted(worker_ports))
    except BaseException:
        print(own.logs())
        raise
    finally:
        await asyncio.to_thread(own.stop)


async def _migration(mesh: InProcessMesh, scraper: Scraper, worker_ids: list[str]) -> None:
    faulty, other = worker_ids
    front0, router0, _ = await scraper.all()
    faulty0, other0 = await asyncio.gather(scraper.worker(faulty), scraper.worker(other))
    await inject(mesh, faulty, {"kind": "drop", "after_tokens": 2})
    # Round robin: within two requests one lands on the faulty worker and moves.
    sent = 0
    while (await inject(mesh, faulty, {}))["faults_pending"]:
        assert sent < 4, "the faulty worker never got a request"
        reply = await post(mesh.http_url + "/generate", BODY)
        assert reply.status == 200, reply.body
        assert len(reply.body["output_ids"]) == TOKENS
        sent += 1
    front, router, _ = await scraper.settled()
    faulty1, other1 = await asyncio.gather(scraper.worker(faulty), scraper.worker(other))

    assert delta(front0, front, "genmesh_frontend_requests_total", **OK) == sent
    for reason, change in [
        ("retryable_error", 1),
        ("timeout", 0),
        ("ping", 0),
        ("left_discovery", 0),
    ]:
        assert delta(front0, front, "genmesh_frontend_migrations_total", reason=reason) == change
    # The client sees every token once, whatever moved.
    assert delta(front0, front, "genmesh_frontend_output_tokens_total", **SGLANG) == sent * TOKENS
    assert delta(front0, front, "genmesh_frontend_output_sequence_tokens_sum", **SGLANG) == (
        sent * TOKENS
    )
    assert delta(front0, front, "genmesh_frontend_time_to_first_token_seconds_count", **SGLANG) == (
        sent
    )

    decisions = [
        delta(router0, router, "genmesh_router_decisions_total", policy="round_robin", worker=w)
        for w in (faulty, other)
    ]
    assert sum(decisions) == sent + 1  # the continuation is routed again
    assert get(router, "genmesh_router_workers") == 2

    assert delta(faulty0, faulty1, "genmesh_worker_engine_errors_total", code="unavailable") == 1
    assert delta(faulty0, faulty1, "genmesh_worker_requests_total", outcome="failed") == 1
    completed = [
        delta(faulty0, faulty1, "genmesh_worker_requests_total", outcome="completed"),
        delta(other0, other1, "genmesh_worker_requests_total", outcome="completed"),
    ]
    assert sum(completed) == sent


def test_loop_histogram_matches_prometheus_client() -> None:
    """The lock-free histogram of the per-token path exposes what the standard one does."""
    from prometheus_client import CollectorRegistry, Histogram

    from genmesh.shared.metrics import LoopHistogram

    buckets = (0.001, 0.01, 0.1, 1.0)
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    loop = LoopHistogram("h", "doc", ["a"], buckets, ours)
    standard = Histogram("h", "doc", ["a"], buckets=buckets, registry=theirs)
    for amount in (0.0, 0.001, 0.0011, 0.01, 0.5, 1.0, 2.0, 1e9):
        loop.labels("x").observe(amount)
        standard.labels("x").observe(amount)

    def samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
        return {
            (s.name, s.labels.get("le", "")): s.value
            for family in registry.collect()
            for s in family.samples
            if not s.name.endswith("_created")
        }

    assert samples(ours) == samples(theirs)
    assert samples(ours)[("h_bucket", "0.001")] == 2  # `le` includes the bound

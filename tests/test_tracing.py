"""OpenTelemetry traces: one trace per request, a span per hop, W3C context in NATS headers.

In-process (an InMemorySpanExporter): the header helpers, tracing switched off, the engine
call span, and the whole chain with every service in this process. Across processes: a
mesh exporting OTLP/HTTP to a small receiver in this test, for the parent/child chain,
the attributes and a migrated request; and the console/none exporters of a frontend.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import secrets
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import aiohttp
import nats
import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from genmesh.client import MeshClient, request
from genmesh.client.tracing import attempt_span
from genmesh.engines.base import EngineOutput
from genmesh.engines.http import HttpEngineConfig
from genmesh.engines.mock import MockEngine
from genmesh.engines.sglang import SglangEngine
from genmesh.engines.tracing import engine_call
from genmesh.services.frontend.observers import RequestInfo
from genmesh.services.frontend.serve import start_frontend
from genmesh.services.frontend.traces import TraceObserver
from genmesh.services.router.service import Router
from genmesh.services.worker.service import Worker, WorkerConfig
from genmesh.services.worker.tracing import worker_span
from genmesh.shared import tracing
from genmesh.shared.bus import connect
from genmesh.shared.errors import ErrorCode, MeshError
from genmesh.shared.subjects import Subjects
from genmesh.testkit.common import serving
from genmesh.testkit.config import MockServerConfig
from genmesh.testkit.sglang import build_app
from tests.conftest import unique_namespace
from tests.mesh import Mesh, frontend_options, wait_until

pytestmark = pytest.mark.unit

TRACEPARENT = "00-{}-{}-01"


def new_traceparent() -> tuple[str, str, str]:
    """A caller's traceparent, its trace id and its span id (lower-case hex)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return TRACEPARENT.format(trace_id, span_id), trace_id, span_id


def sglang_body(max_new_tokens: int = 8, rid: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    if rid is not None:
        body["rid"] = rid
    return body


# ============================================================= in process, in memory


@pytest.fixture
def memory() -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process, into memory; off again afterwards."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    try:
        yield exporter
    finally:
        tracing.install(None)
        provider.shutdown()


def hexid(value: int, digits: int = 16) -> str:
    return format(value, f"0{digits}x")


def test_extract_reads_a_capitalised_traceparent() -> None:
    header, trace_id, span_id = new_traceparent()
    for key in ("traceparent", "Traceparent", "TRACEPARENT"):
        ctx = trace.get_current_span(tracing.extract({key: header})).get_span_context()
        assert ctx.is_valid
        assert ctx.is_remote
        assert hexid(ctx.trace_id, 32) == trace_id
        assert hexid(ctx.span_id) == span_id
    assert not trace.get_current_span(tracing.extract(None)).get_span_context().is_valid


def test_inject_replaces_the_context_in_any_case(memory: InMemorySpanExporter) -> None:
    header, trace_id, span_id = new_traceparent()
    incoming = {"Traceparent": header, "genmesh-codec": "json"}
    parent = tracing.extract(incoming)
    tracer = tracing.tracer()
    assert tracer is not None
    span = tracer.start_span("hop", parent)
    out = tracing.inject(incoming, span, parent)
    span.end()
    assert incoming == {"Traceparent": header, "genmesh-codec": "json"}  # not changed
    assert sorted(out) == ["genmesh-codec", "traceparent"]
    _, out_trace, out_parent, _ = out["traceparent"].split("-")
    assert out_trace == trace_id
    assert out_parent == hexid(span.get_span_context().span_id) != span_id
    assert out["genmesh-codec"] == "json"


async def test_off_nothing_is_built() -> None:
    tracing.install(None)
    assert tracing.tracer() is None
    envelope = request([1, 2, 3])
    assert attempt_span(envelope, "genmesh.x.router.generate", None, None) is None
    assert worker_span("s", envelope, "w", "mock", "d") is None
    headers = {"Accept": "text/event-stream"}
    assert tracing.inject_current(headers) is headers

    async def outputs() -> AsyncGenerator[EngineOutput, None]:
        yield EngineOutput(tokens=[1])

    gen = outputs()
    assert engine_call(gen, "sglang", "http://127.0.0.1:1", "/generate") is gen
    await gen.aclose()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, []),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, ["otlp"]),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://h:4318/v1/traces"}, ["otlp"]),
        ({"OTEL_TRACES_EXPORTER": "console"}, ["console"]),
        ({"OTEL_TRACES_EXPORTER": "otlp, Console"}, ["otlp", "console"]),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://h"}, []),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "console"}, []),
        ({"OTEL_SDK_DISABLED": "false", "OTEL_TRACES_EXPORTER": "console"}, ["console"]),
    ],
)
def test_exporters_from_the_standard_variables(env: dict[str, str], expected: list[str]) -> None:
    assert tracing.exporter_names(env) == expected


@pytest.mark.parametrize(
    "env",
    [
        {"OTEL_TRACES_EXPORTER": "jaeger"},
        {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
        {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"},
    ],
)
def test_settings_genmesh_cannot_honour_are_refused(env: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="OTEL_"):
        tracing.exporter_names(env)


async def test_engine_call_span_is_current_only_inside_the_adapter(
    memory: InMemorySpanExporter,
) -> None:
    tracer = tracing.tracer()
    assert tracer is not None
    seen: list[str] = []

    async def adapter() -> AsyncGenerator[EngineOutput, None]:
        seen.append(tracing.inject_current({})["traceparent"])
        yield EngineOutput(tokens=[5, 6])
        seen.append(tracing.inject_current({})["traceparent"])
        yield EngineOutput(tokens=[7], finish={"reason": "length"}, usage={})

    with tracer.start_as_current_span("worker") as worker:
        outputs = engine_call(adapter(), "sglang", "http://127.0.0.1:30000", "/generate")
        got = []
        async for out in outputs:
            got.extend(out.tokens)
            # Between steps, the worker's own code sees its own span, not the engine's.
            assert trace.get_current_span() is worker
    assert got == [5, 6, 7]
    (engine,) = [s for s in memory.get_finished_spans() if s.name == "POST /generate"]
    assert engine.kind is SpanKind.CLIENT
    assert engine.parent is not None
    assert engine.parent.span_id == worker.get_span_context().span_id
    engine_id = hexid(engine.context.span_id)
    assert [tp.split("-")[2] for tp in seen] == [engine_id, engine_id]
    attrs = dict(engine.attributes or {})
    assert attrs["server.address"] == "127.0.0.1"
    assert attrs["server.port"] == 30000
    assert attrs["http.request.method"] == "POST"
    assert attrs["http.response.status_code"] == 200
    assert attrs["genmesh.engine"] == "sglang"
    assert attrs["genmesh.tokens.output"] == 3
    assert attrs["genmesh.finish_reason"] == "length"
    assert [e.name for e in engine.events] == ["first_token", "finish"]
    assert engine.status.status_code is StatusCode.UNSET


async def test_engine_call_records_an_engine_error(memory: InMemorySpanExporter) -> None:
    async def adapter() -> AsyncGenerator[EngineOutput, None]:
        raise MeshError(
            ErrorCode.UNAVAILABLE, "SGLang answered HTTP 503", detail={"status_code": 503}
        )
        yield EngineOutput(tokens=[])  # pragma: no cover

    with pytest.raises(MeshError):
        async for _ in engine_call(adapter(), "sglang", "http://e:1", "/generate"):
            pass
    (engine,) = memory.get_finished_spans()
    assert engine.status.status_code is StatusCode.ERROR
    attrs = dict(engine.attributes or {})
    assert attrs["http.response.status_code"] == 503
    assert attrs["genmesh.error_type"] == "unavailable"
    assert attrs["error.type"] == "unavailable"


def test_observer_keeps_its_span_current_until_finished(memory: InMemorySpanExporter) -> None:
    tracer = tracing.tracer()
    assert tracer is not None
    header, trace_id, span_id = new_traceparent()
    info = RequestInfo("sglang", "POST", "/generate", time.monotonic(), time.time())
    info.headers = {"Traceparent": header}
    before = trace.get_current_span()
    observer = TraceObserver(tracer).request(info)
    current = trace.get_current_span()
    assert hexid(current.get_span_context().trace_id, 32) == trace_id
    observer.finished(503, "unavailable")
    assert trace.get_current_span() is before
    (span,) = memory.get_finished_spans()
    assert span.kind is SpanKind.SERVER
    assert span.parent is not None
    assert hexid(span.parent.span_id) == span_id
    assert span.status.status_code is StatusCode.ERROR
    assert dict(span.attributes or {})["http.response.status_code"] == 503


async def wait_for(predicate: Any, timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what or predicate}")
        await asyncio.sleep(0.02)


def by_kind(spans: list[ReadableSpan], kind: SpanKind) -> list[ReadableSpan]:
    return [s for s in spans if s.kind is kind]


def child_of(span: ReadableSpan, parent: ReadableSpan) -> bool:
    return span.parent is not None and span.parent.span_id == parent.context.span_id


@pytest.fixture
async def in_process_mesh(
    nats_url: str, memory: InMemorySpanExporter
) -> AsyncIterator[tuple[str, Any, Any, Router]]:
    """Frontend, router and an SGLang worker (in front of the mock SGLang server), all in
    this process: one span exporter sees every hop."""
    namespace = unique_namespace("trin")
    subjects = Subjects(namespace)
    async with serving(build_app(MockServerConfig())) as engine_url:
        nc = await connect(nats_url, name="trace-test")
        router = Router(nc, subjects, router_id="r-in")
        worker = Worker(
            nc, subjects, SglangEngine(HttpEngineConfig(engine_url)), WorkerConfig("w-in")
        )
        await worker.start()
        await router.start()
        # Through the router: its span is part of the chain under test.
        frontend = await start_frontend(frontend_options(nats_url, namespace, routing="routers"))
        try:
            await wait_for(
                lambda: (
                    frontend.state.backend.not_ready_reason() is None
                    and bool(router.directory.live())
                ),
                what="discovery",
            )
            yield f"http://127.0.0.1:{frontend.port}", engine_url, nc, router
        finally:
            await frontend.close()
            await router.stop()
            await worker.stop()
            await nc.drain()


@pytest.mark.inproc
async def test_in_process_chain_and_nothing_leaks(
    in_process_mesh: tuple[str, Any, Any, Router], memory: InMemorySpanExporter
) -> None:
    url, engine_url, _, _ = in_process_mesh
    header, trace_id, span_id = new_traceparent()
    memory.clear()
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            url + "/generate", json=sglang_body(rid="in-1"), headers={"Traceparent": header}
        ) as r,
    ):
        assert r.status == 200
        await r.read()
    # This task's context was never touched.
    assert not trace.get_current_span().get_span_context().is_valid

    def ours() -> list[ReadableSpan]:
        return [s for s in memory.get_finished_spans() if hexid(s.context.trace_id, 32) == trace_id]

    await wait_for(lambda: len(ours()) >= 4, what="four spans")
    await asyncio.sleep(0.1)  # nothing more may come
    spans = ours()
    assert len(spans) == 4, [s.name for s in spans]
    (server,) = by_kind(spans, SpanKind.SERVER)
    router_span, worker_span = sorted(
        by_kind(spans, SpanKind.CONSUMER), key=lambda s: s.start_time or 0
    )
    # The frontend's server span stands for the attempt: no span of its own.
    (engine,) = by_kind(spans, SpanKind.CLIENT)
    assert engine.name == "POST /generate"
    assert server.parent is not None
    assert hexid(server.parent.span_id) == span_id
    assert child_of(router_span, server)
    assert child_of(worker_span, router_span)
    assert child_of(engine, worker_span)
    assert dict(router_span.attributes or {})["genmesh.router"] == "r-in"
    assert dict(worker_span.attributes or {})["genmesh.worker"] == "w-in"
    async with aiohttp.ClientSession() as s, s.get(engine_url + "/testkit/state") as r:
        state = await r.json()
    assert f"00-{trace_id}-{hexid(engine.context.span_id)}" in {
        tp.rsplit("-", 1)[0] for tp in state["traceparents"]
    }


@pytest.mark.inproc
async def test_a_frontend_that_routes_makes_no_hop_span_of_its_own(
    in_process_mesh: tuple[str, Any, Any, Router], memory: InMemorySpanExporter, nats_url: str
) -> None:
    """No router span and no attempt span: the worker's span is the server span's child; a
    refusal is a failed attempt's span, which says how the frontend routed."""
    _, _, _, router = in_process_mesh
    namespace = router.subjects.namespace
    frontend = await start_frontend(frontend_options(nats_url, namespace))
    url = f"http://127.0.0.1:{frontend.port}"
    try:
        await wait_for(lambda: frontend.state.backend.not_ready_reason() is None)
        memory.clear()
        async with aiohttp.ClientSession() as s, s.post(url + "/generate", json=sglang_body()) as r:
            assert r.status == 200
            await r.read()
        await wait_for(lambda: len(by_kind(memory.get_finished_spans(), SpanKind.CONSUMER)) == 1)
        await wait_for(lambda: len(by_kind(memory.get_finished_spans(), SpanKind.SERVER)) == 1)
        spans = memory.get_finished_spans()
        assert not [s for s in by_kind(spans, SpanKind.CLIENT) if s.name.startswith("send ")]
        (worker_span,) = by_kind(spans, SpanKind.CONSUMER)
        (server,) = by_kind(spans, SpanKind.SERVER)
        assert child_of(worker_span, server)
        assert dict(worker_span.attributes or {})["genmesh.worker"] == "w-in"

        memory.clear()
        body = {"model": "no-such-model", "token_ids": [1, 2], "sampling_params": {}}
        async with (
            aiohttp.ClientSession() as s,
            s.post(url + "/inference/v1/generate", json=body) as r,
        ):
            assert r.status == 404
        await wait_for(lambda: len(by_kind(memory.get_finished_spans(), SpanKind.SERVER)) == 1)
        spans = memory.get_finished_spans()
        (attempt,) = [s for s in by_kind(spans, SpanKind.CLIENT) if s.name.startswith("send ")]
        assert attempt.status.status_code is StatusCode.ERROR
        assert dict(attempt.attributes or {})["genmesh.router.policy"] == "round_robin"
        assert not by_kind(spans, SpanKind.CONSUMER)
    finally:
        await frontend.close()


@pytest.mark.inproc
async def test_a_batch_has_a_hop_per_generation_under_the_server_span(
    in_process_mesh: tuple[str, Any, Any, Router], memory: InMemorySpanExporter
) -> None:
    """The items' streams are pumped by tasks of their own: they inherit the HTTP span, so
    each generation's router span is its child."""
    url = in_process_mesh[0]
    memory.clear()
    body = {"input_ids": [[1, 2, 3], [4, 5, 6]], "sampling_params": {"max_new_tokens": 3}}
    async with aiohttp.ClientSession() as s, s.post(url + "/generate", json=body) as r:
        assert r.status == 200
        assert len(await r.json()) == 2
    await wait_for(lambda: len(by_kind(memory.get_finished_spans(), SpanKind.SERVER)) == 1)
    await wait_for(lambda: len(by_kind(memory.get_finished_spans(), SpanKind.CONSUMER)) == 4)
    spans = memory.get_finished_spans()
    (server,) = by_kind(spans, SpanKind.SERVER)
    assert not [s for s in by_kind(spans, SpanKind.CLIENT) if s.name.startswith("send ")]
    hops = [s for s in by_kind(spans, SpanKind.CONSUMER) if ".router." in s.name]
    assert len(hops) == 2
    assert all(child_of(h, server) for h in hops)
    assert len({dict(h.attributes or {})["genmesh.request_id"] for h in hops}) == 2
    attrs = dict(server.attributes or {})
    assert attrs["genmesh.items"] == 2
    assert attrs["genmesh.tokens.output"] == 6
    assert [e.name for e in server.events].count("finish") == 2


@pytest.mark.inproc
async def test_in_process_rejections_are_error_spans(
    in_process_mesh: tuple[str, Any, Any, Router], memory: InMemorySpanExporter
) -> None:
    """A router that cannot route, and a worker that refuses, each end their span ERROR."""
    _url, _, nc, router = in_process_mesh
    async with MeshClient(nc, router.subjects.namespace, ack_timeout_s=2) as client:
        await client.start()
        memory.clear()
        frames_ = [f async for f in client.generate(request([1, 2], model="no-such-model"))]
        assert frames_[-1]["code"] == "not_found"
        (attempt,) = by_kind(memory.get_finished_spans(), SpanKind.CLIENT)
        (routed,) = by_kind(memory.get_finished_spans(), SpanKind.CONSUMER)
        assert attempt.status.status_code is StatusCode.ERROR
        assert routed.status.status_code is StatusCode.ERROR
        assert dict(routed.attributes or {})["genmesh.error_type"] == "not_found"
        assert child_of(routed, attempt)

        memory.clear()
        envelope = request([1, 2], max_tokens=2)
        await client.cancel(envelope.id)  # tombstoned: the worker refuses it
        await asyncio.sleep(0.1)
        frames_ = [f async for f in client.generate(envelope)]
        assert frames_[-1]["code"] == "cancelled"
        refused = [
            s for s in by_kind(memory.get_finished_spans(), SpanKind.CONSUMER) if "worker" in s.name
        ]
        assert len(refused) == 1
        assert dict(refused[0].attributes or {})["genmesh.error_type"] == "cancelled"


@pytest.mark.inproc
async def test_mesh_client_attempt_is_a_child_of_the_callers_span(
    in_process_mesh: tuple[str, Any, Any, Router], memory: InMemorySpanExporter
) -> None:
    _, _, nc, router = in_process_mesh
    tracer = tracing.tracer()
    assert tracer is not None
    async with MeshClient(nc, router.subjects.namespace) as client:
        await client.start()
        memory.clear()
        with tracer.start_as_current_span("caller") as caller:
            got = [f async for f in client.generate(request([4, 5, 6], max_tokens=3))]
        assert got[-1]["t"] == "end"
    spans = memory.get_finished_spans()
    (attempt,) = [s for s in by_kind(spans, SpanKind.CLIENT) if s.name.startswith("send ")]
    assert attempt.parent is not None
    assert attempt.parent.span_id == caller.get_span_context().span_id
    attrs = dict(attempt.attributes or {})
    assert attrs["messaging.system"] == "nats"
    assert attrs["messaging.destination.name"] == router.subjects.router_generate
    assert attrs["genmesh.attempt"] == 1
    assert attrs["genmesh.worker"] == "w-in"
    assert attrs["genmesh.tokens.output"] == 3
    assert [e.name for e in attempt.events] == ["first_token", "finish"]


# ============================================================= across processes, OTLP/HTTP


@dataclass
class Received:
    trace_id: str
    span_id: str
    parent: str | None
    name: str
    kind: int
    attrs: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    status: int
    service: str
    resource: dict[str, Any] = field(default_factory=dict)


def _value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which == "array_value":
        return [_value(v) for v in value.array_value.values]
    return None if which is None else getattr(value, which)


class OtlpReceiver:
    """A minimal OTLP/HTTP trace receiver: POST /v1/traces with a protobuf
    ExportTraceServiceRequest (what the exporter sends), in a thread."""

    def __init__(self) -> None:
        self.spans: list[Received] = []
        self.paths: list[str] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                with receiver.lock:
                    receiver.paths.append(self.path)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver.add(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, req: ExportTraceServiceRequest) -> None:
        found = []
        for rs in req.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    found.append(
                        Received(
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent=s.parent_span_id.hex() or None,
                            name=s.name,
                            kind=s.kind,
                            attrs={kv.key: _value(kv.value) for kv in s.attributes},
                            events=[
                                (e.name, {kv.key: _value(kv.value) for kv in e.attributes})
                                for e in s.events
                            ],
                            status=s.status.code,
                            service=str(resource.get("service.name")),
                            resource=resource,
                        )
                    )
        with self.lock:
            self.spans.extend(found)

    def trace(self, trace_id: str) -> list[Received]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


SERVER = trace_pb2.Span.SpanKind.SPAN_KIND_SERVER
CLIENT = trace_pb2.Span.SpanKind.SPAN_KIND_CLIENT
CONSUMER = trace_pb2.Span.SpanKind.SPAN_KIND_CONSUMER
STATUS_ERROR = trace_pb2.Status.StatusCode.STATUS_CODE_ERROR
STATUS_UNSET = trace_pb2.Status.StatusCode.STATUS_CODE_UNSET
SGLANG_WORKER = "w-sglang"
FAULTY_WORKER = "w-faulty"


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def traced(
    nats_url: str, tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver
) -> Iterator[tuple[Mesh, str]]:
    """A mesh exporting OTLP/HTTP to `receiver`: a router, a frontend, an SGLang worker in
    front of the mock SGLang server and a mock worker that takes injected faults (both
    with the same token model, so a request can move between them)."""
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "50",
    }
    mesh = Mesh(nats_url, tmp_path_factory.mktemp("traced"), unique_namespace("tr"), env=env)
    try:
        _, engine_url = mesh.spawn_engine_server("sglang")
        mesh.add_router()
        mesh.add_frontend("--routing", "routers")  # the router's spans are under test
        mesh.add_worker(SGLANG_WORKER, engine="sglang", engine_url=engine_url)
        mesh.add_worker(FAULTY_WORKER, testkit_faults=True)
        yield mesh, engine_url
    except BaseException:
        print(mesh.logs())
        raise
    finally:
        mesh.stop()


async def traced_request(mesh: Mesh, receiver: OtlpReceiver, rid: str) -> list[Received]:
    """One unary SGLang request under a caller's traceparent: the spans of its trace once
    every hop's span has arrived (a worker span per attempt, each under a router span; a
    failed attempt's own span ends before its worker's)."""
    header, trace_id, _ = new_traceparent()
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            mesh.http_url + "/generate", json=sglang_body(8, rid), headers={"traceparent": header}
        ) as r,
    ):
        body = await r.json()
        assert r.status == 200, body
        assert len(body["output_ids"]) == 8

    def complete() -> bool:
        spans = receiver.trace(trace_id)
        workers = [s for s in spans if s.service == "genmesh-worker" and s.kind == CONSUMER]
        routers = [s for s in spans if s.service == "genmesh-router"]
        served_by_sglang = [s for s in workers if s.attrs["genmesh.worker"] == SGLANG_WORKER]
        engines = [s for s in spans if s.name == "POST /generate" and s.kind == CLIENT]
        return (
            any(s.kind == SERVER for s in spans)
            and len(routers) >= 1
            and len(workers) == len(routers)
            and len(engines) == len(served_by_sglang)
        )

    await asyncio.to_thread(wait_until, complete, 15.0, 0.05, f"the spans of trace {trace_id}")
    await asyncio.sleep(0.2)  # nothing more may come
    return receiver.trace(trace_id)


def one(spans: list[Received], **match: Any) -> Received:
    found = [s for s in spans if all(getattr(s, k) == v for k, v in match.items())]
    assert len(found) == 1, (match, [(s.name, s.service, s.kind) for s in spans])
    return found[0]


def children(spans: list[Received], parent: Received) -> list[Received]:
    return [s for s in spans if s.parent == parent.span_id]


@pytest.mark.process
async def test_one_trace_across_processes(traced: tuple[Mesh, str], receiver: OtlpReceiver) -> None:
    mesh, engine_url = traced
    spans: list[Received] = []
    for n in range(6):  # round robin: within two requests one lands on the SGLang worker
        spans = await traced_request(mesh, receiver, f"trace-{n}")
        if any(s.attrs.get("genmesh.engine") == "sglang" and s.kind == CLIENT for s in spans):
            break
    else:
        pytest.fail("no request reached the SGLang worker")
    assert len({s.trace_id for s in spans}) == 1
    assert len(spans) == 4, [(s.name, s.service) for s in spans]
    assert receiver.paths
    assert set(receiver.paths) == {"/v1/traces"}

    server = one(spans, kind=SERVER)
    assert server.service == "genmesh-frontend"
    assert server.name == "POST /generate"
    assert server.attrs["http.request.method"] == "POST"
    assert server.attrs["http.route"] == "/generate"
    assert server.attrs["http.response.status_code"] == 200
    assert server.attrs["genmesh.format"] == "sglang"
    assert server.attrs["genmesh.client_id"] == server.attrs["genmesh.public_id"]
    assert server.attrs["genmesh.client_id"].startswith("trace-")
    assert server.attrs["genmesh.tokens.output"] == 8
    assert server.attrs["genmesh.finish_reason"] == "length"
    assert [e for e, _ in server.events] == ["first_token", "finish"]
    assert server.status == STATUS_UNSET

    # The server span stands for the (one, successful) attempt: the router's is its child.
    (routed,) = children(spans, server)
    assert routed.kind == CONSUMER
    assert routed.service == "genmesh-router"
    assert routed.attrs["messaging.system"] == "nats"
    assert routed.attrs["genmesh.router.policy"] == "round_robin"
    assert routed.attrs["genmesh.router.candidates"] == 2
    assert sorted(routed.attrs["genmesh.router.candidate_ids"]) == [FAULTY_WORKER, SGLANG_WORKER]
    assert routed.attrs["genmesh.worker"] == SGLANG_WORKER
    assert routed.resource["service.instance.id"] == routed.attrs["genmesh.router"]

    (worker,) = children(spans, routed)
    assert worker.kind == CONSUMER
    assert worker.service == "genmesh-worker"
    assert worker.name == f"process genmesh.{mesh.namespace}.worker.{SGLANG_WORKER}.generate"
    assert worker.resource["service.instance.id"] == SGLANG_WORKER
    assert worker.attrs["genmesh.engine"] == "sglang"
    assert worker.attrs["genmesh.dispatch_id"]
    assert worker.attrs["genmesh.request_id"] == server.attrs["genmesh.request_id"]
    assert worker.attrs["genmesh.attempt"] == 1
    assert worker.attrs["genmesh.tokens.output"] == 8
    assert worker.attrs["genmesh.finish_reason"] == "length"
    assert [e for e, _ in worker.events] == ["first_token", "finish"]

    (engine,) = children(spans, worker)
    assert engine.kind == CLIENT
    assert engine.name == "POST /generate"
    assert engine.attrs["server.address"] == "127.0.0.1"
    assert engine.attrs["server.port"] == int(engine_url.rsplit(":", 1)[1])
    assert engine.attrs["http.response.status_code"] == 200
    assert engine.attrs["genmesh.engine"] == "sglang"
    # The engine heard of the engine span: its traceparent names it as the parent.
    async with aiohttp.ClientSession() as s, s.get(engine_url + "/testkit/state") as r:
        received = (await r.json())["traceparents"]
    assert any(tp.split("-")[1:3] == [engine.trace_id, engine.span_id] for tp in received), received


@pytest.mark.process
async def test_a_migrated_request_shows_each_attempt_in_one_trace(
    traced: tuple[Mesh, str], receiver: OtlpReceiver, nats_url: str
) -> None:
    mesh, _ = traced
    nc = await nats.connect(nats_url)
    try:
        fault = {"kind": "drop", "after_tokens": 2}
        subject = Subjects(mesh.namespace).testkit(FAULTY_WORKER)
        await nc.request(subject, json.dumps(fault).encode(), timeout=5)
        spans: list[Received] = []
        for n in range(6):  # until a request lands on the faulty worker and migrates
            spans = await traced_request(mesh, receiver, f"migrate-{n}")
            if sum(s.service == "genmesh-router" for s in spans) > 1:
                break
        else:
            pytest.fail("no request migrated")
        state = json.loads((await nc.request(subject, b"{}", timeout=5)).data)
        assert state["faults_pending"] == []
    finally:
        await nc.drain()

    assert len({s.trace_id for s in spans}) == 1
    server = one(spans, kind=SERVER)
    # The failed attempt has a span of its own (made when it failed); the one that
    # succeeded has none: the server span stands for it.
    (failed,) = [s for s in children(spans, server) if s.kind == CLIENT]
    assert failed.name == f"send genmesh.{mesh.namespace}.router.generate"
    assert failed.attrs["genmesh.attempt"] == 1
    assert failed.status == STATUS_ERROR
    assert failed.attrs["genmesh.error_type"] == "unavailable"
    assert failed.attrs["genmesh.worker"] == FAULTY_WORKER
    assert failed.attrs["genmesh.request_id"] == server.attrs["genmesh.request_id"]
    assert children(spans, failed) == []
    assert server.status == STATUS_UNSET
    assert server.attrs["http.response.status_code"] == 200
    assert server.attrs["genmesh.tokens.output"] == 8
    (migration,) = [a for e, a in server.events if e == "migration"]
    assert migration["genmesh.attempt"] == 2
    assert migration["genmesh.from_worker"] == FAULTY_WORKER
    assert migration["genmesh.delivered"] == 2
    # Each attempt: its own router span under the server span, and under it the worker
    # span that ran it.
    routers = [s for s in children(spans, server) if s.service == "genmesh-router"]
    workers = {}
    for routed in routers:
        (worker,) = children(spans, routed)
        assert worker.attrs["genmesh.worker"] == routed.attrs["genmesh.worker"]
        workers[worker.attrs["genmesh.attempt"]] = (routed, worker)
    (_, first), (second_route, second) = workers[1], workers[2]
    assert first.attrs["genmesh.worker"] == FAULTY_WORKER
    assert first.status == STATUS_ERROR
    assert first.attrs["genmesh.tokens.output"] == 2
    assert second.attrs["genmesh.worker"] == SGLANG_WORKER
    assert second.status == STATUS_UNSET
    assert second.attrs["genmesh.tokens.output"] == 6
    assert second.attrs["genmesh.request_id"] == first.attrs["genmesh.request_id"] + "~2"
    # The second attempt was routed with the first worker excluded.
    assert second_route.attrs["genmesh.router.candidates"] == 1


# ============================================================= console and none


def frontend_output(nats_url: str, workdir: Path, env: dict[str, str]) -> str:
    """What a frontend process printed (stdout and stderr) around one request."""
    mesh = Mesh(nats_url, workdir, unique_namespace("trc"), env=env)
    try:
        frontend = mesh.add_frontend()
        # No router or worker: a 503, which is still a request with a span.
        req = urllib.request.Request(
            mesh.http_url + "/generate", data=json.dumps(sglang_body(2)).encode(), method="POST"
        )
        with pytest.raises(urllib.error.HTTPError, match="503"):
            urllib.request.urlopen(req, timeout=5)
        assert frontend.terminate() == 0  # a stop exports what is still buffered
        return frontend.log()
    finally:
        mesh.stop()


@pytest.mark.process
def test_console_exporter_prints_spans(nats_url: str, tmp_path: Path) -> None:
    log = frontend_output(nats_url, tmp_path, {"OTEL_TRACES_EXPORTER": "console"})
    assert '"name": "POST /generate"' in log
    assert '"kind": "SpanKind.SERVER"' in log
    assert '"service.name": "genmesh-frontend"' in log
    assert '"http.response.status_code": 503' in log


@pytest.mark.process
@pytest.mark.parametrize("exporter", ["none", None])
def test_none_or_nothing_set_prints_no_span(
    nats_url: str, tmp_path: Path, exporter: str | None
) -> None:
    env = {} if exporter is None else {"OTEL_TRACES_EXPORTER": exporter}
    log = frontend_output(nats_url, tmp_path, env)
    assert "trace_id" not in log
    assert "tracing on" not in log


@pytest.mark.process
def test_an_unknown_exporter_stops_start_up(nats_url: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GENMESH_", "OTEL_"))}
    env["OTEL_TRACES_EXPORTER"] = "zipkin"
    done = subprocess.run(
        [sys.executable, "-m", "genmesh", "router", "--nats-url", nats_url],
        env=env,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert b"OTEL_TRACES_EXPORTER: unknown exporter 'zipkin'" in done.stderr


@pytest.mark.process
async def test_the_sampler_variables_decide_for_the_whole_mesh(
    nats_url: str, tmp_path: Path
) -> None:
    """`OTEL_TRACES_SAMPLER=parentbased_traceidratio` with ratio 0: a request that comes
    without a sampled caller makes no span in any process (the frontend's unsampled context
    travels on, so no hop samples on its own); a caller's sampled flag is honoured by all."""
    receiver = OtlpReceiver()
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0",
    }
    mesh = Mesh(nats_url, tmp_path, unique_namespace("trs"), env=env)
    try:
        mesh.add_router()
        mesh.add_frontend("--routing", "routers")  # every kind of process is under test
        mesh.add_worker()
        sampled, trace_id, _ = new_traceparent()
        unsampled = sampled[:-2] + "00"
        async with aiohttp.ClientSession() as s:
            for headers in ({}, {"traceparent": unsampled}, {"traceparent": sampled}):
                async with s.post(
                    mesh.http_url + "/generate", json=sglang_body(4), headers=headers
                ) as r:
                    assert r.status == 200, await r.text()

        def complete() -> bool:
            return len(receiver.trace(trace_id)) >= 3

        await asyncio.to_thread(wait_until, complete, 15.0, 0.05, "the sampled trace")
        await asyncio.sleep(0.3)  # nothing more may come
        spans = receiver.spans
        assert {s.trace_id for s in spans} == {trace_id}, [(s.name, s.service) for s in spans]
        assert sorted(s.service for s in spans) == [
            "genmesh-frontend",
            "genmesh-router",
            "genmesh-worker",
        ]
    except BaseException:
        print(mesh.logs())
        raise
    finally:
        mesh.stop()
        receiver.close()


@pytest.mark.inproc
async def test_a_disaggregated_request_is_one_trace_of_both_halves(
    nats_url: str, memory: InMemorySpanExporter
) -> None:
    """Frontend → decode worker → (its attempt) → prefill worker: one trace, each hop the
    child of the one before, the worker spans saying their P/D part."""
    namespace = unique_namespace("trpd")
    subjects = Subjects(namespace)
    nc = await connect(nats_url, name="trace-pd-test")
    prefill = Worker(nc, subjects, MockEngine(), WorkerConfig("w-pre", role="prefill"))
    decode = Worker(nc, subjects, MockEngine(), WorkerConfig("w-dec", role="decode"))
    await prefill.start()
    await decode.start()
    frontend = await start_frontend(frontend_options(nats_url, namespace))
    try:
        await wait_for(
            lambda: (
                frontend.state.backend.not_ready_reason() is None
                and decode.pd_decoder is not None
                and "w-pre" in decode.pd_decoder.directory.workers
            ),
            what="discovery",
        )
        memory.clear()
        header, trace_id, span_id = new_traceparent()
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                f"http://127.0.0.1:{frontend.port}/generate",
                json=sglang_body(),
                headers={"traceparent": header},
            ) as r,
        ):
            assert r.status == 200
            await r.read()

        def ours() -> list[ReadableSpan]:
            return [
                s for s in memory.get_finished_spans() if hexid(s.context.trace_id, 32) == trace_id
            ]

        await wait_for(lambda: len(by_kind(ours(), SpanKind.CONSUMER)) == 2, what="both halves")
        spans = ours()
        (server,) = by_kind(spans, SpanKind.SERVER)
        workers = {
            dict(s.attributes or {})["genmesh.worker"]: s for s in by_kind(spans, SpanKind.CONSUMER)
        }
        (stage_attempt,) = [
            s for s in by_kind(spans, SpanKind.CLIENT) if s.name.startswith("send ")
        ]
        assert child_of(workers["w-dec"], server)
        assert child_of(stage_attempt, workers["w-dec"])
        assert child_of(workers["w-pre"], stage_attempt)
        assert dict(workers["w-dec"].attributes or {})["genmesh.pd.role"] == "decode"
        assert dict(workers["w-dec"].attributes or {})["genmesh.pd.prefill_worker"] == "w-pre"
        assert dict(workers["w-pre"].attributes or {})["genmesh.pd.role"] == "prefill"
        assert server.parent is not None
        assert hexid(server.parent.span_id) == span_id
    finally:
        await frontend.close()
        await decode.stop()
        await prefill.stop()
        await nc.drain()

"""genmesh's own spans (shared/spans.py): what they record, how they are sampled (as the
SDK samples), and the batch queue behind them (bounded, drained by one thread, flushed by
shutdown)."""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    DEFAULT_ON,
    Decision,
    ParentBased,
    ParentBasedTraceIdRatio,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
    _get_from_env_or_default,
)
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    StatusCode,
    TraceFlags,
    TraceState,
)

from genmesh.shared import tracing
from genmesh.shared.errors import ErrorCode
from genmesh.shared.otlp import OTLPExporter, encode_request, encode_span, encode_spans
from genmesh.shared.spans import (
    ENCODE_CHUNK,
    MAX_EVENTS,
    LightSpan,
    LightTracer,
    LightTracerProvider,
    is_parent_based_always_on,
)
from tests.mesh import wait_until

pytestmark = pytest.mark.unit

RESOURCE = Resource.create({"service.name": "genmesh-test"})


class Memory:
    """An exporter that keeps what it is given; `gate`, when set, holds each export until
    it is opened."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.spans: list[Any] = []
        self.gate = gate
        self.exporting = threading.Event()
        self.shut = False

    def export(self, spans: Sequence[Any]) -> None:
        self.exporting.set()
        if self.gate is not None:
            self.gate.wait(10)
        self.spans.extend(spans)

    def shutdown(self) -> None:
        self.shut = True


@pytest.fixture
def memory(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[LightTracer, Memory]]:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "3600000")  # only shutdown exports
    exporter = Memory()
    provider = LightTracerProvider(DEFAULT_ON, RESOURCE, [exporter])
    yield provider.get_tracer("genmesh", "1.0"), exporter
    provider.shutdown()


def remote(sampled: bool = True, state: TraceState | None = None) -> SpanContext:
    return SpanContext(
        trace_id=(1 << 120) | 99,
        span_id=(1 << 60) | 3,
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT),
        trace_state=state,
    )


def test_a_span_records_what_it_is_given(memory: tuple[LightTracer, Memory]) -> None:
    tracer, _ = memory
    given = {"messaging.system": "nats", "genmesh.attempt": 1}
    span = tracer.start_span("process s", kind=SpanKind.CONSUMER, attributes=given)
    assert isinstance(span, LightSpan)
    given["genmesh.attempt"] = 2  # the span has its own copy
    span.set_attribute("genmesh.worker", "w-1")
    span.set_attributes({"genmesh.tokens.output": 16, "genmesh.router.candidate_ids": ["a"]})
    span.add_event(tracing.FIRST_TOKEN)
    span.add_event(tracing.FINISH, {"genmesh.finish_reason": "length"}, timestamp=123)
    span.update_name("process t")
    assert span.is_recording()
    span.end(end_time=span.start_time + 5)
    assert not span.is_recording()
    # Ended: nothing changes any more, and a second end does nothing.
    span.set_attribute("late", 1)
    span.add_event("late")
    span.set_status(StatusCode.ERROR, "late")
    span.end()
    assert span.name == "process t"
    assert dict(span.attributes) == {
        "messaging.system": "nats",
        "genmesh.attempt": 1,
        "genmesh.worker": "w-1",
        "genmesh.tokens.output": 16,
        "genmesh.router.candidate_ids": ["a"],
    }
    assert [(name, attrs) for name, _, attrs in span.events] == [
        ("first_token", None),
        ("finish", {"genmesh.finish_reason": "length"}),
    ]
    assert span.events[1][1] == 123
    assert span.end_time == span.start_time + 5
    assert span.status.status_code is StatusCode.UNSET
    assert span.kind is SpanKind.CONSUMER
    assert span.resource is RESOURCE
    assert (span.instrumentation_scope.name, span.instrumentation_scope.version) == (
        "genmesh",
        "1.0",
    )


def test_status_and_errors_as_the_sdk_sets_them(memory: tuple[LightTracer, Memory]) -> None:
    tracer, _ = memory
    failed = tracer.start_span("failed")
    tracing.fail(failed, ErrorCode.UNAVAILABLE.value, "worker gone")
    assert failed.status.status_code is StatusCode.ERROR  # type: ignore[attr-defined]
    assert failed.status.description == "worker gone"  # type: ignore[attr-defined]
    assert failed.attributes["error.type"] == "unavailable"  # type: ignore[attr-defined]
    cancelled = tracer.start_span("cancelled")
    tracing.fail(cancelled, ErrorCode.CANCELLED.value, "cancelled")
    assert cancelled.status.status_code is StatusCode.UNSET  # type: ignore[attr-defined]
    assert cancelled.attributes == {"genmesh.error_type": "cancelled"}  # type: ignore[attr-defined]
    ok = tracer.start_span("ok")
    ok.set_status(StatusCode.OK)
    ok.set_status(StatusCode.ERROR, "after OK: ignored, as the SDK does")
    assert ok.status.status_code is StatusCode.OK  # type: ignore[attr-defined]
    raised = tracer.start_span("raised")
    try:
        raise ValueError("boom")
    except ValueError as exc:
        raised.record_exception(exc, {"extra": 1})
    ((name, _, attributes),) = raised.events  # type: ignore[attr-defined]
    assert name == "exception"
    assert attributes["exception.type"] == "ValueError"
    assert attributes["exception.message"] == "boom"
    assert "raise ValueError" in attributes["exception.stacktrace"]
    assert attributes["extra"] == 1
    # start_as_current_span: current inside, the error recorded on the way out.
    current = None
    try:
        with tracer.start_as_current_span("current") as current:
            assert trace.get_current_span() is current
            raise KeyError("k")
    except KeyError:
        pass
    assert current is not None
    assert current.status.status_code is StatusCode.ERROR  # type: ignore[attr-defined]
    assert current.end_time is not None  # type: ignore[attr-defined]


def test_events_beyond_the_limit_are_counted(memory: tuple[LightTracer, Memory]) -> None:
    tracer, _ = memory
    span = tracer.start_span("many")
    for n in range(MAX_EVENTS + 3):
        span.add_event(f"e{n}")
    assert len(span.events) == MAX_EVENTS  # type: ignore[attr-defined]
    assert span.dropped_events == 3  # type: ignore[attr-defined]


def test_parent_and_child_ids(memory: tuple[LightTracer, Memory]) -> None:
    tracer, _ = memory
    parent_ctx = remote(state=TraceState([("vendor", "x")]))
    child = tracer.start_span("child", trace.set_span_in_context(NonRecordingSpan(parent_ctx)))
    ctx = child.get_span_context()
    assert ctx.trace_id == parent_ctx.trace_id
    assert ctx.span_id not in (0, parent_ctx.span_id)
    assert not ctx.is_remote
    assert ctx.trace_flags.sampled
    assert ctx.trace_state == parent_ctx.trace_state
    assert child.parent == parent_ctx  # type: ignore[attr-defined]
    # A local child of that span: same trace, the span as parent, in the headers too.
    grandchild = tracer.start_span("grandchild", trace.set_span_in_context(child))
    assert grandchild.parent == ctx  # type: ignore[attr-defined]
    assert grandchild.get_span_context().trace_id == ctx.trace_id
    headers = tracing.inject({}, grandchild)
    _, trace_hex, span_hex, _ = headers["traceparent"].split("-")
    assert int(trace_hex, 16) == ctx.trace_id
    assert int(span_hex, 16) == grandchild.get_span_context().span_id
    root = tracer.start_span("root")
    assert root.parent is None  # type: ignore[attr-defined]
    assert root.get_span_context().trace_id not in (0, ctx.trace_id)
    # The current span is the default parent.
    with trace.use_span(root):
        assert tracer.start_span("in").parent == root.get_span_context()  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "sampler",
    [DEFAULT_ON, ALWAYS_ON, ALWAYS_OFF, ParentBasedTraceIdRatio(0), TraceIdRatioBased(1.0)],
    ids=["parentbased_always_on", "always_on", "always_off", "parentbased_ratio_0", "ratio_1"],
)
def test_sampling_decides_as_the_sdk(sampler: Sampler, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same sampler, same parent: the same decision, flags and trace as the SDK's tracer;
    sampled out, a NonRecordingSpan that carries the unsampled context on."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "3600000")
    light = LightTracerProvider(sampler, RESOURCE, [Memory()])
    sdk = TracerProvider(sampler=sampler, resource=RESOURCE)
    try:
        local = SpanContext(5 << 64, 7, is_remote=False, trace_flags=TraceFlags(0))
        parents = [
            None,
            remote(sampled=True),
            remote(sampled=False),
            remote(state=TraceState([("congo", "t61rcWkgMzE")])),
            local,
            SpanContext(5 << 64, 7, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED)),
        ]
        for parent in parents:
            context = (
                None if parent is None else trace.set_span_in_context(NonRecordingSpan(parent))
            )
            ours = light.get_tracer("genmesh").start_span("s", context)
            theirs = sdk.get_tracer("genmesh").start_span("s", context)
            assert ours.is_recording() == theirs.is_recording(), parent
            assert isinstance(ours, NonRecordingSpan) == (not theirs.is_recording())
            got, want = ours.get_span_context(), theirs.get_span_context()
            assert got.trace_flags == want.trace_flags, parent
            assert got.trace_state == want.trace_state, parent
            assert got.is_valid
            if parent is not None:
                assert got.trace_id == want.trace_id == parent.trace_id
            # What the next hop hears: the same flags in traceparent.
            assert (
                tracing.inject({}, ours)["traceparent"][-2:]
                == (tracing.inject({}, theirs)["traceparent"][-2:])
            )
    finally:
        light.shutdown()
        sdk.shutdown()


def test_a_light_span_encodes_as_the_sdk_encodes_its_copy(
    memory: tuple[LightTracer, Memory],
) -> None:
    tracer, _ = memory
    parent = trace.set_span_in_context(NonRecordingSpan(remote(state=TraceState([("k", "v")]))))
    span = tracer.start_span(
        "process s", parent, kind=SpanKind.CONSUMER, attributes={"s": "é", "i": 7, "f": 2.5}
    )
    span.set_attributes({"b": True, "strs": ["a", "b"], "neg": -3})
    span.add_event("first_token")
    span.add_event("finish", {"genmesh.tokens.output": 16})
    tracing.fail(span, "unavailable", "worker gone")
    span.end()
    assert isinstance(span, LightSpan)
    decoded = ExportTraceServiceRequest.FromString(encode_spans([span]))
    assert decoded == sdk_encode([span.readable()])


def gated(
    monkeypatch: pytest.MonkeyPatch, **env: str
) -> tuple[LightTracerProvider, LightTracer, Memory, threading.Event]:
    """A provider exporting batches of 4 (and `env`'s OTEL_BSP_*) to an exporter that
    holds each export until its gate opens; the schedule is an hour away."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "3600000")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "4")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    gate = threading.Event()
    exporter = Memory(gate)
    provider = LightTracerProvider(DEFAULT_ON, RESOURCE, [exporter])
    return provider, provider.get_tracer("genmesh"), exporter, gate


def test_the_queue_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    provider, tracer, exporter, gate = gated(monkeypatch, OTEL_BSP_MAX_QUEUE_SIZE="4")
    try:
        for _ in range(4):  # a full batch wakes the thread, which then waits at the gate
            tracer.start_span("first").end()
        assert exporter.exporting.wait(10)
        for _ in range(5):  # the queue holds 4: the fifth is dropped and counted
            tracer.start_span("second").end()
        assert provider.batcher.dropped == 1
    finally:
        gate.set()
        provider.shutdown()
    assert [s.name for s in exporter.spans] == ["first"] * 4 + ["second"] * 4


def test_spans_that_end_during_an_export_wait_for_a_full_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As the SDK's batch processor: a full batch wakes the thread, which then exports
    full batches only (not the few spans that ended while it was exporting)."""
    provider, tracer, exporter, gate = gated(monkeypatch)
    try:
        for _ in range(4):
            tracer.start_span("first").end()
        assert exporter.exporting.wait(10)
        for _ in range(2):  # while the first batch is out
            tracer.start_span("second").end()
        gate.set()
        wait_until(lambda: len(exporter.spans) == 4)
        time.sleep(0.2)  # time enough for the thread to export the two, if it would
        assert len(exporter.spans) == 4
        for _ in range(2):  # now a full batch waits
            tracer.start_span("third").end()
        wait_until(lambda: len(exporter.spans) == 8)
    finally:
        provider.shutdown()
    assert [s.name for s in exporter.spans] == ["first"] * 4 + ["second"] * 2 + ["third"] * 2


def posting_exporter(monkeypatch: pytest.MonkeyPatch) -> tuple[OTLPExporter, list[bytes]]:
    """An OTLP exporter whose posts are kept, not sent; batches only when asked."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "3600000")
    exporter = OTLPExporter(endpoint="http://127.0.0.1:9/v1/traces")
    posted: list[bytes] = []

    def post(data: bytes) -> Any:
        posted.append(data)
        return SimpleNamespace(success=True)

    monkeypatch.setattr(exporter._client, "export", post)
    return exporter, posted


def end_spans(tracer: LightTracer, count: int, bad_at: int) -> list[trace.Span]:
    """`count` spans ended, and one that cannot be encoded (an integer beyond int64) after
    the span `bad_at`; the good ones."""
    spans = []
    for n in range(count):
        span = tracer.start_span(f"s{n}", attributes={"genmesh.attempt": n})
        span.add_event("first_token")
        span.end()
        spans.append(span)
        if n == bad_at:
            tracer.start_span("bad", attributes={"n": -(1 << 70)}).end()
    return spans


def test_an_otlp_exporter_posts_the_encoding_of_its_batch(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Spans that end outside an event loop wait as themselves, and the exporter encodes
    them in the export thread: what is posted is what `encode_spans` makes of the same
    spans (which the SDK's classes read as the SDK encodes them:
    test_a_light_span_encodes_as_the_sdk_encodes_its_copy). A span that cannot be encoded
    is dropped and logged; the rest of its batch goes out."""
    exporter, posted = posting_exporter(monkeypatch)
    provider = LightTracerProvider(DEFAULT_ON, RESOURCE, [exporter])
    spans = end_spans(provider.get_tracer("genmesh", "1.0"), 70, bad_at=40)  # past turns of 32
    assert list(provider.batcher._ended)[:3] == spans[:3]  # the spans themselves wait
    assert not provider.batcher._queue
    provider.shutdown()
    assert posted == [encode_spans(spans)]
    assert "span 'bad' cannot be encoded; dropped" in caplog.text


async def test_spans_that_end_on_an_event_loop_are_encoded_there_in_chunks(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On an event loop, every `ENCODE_CHUNK` ended spans are encoded by the loop, in a
    callback at its next turn; fewer wait for the export. What is posted is the same."""
    exporter, posted = posting_exporter(monkeypatch)
    provider = LightTracerProvider(DEFAULT_ON, RESOURCE, [exporter])
    batcher = provider.batcher
    spans = end_spans(provider.get_tracer("genmesh", "1.0"), 70, bad_at=40)
    assert len(batcher._ended) == 71  # nothing ran yet
    assert not batcher._queue
    for _ in range(3):  # a chunk a turn, while a whole chunk waits
        await asyncio.sleep(0)
    assert len(batcher._queue) == 2 * ENCODE_CHUNK - 1  # the bad one dropped, and logged
    assert "span 'bad' cannot be encoded; dropped" in caplog.text
    assert all(type(item) is tuple for item in batcher._queue)
    assert list(batcher._ended) == spans[2 * ENCODE_CHUNK - 1 :]
    assert batcher.waiting() == 70
    provider.shutdown()
    assert posted == [encode_spans(spans)]


def test_a_chunk_left_due_on_a_closed_loop_holds_up_no_other_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A loop that closed with a chunk due (its callback never run) does not keep another
    loop from encoding; the spans it left are exported all the same."""
    exporter, posted = posting_exporter(monkeypatch)
    provider = LightTracerProvider(DEFAULT_ON, RESOURCE, [exporter])
    tracer = provider.get_tracer("genmesh", "1.0")
    first = end_spans(tracer, ENCODE_CHUNK, bad_at=-1)  # outside a loop: left as they are
    closed = asyncio.new_event_loop()
    closed.close()
    provider.batcher._encoding_on = closed  # as if a chunk were due there

    async def end_and_wait() -> list[trace.Span]:
        spans = end_spans(tracer, ENCODE_CHUNK, bad_at=-1)
        await asyncio.sleep(0)
        return spans

    second = asyncio.run(end_and_wait())
    assert len(provider.batcher._queue) == 2 * ENCODE_CHUNK  # both chunks, the oldest first
    assert not provider.batcher._ended
    provider.shutdown()
    assert posted == [encode_request(map(encode_span, [*first, *second]))]


def test_shutdown_exports_what_is_left(memory: tuple[LightTracer, Memory]) -> None:
    tracer, exporter = memory
    for n in range(3):
        tracer.start_span(f"s{n}").end()
    assert exporter.spans == []  # the schedule is an hour away
    batcher = tracer.batcher
    batcher.shutdown()
    assert [s.name for s in exporter.spans] == ["s0", "s1", "s2"]
    assert exporter.shut
    assert not batcher._thread.is_alive()
    tracer.start_span("after").end()  # after shutdown: not exported, as the SDK
    batcher.shutdown()  # twice is fine
    assert len(exporter.spans) == 3


def test_configure_traces_with_light_spans(monkeypatch: pytest.MonkeyPatch) -> None:
    """The configured path (what every service runs) makes LightSpans; the console
    exporter gets them as the SDK's JSON."""
    for name in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_TRACES_SAMPLER"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tracing, "_configured", False)
    monkeypatch.setattr(trace, "set_tracer_provider", lambda provider: None)  # not global
    out = io.StringIO()
    assert tracing.configure("test", environ={"OTEL_TRACES_EXPORTER": "console"}, console=out)
    try:
        tracer = tracing.tracer()
        assert isinstance(tracer, LightTracer)
        span = tracer.start_span("POST /generate", kind=SpanKind.SERVER, attributes={"a": 1})
        span.add_event("first_token")
        span.end()
    finally:
        tracing.shutdown()
    printed = json.loads(out.getvalue())
    assert printed["name"] == "POST /generate"
    assert printed["kind"] == "SpanKind.SERVER"
    assert printed["attributes"] == {"a": 1}
    assert [e["name"] for e in printed["events"]] == ["first_token"]
    assert printed["resource"]["attributes"]["service.name"] == "genmesh-test"
    assert tracing.tracer() is None


class RecordOnly(Sampler):
    def should_sample(self, *args: Any, **kwargs: Any) -> SamplingResult:
        return SamplingResult(Decision.RECORD_ONLY)

    def get_description(self) -> str:
        return "RecordOnly"


def test_a_recorded_but_unsampled_span_is_not_exported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "3600000")
    exporter = Memory()
    provider = LightTracerProvider(RecordOnly(), RESOURCE, [exporter])
    span = provider.get_tracer("genmesh").start_span("recorded")
    assert span.is_recording()
    assert not span.get_span_context().trace_flags.sampled
    span.end()
    provider.shutdown()
    assert exporter.spans == []


def test_the_default_sampler_is_decided_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    """`parentbased_always_on` (OTEL_TRACES_SAMPLER unset) needs no sampler call; any
    other sampler is asked (test_sampling_decides_as_the_sdk: the same decisions)."""
    monkeypatch.delenv("OTEL_TRACES_SAMPLER", raising=False)
    assert is_parent_based_always_on(_get_from_env_or_default())
    assert is_parent_based_always_on(DEFAULT_ON)
    assert is_parent_based_always_on(ParentBased(ALWAYS_ON))
    assert not is_parent_based_always_on(
        ParentBased(ALWAYS_ON, remote_parent_not_sampled=ALWAYS_ON)
    )
    assert not is_parent_based_always_on(ALWAYS_ON)
    assert not is_parent_based_always_on(ParentBasedTraceIdRatio(1.0))


@pytest.mark.parametrize(
    "args",
    [
        (1, 1, False, TraceFlags(0), None),
        ((1 << 128) - 1, (1 << 64) - 1, True, TraceFlags(3), None),
        (5, 7, True, TraceFlags(1), TraceState([("vendor", "x")])),
    ],
)
def test_a_valid_span_context_is_the_apis(args: tuple[Any, ...]) -> None:
    ours, theirs = tracing.valid_span_context(*args), SpanContext(*args)
    assert type(ours) is SpanContext
    assert ours == theirs
    assert ours.is_valid
    assert ours.trace_state == theirs.trace_state


def test_the_current_context_is_read_and_set_as_the_api_does(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`tracing`'s context helpers go to the runtime context's variable directly (the
    SDK's default runtime context here: the fast path is on) and do what the API does."""
    from opentelemetry import context as otel_context
    from opentelemetry.trace.propagation import _SPAN_KEY

    assert tracing._CURRENT is not None
    span = NonRecordingSpan(tracing.valid_span_context(7, 9, True, TraceFlags(1)))
    base = otel_context.set_value("other", 1)
    assert tracing.with_span(span, base) == trace.set_span_in_context(span, base)
    token = tracing.attach(base)
    try:
        assert otel_context.get_current() is base is tracing.current()
        assert tracing.with_span(span) == trace.set_span_in_context(span)
        for context in (None, tracing.with_span(span), otel_context.set_value("x", 2)):
            expected = trace.get_current_span(context).get_span_context()
            assert tracing.current_span_context(context) == expected
        # Not a span under the span's key: no span, as the API reads it.
        odd = otel_context.Context({_SPAN_KEY: "not a span"})
        assert tracing.current_span_context(odd) is trace.INVALID_SPAN_CONTEXT
    finally:
        tracing.detach(token)
    assert otel_context.get_current() is not base
    tracing.detach(token)  # a token used up: logged, as the API's detach logs it
    assert "Failed to detach context" in caplog.text

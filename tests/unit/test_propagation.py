"""W3C trace context in headers: genmesh's own `traceparent` reading and writing (the path
`tracing.configure` sets up) gives exactly what the SDK's default propagators give, on the
same inputs, malformed ones included; anything else still goes through the propagators."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from multidict import CIMultiDict, CIMultiDictProxy
from opentelemetry import baggage, propagate, trace
from opentelemetry.context import Context
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import DEFAULT_ON
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from genmesh.shared import tracing
from genmesh.shared.spans import LightTracerProvider

pytestmark = pytest.mark.unit

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
SPAN_ID = "b7ad6b7169203331"
VALID = f"00-{TRACE_ID}-{SPAN_ID}-01"


@pytest.fixture
def light(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """genmesh's own spans, as `configure` installs them: the W3C path is on."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "3600000")
    provider = LightTracerProvider(DEFAULT_ON, Resource.create({}), [])
    tracing.install(provider)
    assert tracing._w3c
    try:
        yield
    finally:
        tracing.install(None)
        provider.shutdown()


def sdk_extract(headers: Mapping[str, str] | None) -> Context:
    return propagate.extract(headers or {}, getter=tracing.GETTER)


def same_context(ours: Context, theirs: Context) -> None:
    """The same keys, the same remote span context and the same baggage."""
    assert set(ours) == set(theirs)
    got = trace.get_current_span(ours).get_span_context()
    want = trace.get_current_span(theirs).get_span_context()
    assert got == want  # a tuple: ids, is_remote, flags, trace state
    assert dict(baggage.get_all(ours)) == dict(baggage.get_all(theirs))


HEADERS: list[dict[str, str] | None] = [
    None,
    {},
    {"genmesh-codec": "json"},
    {"traceparent": VALID},
    {"Traceparent": VALID, "genmesh-codec": "msgpack"},
    {"TRACEPARENT": f"00-{TRACE_ID}-{SPAN_ID}-00"},  # sampled out
    {"traceparent": f"00-{TRACE_ID}-{SPAN_ID}-ff"},  # every flag (read by table)
    {"traceparent": f"00-{'f' * 32}-{'f' * 16}-01"},  # the largest ids
    {"traceparent": f"01-{TRACE_ID}-{SPAN_ID}-03-future-fields"},  # a later version
    {"traceparent": f"  {VALID}\t"},  # whitespace around
    {"traceparent": VALID + "\n"},
    {"traceparent": VALID, "tracestate": "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"},
    {"traceparent": VALID, "Baggage": "user=alice,tier=gold"},
    {"traceparent": VALID, "Traceparent": f"00-{TRACE_ID}-{'1' * 16}-01"},  # two of them
    {"baggage": "user=alice"},  # baggage alone
    # Malformed: each is no context at all, as for the SDK.
    {"traceparent": ""},
    {"traceparent": "garbage"},
    {"traceparent": f"00-{TRACE_ID.upper()}-{SPAN_ID}-01"},
    {"traceparent": f"00-{TRACE_ID}-{SPAN_ID}-01-extra"},  # version 00 has no more fields
    {"traceparent": f"ff-{TRACE_ID}-{SPAN_ID}-01"},
    {"traceparent": f"00-{'0' * 32}-{SPAN_ID}-01"},
    {"traceparent": f"00-{TRACE_ID}-{'0' * 16}-01"},
    {"traceparent": f"00-{TRACE_ID[:-1]}-{SPAN_ID}-01"},
    {"traceparent": f"00-{TRACE_ID}-{SPAN_ID}-1"},
    {"traceparent": f"00_{TRACE_ID}_{SPAN_ID}_01"},
    {"traceparent": f"01-{TRACE_ID}-{SPAN_ID}-01-" + "x" * 600},  # beyond 512 characters
]


@pytest.mark.parametrize("headers", HEADERS)
def test_extract_reads_as_the_sdk(light: None, headers: dict[str, str] | None) -> None:
    same_context(tracing.extract(headers), sdk_extract(headers))


def test_extract_from_http_headers(light: None) -> None:
    """aiohttp's request headers: case-insensitive, possibly repeated."""
    for pairs in (
        [("Host", "x"), ("Content-Type", "application/json")],
        [("Host", "x"), ("TraceParent", VALID)],
        [("traceparent", VALID), ("traceparent", f"00-{TRACE_ID}-{'1' * 16}-01")],
        [("Host", "x"), ("BAGGAGE", "user=alice")],  # no traceparent: still read
        [("TraceState", "a=b"), ("TRACEPARENT", VALID)],
    ):
        headers = CIMultiDictProxy(CIMultiDict(pairs))
        same_context(tracing.extract(headers), sdk_extract(headers))


def span_with(state: TraceState | None = None, flags: int = 1) -> NonRecordingSpan:
    return NonRecordingSpan(
        SpanContext(int(TRACE_ID, 16), int(SPAN_ID, 16), False, TraceFlags(flags), state)
    )


SPANS = [
    span_with(),
    span_with(flags=0),
    span_with(flags=0xFF),
    NonRecordingSpan(SpanContext((1 << 128) - 1, 1, False, TraceFlags(1))),  # ids' edges
    NonRecordingSpan(SpanContext(1, (1 << 64) - 1, False, TraceFlags(1))),
    span_with(TraceState([("congo", "t61rcWkgMzE")])),
    NonRecordingSpan(trace.INVALID_SPAN_CONTEXT),
]
INCOMING: list[dict[str, str] | None] = [
    None,
    {"genmesh-codec": "json"},
    {"Traceparent": VALID, "TraceState": "a=b", "genmesh-codec": "json"},
]


def both(call: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """`call()` on genmesh's path, then on the SDK propagators'."""
    ours = call()
    monkeypatch.setattr(tracing, "_w3c", False)
    theirs = call()
    monkeypatch.setattr(tracing, "_w3c", True)
    return ours, theirs


@pytest.mark.parametrize("span", SPANS)
@pytest.mark.parametrize("headers", INCOMING)
@pytest.mark.parametrize("with_baggage", [False, True])
def test_inject_writes_as_the_sdk(
    light: None,
    monkeypatch: pytest.MonkeyPatch,
    span: NonRecordingSpan,
    headers: dict[str, str] | None,
    with_baggage: bool,
) -> None:
    parent = baggage.set_baggage("user", "alice") if with_baggage else Context()
    ours, theirs = both(lambda: tracing.inject(headers, span, parent), monkeypatch)
    assert ours == theirs
    assert list(ours) == list(theirs)  # the same keys, in the same order


@pytest.mark.parametrize("span", SPANS)
@pytest.mark.parametrize("with_baggage", [False, True])
def test_inject_current_writes_as_the_sdk(
    light: None, monkeypatch: pytest.MonkeyPatch, span: NonRecordingSpan, with_baggage: bool
) -> None:
    context = trace.set_span_in_context(span)
    if with_baggage:
        context = baggage.set_baggage("user", "alice", context)
    token = tracing.otel_context.attach(context)
    try:
        ours, theirs = both(lambda: tracing.inject_current({"Accept": "*/*"}), monkeypatch)
    finally:
        tracing.otel_context.detach(token)
    assert ours == theirs


def test_the_propagators_decide_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """A program's own SDK provider, or propagators other than the default W3C pair
    (`OTEL_PROPAGATORS`, or `propagate.set_global_textmap`), keep the SDK's propagators."""
    sdk = TracerProvider()
    light = LightTracerProvider(DEFAULT_ON, Resource.create({}), [])
    try:
        tracing.install(sdk)
        assert not tracing._w3c
        tracing.install(light)
        assert tracing._w3c
        monkeypatch.setattr(
            propagate,
            "_HTTP_TEXT_FORMAT",
            CompositePropagator([TraceContextTextMapPropagator()]),
        )
        tracing.install(light)
        assert not tracing._w3c
    finally:
        tracing.install(None)
        sdk.shutdown()
        light.shutdown()

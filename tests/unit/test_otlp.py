"""The direct OTLP encoder says exactly what the SDK's protobuf encoder says."""

from __future__ import annotations

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
    set_span_in_context,
)

from genmesh.shared.otlp import encode_spans

pytestmark = pytest.mark.unit


def provider(memory: InMemorySpanExporter, **resource: str) -> TracerProvider:
    p = TracerProvider(resource=Resource.create(resource))
    p.add_span_processor(SimpleSpanProcessor(memory))
    return p


def spans_of_every_shape() -> list[ReadableSpan]:
    memory = InMemorySpanExporter()
    first = provider(memory, **{"service.name": "a", "service.version": "1"})
    second = provider(memory, **{"service.name": "b"})
    tracer = first.get_tracer("genmesh", "0.1")
    other_scope = first.get_tracer("other")
    remote = SpanContext(
        trace_id=(1 << 127) | 5,
        span_id=(1 << 63) | 7,
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
        trace_state=TraceState([("vendor", "x"), ("k", "v")]),
    )
    parent = set_span_in_context(NonRecordingSpan(remote))
    span = tracer.start_span(
        "process genmesh.x.worker.w.generate",
        parent,
        kind=SpanKind.CONSUMER,
        links=[Link(remote, {"why": "linked"})],
    )
    span.set_attributes(
        {
            "s": "text é",
            "empty": "",
            "t": True,
            "f": False,
            "i": 7,
            "zero": 0,
            "neg": -3,
            "big": 1 << 40,
            "d": 2.5,
            "strs": ["a", "b"],
            "ints": [1, -2],
            "long": "x" * 300,
        }
    )
    span.add_event("first_token")
    span.add_event("finish", {"genmesh.tokens.output": 16, "genmesh.finish_reason": "length"})
    span.set_status(Status(StatusCode.ERROR, "engine down"))
    span.end()
    with tracer.start_as_current_span("POST /generate", kind=SpanKind.SERVER) as root:
        root.set_attribute("http.response.status_code", 200)
        tracer.start_span("child").end()
        other_scope.start_span("other scope").end()
    ok = second.get_tracer("genmesh").start_span("ok", kind=SpanKind.CLIENT)
    ok.set_status(Status(StatusCode.OK))
    ok.end()
    return list(memory.get_finished_spans())


def test_the_encoding_reads_back_as_the_sdks() -> None:
    spans = spans_of_every_shape()
    assert len(spans) == 5
    decoded = ExportTraceServiceRequest.FromString(encode_spans(spans))
    assert decoded == sdk_encode(spans)
    # Grouped like the SDK: per resource, then per scope.
    assert [len(r.scope_spans) for r in decoded.resource_spans] == [2, 1]


def test_schema_urls_and_a_span_without_a_scope_read_back_as_the_sdks() -> None:
    memory = InMemorySpanExporter()
    traced = TracerProvider(resource=Resource.create({"service.name": "s"}, "https://r/1"))
    traced.add_span_processor(SimpleSpanProcessor(memory))
    traced.get_tracer("genmesh", "0.1", "https://s/1").start_span("with urls").end()
    [with_urls] = memory.get_finished_spans()
    bare = ReadableSpan("no scope", with_urls.context, resource=with_urls.resource)
    decoded = ExportTraceServiceRequest.FromString(encode_spans([with_urls, bare]))
    assert decoded == sdk_encode([with_urls, bare])
    assert decoded.resource_spans[0].schema_url == "https://r/1"
    assert [s.schema_url for s in decoded.resource_spans[0].scope_spans] == ["https://s/1", ""]


def test_repeated_attributes_encode_the_same_from_the_cache() -> None:
    spans = spans_of_every_shape()
    assert encode_spans(spans) == encode_spans(spans)
    assert encode_spans([]) == b""


def test_lengths_at_every_varint_boundary_read_back_as_the_sdks() -> None:
    # The fast paths (one-byte lengths, two-byte ones) against the SDK at their edges.
    memory = InMemorySpanExporter()
    tracer = provider(memory).get_tracer("genmesh")
    span = tracer.start_span("edges")
    for n in (0, 1, 60, 61, 62, 63, 64, 120, 121, 122, 123, 125, 126, 127, 128, 129, 200):
        span.set_attribute("k" * (n % 7 + 1) + str(n), "v" * n)
        span.set_attribute("é" * (n // 2), "é" * (n // 2))
    span.add_event("e" * 120)
    span.add_event("e" * 130, {"x": "y" * 130})
    span.set_attribute("huge", "z" * 20_000)  # a span longer than two varint bytes hold
    span.end()
    spans = list(memory.get_finished_spans())
    assert ExportTraceServiceRequest.FromString(encode_spans(spans)) == sdk_encode(spans)

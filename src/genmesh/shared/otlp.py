"""OTLP/HTTP span export with a direct protobuf encoder.

The SDK's exporter builds a tree of protobuf message objects per span and then serialises
it: about 95 µs of CPU per span of ours (10 attributes, 2 events) on the development
machine, in the export thread but under the GIL, so the event loop pays for it. The wire
format of `ExportTraceServiceRequest` is small and stable (opentelemetry-proto), so
`encode_spans` writes its bytes directly, about ten times faster (`tests/test_otlp.py`
checks that the SDK's protobuf classes read back exactly what the SDK's encoder would
have sent). `OTLPExporter` is the SDK's exporter (endpoint, headers, compression, TLS,
retries: the `OTEL_EXPORTER_OTLP_*` variables) with only the encoding swapped.
"""

from __future__ import annotations

import functools
import logging
import struct
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.span import DEFAULT_TRACE_STATE

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    from genmesh.shared.spans import LightSpan

# An SDK span, or genmesh's own (spans.py), which has the same attribute names.
AnySpan: TypeAlias = "ReadableSpan | LightSpan"
# A span's encoding (a `Span` field of ScopeSpans), with its resource and scope.
EncodedSpan: TypeAlias = "tuple[Resource, InstrumentationScope | None, bytes]"

log = logging.getLogger(__name__)

# Span.flags: the SDK sets "has is_remote", and "is_remote" for a remote parent.
_HAS_IS_REMOTE = 0x100
_IS_REMOTE = 0x200
_KIND = {
    SpanKind.INTERNAL: 1,
    SpanKind.SERVER: 2,
    SpanKind.CLIENT: 3,
    SpanKind.PRODUCER: 4,
    SpanKind.CONSUMER: 5,
}
_fixed64 = struct.Struct("<Q").pack
_double = struct.Struct("<d").pack
_ids = struct.Struct(">QQ").pack
_id64 = struct.Struct(">Q").pack
_u16 = struct.Struct("<H").pack
# Building bytes costs more than it looks (`bytes((n,))` alone is ~1,200 instructions of
# CPython, a concatenation ~600): one-byte values come from tables, and a field is put
# together in as few operations as it can be.
_SHORT = [bytes((n,)) for n in range(128)]  # one-byte varints (most lengths), and tags
_TAG = _SHORT


def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64  # int64: two's complement, ten bytes
    if n < 0x80:
        return _SHORT[n]
    if n < 0x4000:  # two bytes (a span's length): low seven bits first, continuation set
        return _u16(((n >> 7) << 8) | (n & 0x7F) | 0x80)
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field (`tag` is the field number shifted, wire type 2 added)."""
    n = len(payload)
    return _TAG[tag] + (_SHORT[n] if n < 128 else _varint(n)) + payload


def _value(value: Any) -> bytes:
    """An AnyValue."""
    if isinstance(value, str):
        return _field(0x0A, value.encode())
    if isinstance(value, bool):  # before int: a bool is an int
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x18" + _varint(value)
    if isinstance(value, float):
        return b"\x21" + _double(value)
    if isinstance(value, bytes):
        return _field(0x3A, value)
    if isinstance(value, Sequence):
        return _field(0x2A, b"".join(_field(0x0A, _value(v)) for v in value))
    if isinstance(value, Mapping):
        return _field(0x32, _attributes(0x0A, value))
    return b""  # None: an empty AnyValue, as the SDK's encoder writes it


def _encode_pair(key: str, value: Any) -> bytes:
    """A KeyValue's length and body (its tag is the caller's)."""
    if type(value) is str:  # most, and every value unique to a request (its ids): one join
        k = key.encode()
        v = value.encode()
        nk = len(k)
        nv = len(v)
        if nk + nv < 122:  # every length below 128: one byte each
            # length, key (0x0A), value (0x12: an AnyValue of a string_value, 0x0A)
            return b"".join(
                (
                    _SHORT[nk + nv + 6],
                    b"\x0a",
                    _SHORT[nk],
                    k,
                    b"\x12",
                    _SHORT[nv + 2],
                    b"\x0a",
                    _SHORT[nv],
                    v,
                )
            )
    body = _field(0x0A, key.encode()) + _field(0x12, _value(value))
    n = len(body)
    return (_SHORT[n] if n < 128 else _varint(n)) + body


# Most attributes of a process's spans repeat (its worker id, subjects, format, small
# counts): their encoding by (name, value), `typed` so that True, 1 and 1.0 differ. Least
# recently used first out, so unique values (request ids) cannot grow it without bound.
_pair = functools.lru_cache(maxsize=4096, typed=True)(_encode_pair)


def _attributes(tag: int, attributes: Mapping[str, Any] | None) -> bytes:
    """Repeated KeyValue as field `tag`."""
    if not attributes:
        return b""
    prefix = _TAG[tag]
    # The SDK's BoundedAttributes is a Mapping whose items() goes through the ABC's
    # per-key lookups; its plain dict, where it has one, is read directly.
    plain: Mapping[str, Any] = getattr(attributes, "_dict", attributes)
    try:  # map and the cache are C: no Python frame per attribute
        return prefix + prefix.join(map(_pair, plain.keys(), plain.values()))
    except TypeError:  # a list value (a router's candidates): not hashable
        return prefix + prefix.join(map(_any_pair, plain.keys(), plain.values()))


def _any_pair(key: str, value: Any) -> bytes:
    """`_pair`, for a value that may not be hashable (then encoded every time)."""
    try:
        return _pair(key, value)
    except TypeError:
        return _encode_pair(key, value)


# Span fields written with one pack each: trace and span id; start and end time.
_head = struct.Struct(">2sQQ2sQ").pack
_times = struct.Struct("<BQBQ").pack
# By the member's id: hashing an Enum member is a Python call.
_KIND_FIELD = {id(kind): bytes((0x30, n)) for kind, n in _KIND.items()}
_FLAGS_FIELD = {
    flags: b"\x85\x01" + struct.pack("<I", flags)
    for flags in (_HAS_IS_REMOTE, _HAS_IS_REMOTE | _IS_REMOTE)
}
_NO_STATUS = b"\x7a\x00"
_UNSET = StatusCode.UNSET
# The status of every span that has none set (a LightSpan's default): written without
# reading its two properties.
UNSET_STATUS = Status(_UNSET)
# Span and event names repeat: their encoded fields, by tag and name (cleared when full).
_names: dict[tuple[int, str], bytes] = {}
_MAX_NAMES = 4096


def _name(tag: int, name: str) -> bytes:
    key = (tag, name)
    encoded = _names.get(key)
    if encoded is None:
        if len(_names) >= _MAX_NAMES:
            _names.clear()
        encoded = _names[key] = _field(tag, name.encode())
    return encoded


def _event(name: str, timestamp: int, attributes: Mapping[str, Any] | None, dropped: int) -> bytes:
    """A Span.Event field (tag included)."""
    if not attributes and not dropped:  # a bare event: all but its time is the name's
        head, tail = _bare_event(name)
        return head + _fixed64(timestamp) + tail
    body = b"\x09" + _fixed64(timestamp) + _name(0x12, name) + _attributes(0x1A, attributes)
    if dropped:
        body += b"\x20" + _varint(dropped)
    return _field(0x5A, body)


@functools.lru_cache(maxsize=256)
def _bare_event(name: str) -> tuple[bytes, bytes]:
    """An event without attributes, but for its time: its tag and length up to the time
    field's tag; its name field after the time."""
    tail = _field(0x12, name.encode())
    n = 9 + len(tail)
    return b"\x5a" + (_SHORT[n] if n < 128 else _varint(n)) + b"\x09", tail


# The empty TraceState every SpanContext without one shares: no `len()` (a Python call).
_NO_TRACE_STATE = DEFAULT_TRACE_STATE


def _span(span: AnySpan) -> bytes:
    context = span.get_span_context()
    assert context is not None  # an SDK span always has one
    # A SpanContext is a tuple (tracing.valid_span_context): its fields read at once, not
    # by a property each.
    trace_id, span_id, _, _, trace_state, _ = context
    parts = [
        _head(b"\x0a\x10", trace_id >> 64, trace_id & 0xFFFFFFFFFFFFFFFF, b"\x12\x08", span_id),
    ]
    if trace_state is not _NO_TRACE_STATE and trace_state:
        parts.append(_field(0x1A, ",".join(f"{k}={v}" for k, v in trace_state.items()).encode()))
    parent = span.parent
    flags = _HAS_IS_REMOTE
    if parent is not None:
        _, parent_id, parent_remote, _, _, _ = parent
        parts.append(b"\x22\x08" + _id64(parent_id))
        if parent_remote:
            flags |= _IS_REMOTE
    parts.append(_name(0x2A, span.name))
    parts.append(_KIND_FIELD[id(span.kind)])
    parts.append(_times(0x39, span.start_time or 0, 0x41, span.end_time or 0))
    # `attributes` is a read-only proxy of the span's BoundedAttributes: read what it wraps.
    parts.append(_attributes(0x4A, getattr(span, "_attributes", None) or span.attributes))
    if span.dropped_attributes:
        parts.append(b"\x50" + _varint(span.dropped_attributes))
    if isinstance(span, ReadableSpan):  # the SDK's Events
        parts.extend(
            [_event(e.name, e.timestamp, e.attributes, e.dropped_attributes) for e in span.events]
        )
    else:  # a LightSpan's: (name, timestamp, attributes)
        parts.extend([_event(name, ts, attributes, 0) for name, ts, attributes in span.events])
    if span.dropped_events:
        parts.append(b"\x60" + _varint(span.dropped_events))
    for link in span.links:
        linked = link.context
        body = b"\x0a\x10" + _ids(linked.trace_id >> 64, linked.trace_id & 0xFFFFFFFFFFFFFFFF)
        body += b"\x12\x08" + _id64(linked.span_id)
        body += _attributes(0x22, link.attributes)
        if link.dropped_attributes:
            body += b"\x28" + _varint(link.dropped_attributes)
        body += b"\x35" + struct.pack(
            "<I", _HAS_IS_REMOTE | (_IS_REMOTE if linked.is_remote else 0)
        )
        parts.append(_field(0x6A, body))
    if span.dropped_links:
        parts.append(b"\x70" + _varint(span.dropped_links))
    status = span.status
    if status is UNSET_STATUS:
        parts.append(_NO_STATUS)
    elif (code := status.status_code) is not _UNSET or status.description:
        body = b""
        if status.description:
            body += _field(0x12, status.description.encode())
        if code is not _UNSET:
            body += b"\x18" + _varint(code.value)
        parts.append(_field(0x7A, body))
    else:
        parts.append(_NO_STATUS)
    parts.append(_FLAGS_FIELD[flags])
    return b"".join(parts)


def encode_span(span: AnySpan) -> EncodedSpan:
    """One span's encoding, with the resource and scope it is grouped by."""
    return span.resource, span.instrumentation_scope, _field(0x12, _span(span))


def _prefix(tag: int, length: int) -> bytes:
    """A length-delimited field's tag and length, for a body of `length` bytes written
    after it (the body's parts joined once with the rest: no nested copies)."""
    return _TAG[tag] + (_SHORT[length] if length < 128 else _varint(length))


def encode_request(spans: Iterable[EncodedSpan]) -> bytes:
    """An `ExportTraceServiceRequest` holding `spans`, serialised: one ResourceSpans per
    resource, one ScopeSpans per instrumentation scope within it, as the SDK groups them."""
    # Grouped by identity: a process has one resource and one scope, and hashing a
    # Resource (the SDK's way) serialises its attributes every time.
    groups: dict[tuple[int, int], tuple[Any, Any, list[bytes]]] = {}
    for resource, scope, encoded_span in spans:
        key = (id(resource), id(scope))
        group = groups.get(key)
        if group is None:
            group = groups[key] = (resource, scope, [])
        group[2].append(encoded_span)
    # Each message's parts and their length; a message's head (tag and length) goes in
    # front of its parts once they are all known, and the request is one join at the end:
    # a batch is ~300 kB, and every nested concatenation would copy (and page in) all of it.
    by_resource: dict[int, tuple[Any, list[bytes], list[int]]] = {}
    for resource, scope, encoded in groups.values():
        inner = b""
        if scope is not None:
            inner = _field(0x0A, scope.name.encode()) if scope.name else b""
            if scope.version:
                inner += _field(0x12, scope.version.encode())
            inner += _attributes(0x1A, scope.attributes)
        parts = [_field(0x0A, inner), *encoded]
        if scope is not None and scope.schema_url:
            parts.append(_field(0x1A, scope.schema_url.encode()))
        size = sum(map(len, parts))
        _, resource_parts, length = by_resource.setdefault(id(resource), (resource, [], [0]))
        head = _prefix(0x12, size)
        resource_parts.append(head)
        resource_parts.extend(parts)
        length[0] += len(head) + size
    out: list[bytes] = []
    for resource, scopes, length in by_resource.values():
        first = _field(0x0A, _attributes(0x0A, resource.attributes))
        tail = _field(0x1A, resource.schema_url.encode()) if resource.schema_url else b""
        out.append(_prefix(0x0A, len(first) + length[0] + len(tail)))
        out.append(first)
        out.extend(scopes)
        out.append(tail)
    return b"".join(out)


def encode_spans(spans: Sequence[AnySpan]) -> bytes:
    """`encode_request` of `spans`."""
    return encode_request(map(encode_span, spans))


# Spans encoded between two moments the export thread lets the GIL go: a batch of 512
# takes ~7 ms to encode, and the event loop would wait for all of it (CPython hands the
# GIL over every 5 ms at the earliest); 32 spans are ~0.5 ms. (Most spans come encoded
# already, by the event loop: `SpanBatcher`.)
_SPANS_PER_TURN = 32


def encode_or_drop(span: AnySpan) -> EncodedSpan | None:
    """`encode_span`, or None for a span that cannot be encoded (an integer beyond int64,
    a string with a lone surrogate): dropped and logged, not its whole batch."""
    try:
        return encode_span(span)
    except Exception:
        log.exception("span %r cannot be encoded; dropped", span.name)
        return None


def _encoded(items: Iterable[AnySpan | EncodedSpan]) -> Iterator[EncodedSpan]:
    """Each item's encoding: an `EncodedSpan` as it is, a span encoded here."""
    turn = 0
    for item in items:
        if not isinstance(item, tuple):
            encoded = encode_or_drop(item)
            turn += 1
            if turn % _SPANS_PER_TURN == 0:
                time.sleep(0)  # the event loop's turn
            if encoded is None:
                continue
            item = encoded
        yield item


class OTLPExporter(OTLPSpanExporter):
    """The SDK's OTLP/HTTP span exporter, encoding with `encode_span`. `export` takes
    spans, or what `encode` made of them (`SpanBatcher` has the event loop encode spans
    as they end, in chunks); it encodes the spans among them in the calling thread."""

    encode = staticmethod(encode_or_drop)

    def export(self, spans: Sequence[AnySpan | EncodedSpan]) -> SpanExportResult:
        if self._shutdown:
            return SpanExportResult.FAILURE
        result = self._client.export(encode_request(_encoded(spans)))
        return SpanExportResult.SUCCESS if result.success else SpanExportResult.FAILURE

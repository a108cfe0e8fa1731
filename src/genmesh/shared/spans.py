"""genmesh's own span objects: the tracing path that `tracing.configure` sets up.

Why not the SDK's: on the development machine the SDK's span lifecycle (`start_span` with
ten attributes, an event, `set_attribute`, `end` into the batch span processor) costs
about 60 µs of CPU per span: `BoundedAttributes` checks and copies every attribute, every
span takes a lock per call, runs its processors and is copied into a `ReadableSpan` at its
end. A request makes two spans in two processes, and tracing's whole budget is 150 µs a
request. A `LightSpan` is a slotted object with a plain dict of attributes and events as
tuples, ended into a deque, encoded by the event loop in chunks and posted by one thread
(see `SpanBatcher`): about a sixth of that (docs/observability.md, "Cost").

What of the SDK is still used: the sampler (`OTEL_TRACES_SAMPLER[_ARG]`, parsed and
decided by the SDK's own objects, so parent-based decisions are exactly the SDK's; only
the default, `parentbased_always_on`, is decided inline, as it decides), the
`Resource`, the instrumentation scope, the `OTEL_BSP_*` parsing, the OTLP exporter's HTTP
client (`otlp.OTLPExporter`: endpoint, headers, TLS, compression, retries) and the
console exporter (given `ReadableSpan` copies: slow, and only for a console).

What is given up, knowingly:
- Attribute values are neither checked nor copied one by one: genmesh's own attributes are
  str, bool, int, float or lists of str, which the OTLP encoder writes as they are. A
  program that embeds genmesh and sets attributes of other types on these spans gets them
  encoded as well as `otlp._value` can (None: an empty value). Event attributes are kept
  as given: do not change a mapping after handing it to `add_event`.
- No locks: a span is touched by one thread, the event loop's, from start to end (the
  export thread only reads spans that have ended).
- No span processors (on_start/on_end hooks) and no span limits but the SDK's default
  of 128 events a span (more are counted as dropped). `with span:` only ends the span;
  `start_as_current_span` records an exception and sets the status as the API does.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Protocol

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, Decision, ParentBased, Sampler
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    INVALID_SPAN_ID,
    INVALID_TRACE_ID,
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)
from opentelemetry.util import types

from genmesh.shared.otlp import UNSET_STATUS
from genmesh.shared.tracing import current_span_context, valid_span_context

log = logging.getLogger(__name__)

MAX_EVENTS = 128  # the SDK's default OTEL_SPAN_EVENT_COUNT_LIMIT
# Spans an event loop encodes in one callback (SpanBatcher): ~0.5 ms of the loop's time.
ENCODE_CHUNK = 32
# Every combination of the two flags the SDK sets: sampled, and "the trace id is random"
# (its RandomIdGenerator's ids are, so a root span says so and a child inherits it).
_FLAGS = [TraceFlags(n) for n in range(4)]
_SAMPLED = TraceFlags.SAMPLED
_RANDOM = TraceFlags.RANDOM_TRACE_ID
_time_ns = time.time_ns
_getrandbits = random.getrandbits
_SAMPLE = Decision.RECORD_AND_SAMPLE
_DROP = Decision.DROP
# The SDK's own parsing and checks of the OTEL_BSP_* variables (untyped static methods).
_BSP: Any = BatchSpanProcessor


class Exporter(Protocol):
    """What `SpanBatcher` exports through (an SDK `SpanExporter` has this shape). One
    that also has `encode(span)` (`otlp.OTLPExporter`) is given, in a span's stead, what
    that made of it on the event loop (None: nothing to export)."""

    def export(self, spans: Sequence[Any]) -> Any: ...

    def shutdown(self) -> None: ...


class LightSpan(trace.Span):
    """A recording span. Read by `otlp.encode_spans` as it reads an SDK `ReadableSpan`
    (same attribute names), and turned into one by `readable()` for other exporters."""

    __slots__ = (
        "_attributes",
        "_context",
        "_tracer",
        "dropped_events",
        "end_time",
        "events",
        "kind",
        "links",
        "name",
        "parent",
        "start_time",
        "status",
    )

    dropped_attributes = 0
    dropped_links = 0

    def __init__(
        self,
        tracer: LightTracer,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        kind: SpanKind,
        attributes: dict[str, Any],
        links: Sequence[Link],
        start_time: int,
    ) -> None:
        self._tracer = tracer
        self.name = name
        self._context = context
        self.parent = parent
        self.kind = kind
        self._attributes = attributes
        self.links = links
        self.start_time = start_time
        self.end_time: int | None = None
        self.events: list[tuple[str, int, Mapping[str, Any] | None]] = []
        self.dropped_events = 0
        self.status = UNSET_STATUS

    @property
    def resource(self) -> Resource:
        return self._tracer.resource

    @property
    def instrumentation_scope(self) -> InstrumentationScope:
        return self._tracer.scope

    @property
    def attributes(self) -> Mapping[str, Any]:
        return MappingProxyType(self._attributes)

    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return self.end_time is None

    def set_attribute(self, key: str, value: types.AnyValue) -> None:
        if self.end_time is None:
            self._attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, types.AnyValue]) -> None:
        if self.end_time is None:
            self._attributes.update(attributes)

    def add_event(
        self,
        name: str,
        attributes: types.Attributes = None,
        timestamp: int | None = None,
    ) -> None:
        if self.end_time is not None:
            return
        if len(self.events) < MAX_EVENTS:
            self.events.append((name, timestamp or _time_ns(), attributes))
        else:
            self.dropped_events += 1

    def update_name(self, name: str) -> None:
        if self.end_time is None:
            self.name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        # As the SDK: OK is final, UNSET changes nothing.
        if self.end_time is not None or self.status.status_code is StatusCode.OK:
            return
        if isinstance(status, StatusCode):
            status = Status(status, description)
        if status.status_code is not StatusCode.UNSET:
            self.status = status

    def record_exception(
        self,
        exception: BaseException,
        attributes: types.Attributes = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        """An `exception` event, with the attributes the SDK gives it."""
        import traceback

        cls = type(exception)
        module = cls.__module__
        event: dict[str, Any] = {
            "exception.type": cls.__qualname__
            if module in (None, "builtins")
            else f"{module}.{cls.__qualname__}",
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
        }
        if attributes:
            event.update(attributes)
        self.add_event("exception", event, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self.end_time is not None:
            return
        self.end_time = end_time or _time_ns()
        if self._context[3] & _SAMPLED:  # (trace_flags) as the SDK's batch processor: a
            self._tracer.batcher.emit(self)  # recorded but unsampled span is not exported

    def readable(self) -> ReadableSpan:
        """An SDK `ReadableSpan` copy, for an exporter that takes nothing else."""
        tracer = self._tracer
        return ReadableSpan(
            name=self.name,
            context=self._context,
            parent=self.parent,
            resource=tracer.resource,
            attributes=self._attributes,
            events=[Event(name, attrs, timestamp) for name, timestamp, attrs in self.events],
            links=self.links,
            kind=self.kind,
            status=self.status,
            start_time=self.start_time,
            end_time=self.end_time,
            instrumentation_scope=tracer.scope,
        )


def is_parent_based_always_on(sampler: Sampler) -> bool:
    """Whether `sampler` is the SDK's `parentbased_always_on`: ParentBased(ALWAYS_ON) with
    its default delegates (sampled parents: ALWAYS_ON, unsampled ones: ALWAYS_OFF)."""
    return type(sampler) is ParentBased and (
        sampler._root,
        sampler._remote_parent_sampled,
        sampler._remote_parent_not_sampled,
        sampler._local_parent_sampled,
        sampler._local_parent_not_sampled,
    ) == (ALWAYS_ON, ALWAYS_ON, ALWAYS_OFF, ALWAYS_ON, ALWAYS_OFF)


class LightTracer(trace.Tracer):
    """Makes `LightSpan`s, or a `NonRecordingSpan` with the unsampled context when the
    sampler says no (so that the decision still travels in `traceparent`)."""

    def __init__(
        self,
        sampler: Sampler,
        resource: Resource,
        scope: InstrumentationScope,
        batcher: SpanBatcher,
    ) -> None:
        self.sampler = sampler
        # The SDK's default sampler, `parentbased_always_on` (what OTEL_TRACES_SAMPLER
        # unset gives), needs no call: a parent's sampled flag, else sampled; the
        # parent's trace state. Its SamplingResult cost a third of `start_span`.
        self.default_sampling = is_parent_based_always_on(sampler)
        self.resource = resource
        self.scope = scope
        self.batcher = batcher

    def start_span(
        self,
        name: str,
        context: otel_context.Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: types.Attributes = None,
        links: Sequence[Link] | None = (),
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> trace.Span:
        # As the SDK's Tracer.start_span, less its processors, limits and checks.
        current = current_span_context(context)
        # A SpanContext is a tuple (tracing.valid_span_context): its fields read at once.
        trace_id, _, _, parent_flags, parent_state, valid = current
        parent: SpanContext | None = current if valid else None
        if parent is not None:
            random_id = parent_flags & _RANDOM
        else:
            trace_id = _getrandbits(128)
            while trace_id == INVALID_TRACE_ID:
                trace_id = _getrandbits(128)
            random_id = _RANDOM
        links = links or ()
        if self.default_sampling:  # decided here as that sampler decides (see __init__)
            sampled = recording = parent is None or bool(parent_flags & _SAMPLED)
            trace_state = None if parent is None else parent_state
            given = attributes
        else:
            result = self.sampler.should_sample(context, trace_id, name, kind, attributes, links)
            sampled = result.decision is _SAMPLE
            recording = result.decision is not _DROP
            trace_state = result.trace_state
            given = result.attributes
        span_id = _getrandbits(64)
        while span_id == INVALID_SPAN_ID:
            span_id = _getrandbits(64)
        span_context = valid_span_context(
            trace_id, span_id, False, _FLAGS[random_id | (_SAMPLED if sampled else 0)], trace_state
        )
        if not recording:
            return NonRecordingSpan(span_context)
        return LightSpan(
            self,
            name,
            span_context,
            parent,
            kind,
            dict(given) if given else {},  # the span's own copy
            links,
            start_time or _time_ns(),
        )

    def start_as_current_span(  # type: ignore[override]
        self,
        name: str,
        context: otel_context.Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: types.Attributes = None,
        links: Sequence[Link] | None = (),
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
        end_on_exit: bool = True,
    ) -> Iterator[trace.Span]:
        span = self.start_span(name, context, kind, attributes, links, start_time)
        return trace.use_span(  # type: ignore[return-value]
            span,
            end_on_exit=end_on_exit,
            record_exception=record_exception,
            set_status_on_exception=set_status_on_exception,
        )


class SpanBatcher:
    """Ended spans wait in a bounded queue (full: dropped and counted); one thread exports
    them in batches every `OTEL_BSP_SCHEDULE_DELAY` ms, or as soon as a batch
    (`OTEL_BSP_MAX_EXPORT_BATCH_SIZE`) waits (then full batches only), to every exporter
    in turn. The variables are read by the SDK's own parsing, defaults included (5 s, 512
    spans, a queue of 2,048, a 30 s export timeout, which bounds `shutdown`).

    With a lone exporter that encodes (OTLP), spans that end on an event loop are encoded
    by that loop, `ENCODE_CHUNK` at a time, in a callback of their own: the export thread
    then only posts. Encoding in the export thread cost the loop's thread too: the export
    thread must take the GIL from it and hand it back every ~0.5 ms of encoding, so as not
    to stall the loop, and the traced mesh cost up to ~35 µs a request more that way
    (docs/performance.md, "Tracing"). A chunk holds the loop about as long, warm; a span
    encoded alone as it ended ran the encoder cold (~30 µs a span against ~15). Spans that
    end in a thread without a loop, and those still waiting at an export, are encoded by
    the exporter in the export thread."""

    def __init__(self, exporters: Sequence[Exporter]) -> None:
        self.exporters = list(exporters)
        self.max_queue_size: int = _BSP._default_max_queue_size()
        self.max_batch: int = _BSP._default_max_export_batch_size()
        self.delay_s: float = _BSP._default_schedule_delay_millis() / 1e3
        self.timeout_s: float = _BSP._default_export_timeout_millis() / 1e3
        _BSP._validate_arguments(self.max_queue_size, self.delay_s * 1e3, self.max_batch)
        self.dropped = 0
        only = self.exporters[0] if len(self.exporters) == 1 else None
        self._encode: Callable[[LightSpan], Any] | None = getattr(only, "encode", None)
        self._ended: collections.deque[LightSpan] = collections.deque()  # as they ended
        self._queue: collections.deque[Any] = collections.deque()  # encoded, by a loop
        self._encoding_on: asyncio.AbstractEventLoop | None = None  # a chunk is due there
        self._wake = threading.Event()
        self._export_lock = threading.Lock()  # the thread's drain against force_flush's
        self._stopping = False
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="genmesh-spans", daemon=True)
        self._thread.start()

    def waiting(self) -> int:
        """Spans ended and not yet exported."""
        return len(self._ended) + len(self._queue)

    def emit(self, span: LightSpan) -> None:
        """Queue an ended span (the event loop's side: no lock, no wait)."""
        if self._stopping:  # as the SDK: a span that ends after shutdown is not exported
            return
        ended = self._ended
        if len(ended) + len(self._queue) >= self.max_queue_size:
            self.dropped += 1
            return
        ended.append(span)
        if len(ended) >= ENCODE_CHUNK and self._encode is not None and self._encode_soon():
            return
        if len(ended) + len(self._queue) >= self.max_batch and not self._wake.is_set():
            self._wake.set()

    def _encode_soon(self) -> bool:
        """Have the running event loop encode a chunk of the ended spans at its next turn;
        False if this thread runs no loop."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        if self._encoding_on is not loop:  # (a loop that stopped first left it unrun)
            self._encoding_on = loop
            loop.call_soon(self._encode_chunk)
        return True

    def _encode_chunk(self) -> None:
        self._encoding_on = None
        encode = self._encode
        assert encode is not None
        ended, queue = self._ended, self._queue
        for _ in range(ENCODE_CHUNK):
            if self._stopping:  # what is left is the export thread's (shutdown)
                return
            try:
                span = ended.popleft()
            except IndexError:  # (force_flush took it)
                break
            encoded = encode(span)
            if encoded is not None:
                queue.append(encoded)
        if len(ended) >= ENCODE_CHUNK:
            self._encode_soon()
        elif len(ended) + len(queue) >= self.max_batch and not self._wake.is_set():
            self._wake.set()

    def _run(self) -> None:
        while not self._stopping:
            # As the SDK's batch processor: woken by a full batch, export full batches
            # only; on the schedule, at least one. Without that, the spans that end while
            # a batch is out went out in a small batch of their own right after it, and
            # under load every export (an HTTP request, ~1 ms of CPU) carried a fifth of
            # a batch.
            full = self._wake.wait(self.delay_s)
            self._wake.clear()
            self._drain(partial=0 if full else 1)
        self._drain()  # shutdown: what is left

    def _batch(self) -> list[Any]:
        """Up to a batch of what waits: encoded spans first, then spans as they ended."""
        batch: list[Any] = []
        for source in (self._queue, self._ended):
            while len(batch) < self.max_batch:
                try:
                    batch.append(source.popleft())
                except IndexError:  # empty (the loop may have taken the last)
                    break
        return batch

    def _drain(self, partial: float = math.inf) -> None:
        """Export what waits in batches: every full one, and at most `partial` smaller."""
        # The exporter's own HTTP calls are not to be traced by any instrumentation.
        token = otel_context.attach(
            otel_context.set_value(otel_context._SUPPRESS_INSTRUMENTATION_KEY, True)
        )
        try:
            with self._export_lock:
                while waiting := self.waiting():
                    if waiting < self.max_batch:
                        if partial < 1:
                            break
                        partial -= 1
                    batch = self._batch()
                    if not batch:  # a loop took the last of them meanwhile
                        break
                    for exporter in self.exporters:
                        try:
                            exporter.export(batch)
                        except Exception:
                            log.exception("exporting %d spans failed", len(batch))
        finally:
            otel_context.detach(token)

    def force_flush(self, timeout_millis: int | None = None) -> bool:
        """Export what waits, in the calling thread."""
        if self._stopping:
            return False
        self._drain()
        return True

    def shutdown(self) -> None:
        """Export what is left and stop the thread, within the export timeout; then the
        exporters."""
        if self._stopped:
            return
        self._stopped = self._stopping = True
        self._wake.set()
        self._thread.join(self.timeout_s)
        if self._thread.is_alive():
            log.warning("span export did not finish within %.0f s", self.timeout_s)
        else:  # a span a loop was encoding as the thread drained for the last time
            self._drain()
        if self.dropped:
            log.warning("%d spans dropped: the export queue was full", self.dropped)
        for exporter in self.exporters:
            exporter.shutdown()


class ReadableSpans:
    """An exporter that takes SDK `ReadableSpan`s only (the console's), fed copies."""

    def __init__(self, exporter: Exporter) -> None:
        self.exporter = exporter

    def export(self, spans: Sequence[LightSpan]) -> Any:
        return self.exporter.export([span.readable() for span in spans])

    def shutdown(self) -> None:
        self.exporter.shutdown()


class LightTracerProvider(trace.TracerProvider):
    """The provider of `LightTracer`s: one sampler, resource and batcher, a scope per
    tracer. Set as the global provider, so a program's own `trace.get_tracer` spans are
    exported with genmesh's."""

    def __init__(self, sampler: Sampler, resource: Resource, exporters: Sequence[Exporter]):
        self.sampler = sampler
        self.resource = resource
        self.batcher = SpanBatcher(exporters)
        atexit.register(self.shutdown)  # as the SDK's provider: a plain exit still exports

    def get_tracer(
        self,
        instrumenting_module_name: str,
        instrumenting_library_version: str | None = None,
        schema_url: str | None = None,
        attributes: types.Attributes = None,
    ) -> LightTracer:
        scope = InstrumentationScope(
            instrumenting_module_name, instrumenting_library_version, schema_url, attributes
        )
        return LightTracer(self.sampler, self.resource, scope, self.batcher)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.batcher.force_flush(timeout_millis)

    def shutdown(self) -> None:
        self.batcher.shutdown()

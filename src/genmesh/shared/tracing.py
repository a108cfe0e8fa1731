"""OpenTelemetry traces: one trace per request, one span per hop, W3C context in NATS headers.

Configured only through the standard `OTEL_*` variables, once per process, by `configure`
(each service's serve function calls it):

- `OTEL_SDK_DISABLED=true`: off.
- `OTEL_TRACES_EXPORTER`: comma-separated `otlp` (OTLP over HTTP/protobuf), `console` (one
  JSON object per span on stdout), `none`. Unset: `otlp` if `OTEL_EXPORTER_OTLP_ENDPOINT` or
  `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set, else off.
- `OTEL_SERVICE_NAME` (default `genmesh-<role>`), `OTEL_RESOURCE_ATTRIBUTES`,
  `OTEL_TRACES_SAMPLER[_ARG]`, `OTEL_BSP_*`, `OTEL_EXPORTER_OTLP_*` and `OTEL_PROPAGATORS`
  are read by the SDK's own parsing as usual; the spans themselves are genmesh's
  (`spans.py`: the SDK's cost about six times as much CPU), and so is the reading and
  writing of a lone `traceparent` when the propagators are the default W3C pair
  (`extract`, `inject`). The base endpoint gets `/v1/traces` appended; the
  `..._TRACES_ENDPOINT` one is used verbatim.

Off, `tracer()` is None and every call site skips its tracing code at once: no span, no
header, no attribute is ever built, and the SDK is not even imported.

Spans are never current across an `await` that hands control to a caller (generators):
they are parents by explicit context, except where a task owns the span for its whole life
(the frontend's handler task, the worker's request task, an engine call's steps).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
import sys
from collections.abc import AsyncIterator, Mapping
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Any

from multidict import CIMultiDict, CIMultiDictProxy
from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context
from opentelemetry.context.contextvars_context import ContextVarsRuntimeContext
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.propagators.textmap import Getter, TextMapPropagator
from opentelemetry.trace import (
    INVALID_SPAN_CONTEXT,
    NonRecordingSpan,
    Span,
    SpanContext,
    Status,
    StatusCode,
    TraceFlags,
    Tracer,
    TraceState,
)
from opentelemetry.trace.propagation import _SPAN_KEY
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.trace.span import DEFAULT_TRACE_STATE

from genmesh import __version__
from genmesh.shared import frames
from genmesh.shared.errors import ErrorCode

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from genmesh.shared.envelope import Envelope
    from genmesh.shared.spans import LightTracerProvider

log = logging.getLogger(__name__)

TRACER_NAME = "genmesh"
EXPORTERS = ("otlp", "console", "none")

# Attribute names: OpenTelemetry semantic conventions where they exist, genmesh.* otherwise.
MESSAGING_SYSTEM = "messaging.system"
MESSAGING_DESTINATION = "messaging.destination.name"
MESSAGING_OPERATION = "messaging.operation.name"
MESSAGING_OPERATION_TYPE = "messaging.operation.type"
ERROR_TYPE = "error.type"
REQUEST_ID = "genmesh.request_id"  # private: the ID inside the mesh, never sent to clients
CLIENT_ID = "genmesh.client_id"
FORMAT = "genmesh.format"
ATTEMPT = "genmesh.attempt"
WORKER = "genmesh.worker"
DISPATCH_ID = "genmesh.dispatch_id"
ROUTER = "genmesh.router"
ROUTER_POLICY = "genmesh.router.policy"
ROUTER_CANDIDATES = "genmesh.router.candidates"
ROUTER_CANDIDATE_IDS = "genmesh.router.candidate_ids"
# Milliseconds the request waited in an admission queue for a worker (only if it waited).
ADMISSION_WAIT_MS = "genmesh.admission.wait_ms"
ENGINE = "genmesh.engine"
# Prefill/decode disaggregation: a worker's part in the request (`prefill` for a stage,
# `decode` for a request it runs with a prefill worker), and that prefill worker.
PD_ROLE = "genmesh.pd.role"
PD_PREFILL_WORKER = "genmesh.pd.prefill_worker"
TOKENS_OUTPUT = "genmesh.tokens.output"
FINISH_REASON = "genmesh.finish_reason"
GENMESH_ERROR_TYPE = "genmesh.error_type"
# Span events: tokens are never a span each.
FIRST_TOKEN = "first_token"
FINISH = "finish"
# At most this many worker ids in a list attribute.
MAX_LISTED = 32
_CANCELLED = ErrorCode.CANCELLED.value  # (an Enum member's value is two Python calls)

_tracer: Tracer | None = None
_provider: TracerProvider | LightTracerProvider | None = None
_configured = False
# `traceparent` read and written here rather than by the SDK's propagators (about half
# the CPU: one pass over the headers, no composite, no getter objects), for genmesh's own
# spans when the propagators are the default ones; see `install`.
_w3c = False


def tracer() -> Tracer | None:
    """genmesh's tracer, or None when tracing is off (then call sites do nothing)."""
    return _tracer


def exporter_names(environ: Mapping[str, str]) -> list[str]:
    """The span exporters the `OTEL_*` variables ask for (empty: tracing is off)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    raw = environ.get("OTEL_TRACES_EXPORTER", "").strip()
    if not raw:
        endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT"
        )
        return ["otlp"] if endpoint else []
    names = [n.strip().lower() for n in raw.split(",") if n.strip()]
    for name in names:
        if name not in EXPORTERS:
            raise ValueError(
                f"OTEL_TRACES_EXPORTER: unknown exporter {name!r} (genmesh has otlp, console, none)"
            )
    if "otlp" in names:
        for variable in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
            protocol = environ.get(variable)
            if protocol:
                if protocol.strip().lower() != "http/protobuf":
                    raise ValueError(
                        f"{variable}={protocol!r}: genmesh exports OTLP over http/protobuf only"
                    )
                break
    return [n for n in names if n != "none"]


def configure(
    role: str,
    *,
    instance_id: str | None = None,
    environ: Mapping[str, str] | None = None,
    console: Any = None,
) -> bool:
    """Set up tracing for this process from the `OTEL_*` variables; True if it is on.

    Once per process: later calls change nothing. Raises ValueError for a setting genmesh
    cannot honour (an unknown exporter, OTLP over gRPC). `console`: where the console
    exporter writes (default stdout).
    """
    global _configured
    if _configured:
        return _tracer is not None
    env = os.environ if environ is None else environ
    names = exporter_names(env)
    _configured = True
    if not names:
        return False
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter
    from opentelemetry.sdk.trace.sampling import _get_from_env_or_default

    from genmesh.shared.spans import Exporter, LightTracerProvider, ReadableSpans

    attributes: dict[str, str] = {"service.version": __version__}
    if instance_id:
        attributes["service.instance.id"] = instance_id
    resource = Resource.create(attributes)  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: f"genmesh-{role}"}))
    exporters: list[Exporter] = []
    for name in names:
        if name == "otlp":
            from genmesh.shared.otlp import OTLPExporter

            exporters.append(OTLPExporter())  # OTEL_EXPORTER_OTLP_*
        else:
            exporters.append(ReadableSpans(ConsoleSpanExporter(out=console or sys.stdout)))
    # genmesh's own spans (spans.py: why), with the SDK's sampler as its TracerProvider
    # would build it (OTEL_TRACES_SAMPLER[_ARG]) and one batching thread (OTEL_BSP_*).
    provider = LightTracerProvider(_get_from_env_or_default(), resource, exporters)
    trace.set_tracer_provider(provider)
    install(provider)
    log.info(
        "tracing on: %s, exporting to %s",
        resource.attributes.get(SERVICE_NAME),
        ", ".join(names),
    )
    return True


@contextlib.asynccontextmanager
async def running(
    role: str, instance_id: str | None = None, *, console: Any = None
) -> AsyncIterator[bool]:
    """`configure` for a service's lifetime; on the way out, export what is left (in a
    thread: the OTLP exporter blocks)."""
    on = configure(role, instance_id=instance_id, console=console)
    try:
        yield on
    finally:
        if on:
            await asyncio.to_thread(shutdown)


def install(provider: TracerProvider | LightTracerProvider | None) -> None:
    """Trace through `provider` (None: tracing off), whatever `configure` did. For tests
    and for programs that embed genmesh with their own (SDK) provider: its spans are the
    SDK's, with whatever processors it has, and the SDK's propagators carry their context.
    With genmesh's own provider and the default propagators (as they are now: set others
    before this), genmesh reads and writes `traceparent` itself."""
    global _tracer, _provider, _w3c
    _provider = provider
    _tracer = None if provider is None else provider.get_tracer(TRACER_NAME, __version__)
    _w3c = False
    if provider is not None:
        from genmesh.shared.spans import LightTracerProvider

        _w3c = isinstance(provider, LightTracerProvider) and _is_w3c_default(
            propagate.get_global_textmap()
        )


def shutdown() -> None:
    """Export what is still buffered and stop (on service stop). Blocks up to the
    exporter's timeout."""
    global _tracer, _provider
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        try:
            provider.shutdown()
        except Exception as exc:  # never let tracing spoil a clean stop
            log.warning("tracing shutdown failed: %s", exc)


# --------------------------------------------------------------------- current context

# The variable that holds the current context, when the runtime context is the SDK's
# default one (`contextvars_context`, unless OTEL_PYTHON_CONTEXT names another): the
# API's `attach`, `detach`, `get_current` and `set_span_in_context` are each two or three
# Python calls around it, and a request crosses them a dozen times in its two processes.
_RUNTIME = otel_context._RUNTIME_CONTEXT
_CURRENT: ContextVar[Context] | None = (
    _RUNTIME._current_context if type(_RUNTIME) is ContextVarsRuntimeContext else None
)


def current() -> Context:
    """The current context (`opentelemetry.context.get_current`)."""
    return _CURRENT.get() if _CURRENT is not None else otel_context.get_current()


def attach(context: Context) -> Token[Context]:
    """Make `context` current (`opentelemetry.context.attach`)."""
    return _CURRENT.set(context) if _CURRENT is not None else otel_context.attach(context)


def detach(token: Token[Context]) -> None:
    """Restore the context `token` replaced (`opentelemetry.context.detach`: a token of
    another context is logged, not raised)."""
    if _CURRENT is None:
        otel_context.detach(token)
        return
    try:
        _CURRENT.reset(token)
    except (ValueError, RuntimeError):
        log.exception("Failed to detach context")


def with_span(span: Span, context: Context | None = None) -> Context:
    """`context` (default: the current one) with `span` as its span
    (`trace.set_span_in_context`)."""
    return Context({**(current() if context is None else context), _SPAN_KEY: span})


def current_span_context(context: Context | None = None) -> SpanContext:
    """The context of the span current in `context` (default: the current context);
    `INVALID_SPAN_CONTEXT` if none (`trace.get_current_span(context).get_span_context()`)."""
    span = (current() if context is None else context).get(_SPAN_KEY)
    if span is None or not isinstance(span, Span):
        return INVALID_SPAN_CONTEXT
    return span.get_span_context()


# --------------------------------------------------------------------- propagation


class HeaderGetter(Getter[Mapping[str, str]]):
    """Reads NATS (or HTTP) headers case-insensitively: nats-py keeps the sender's case,
    and other clients may well send `Traceparent`."""

    def get(self, carrier: Mapping[str, str], key: str) -> list[str] | None:
        value = carrier.get(key)
        if value is not None:
            return [value]
        low = key.lower()
        found = [v for k, v in carrier.items() if k.lower() == low]
        return found or None

    def keys(self, carrier: Mapping[str, str]) -> list[str]:
        return list(carrier)


GETTER = HeaderGetter()

# Header maps whose lookups ignore case (aiohttp's request headers).
_CASE_INSENSITIVE = (CIMultiDictProxy, CIMultiDict)
# The W3C fields of the default propagators (`tracecontext,baggage`).
TRACEPARENT = "traceparent"
W3C_FIELDS = frozenset((TRACEPARENT, "tracestate", "baggage"))
# The SDK's own pattern and length limit for `traceparent`, so that a header is valid here
# exactly when it is valid to the SDK's propagator.
_TRACEPARENT_RE = TraceContextTextMapPropagator._TRACEPARENT_HEADER_FORMAT_RE
_TRACEPARENT_MAX = TraceContextTextMapPropagator._TRACEPARENT_MAXIMUM_LENGTH
_ZERO_TRACE_ID = "0" * 32
_ZERO_SPAN_ID = "0" * 16
# A traceparent's flags: read and written by table (2 hex digits).
_TRACE_FLAGS = {f"{n:02x}": TraceFlags(n) for n in range(256)}
_FLAGS_HEX = [f"-{n:02x}" for n in range(256)]
_id128 = struct.Struct(">QQ").pack
_id64 = struct.Struct(">Q").pack
_new_tuple = tuple.__new__
_LOW64 = (1 << 64) - 1
# The current context's baggage, read without `baggage.get_all`'s read-only copy.
_BAGGAGE_KEY = baggage._BAGGAGE_KEY


def _is_w3c_default(textmap: TextMapPropagator) -> bool:
    """Whether `textmap` is OTEL_PROPAGATORS' default: W3C trace context and baggage, and
    nothing else (as `opentelemetry.propagate` builds it when the variable is unset or
    names just those two)."""
    if type(textmap) is not CompositePropagator:
        return False
    kinds = [type(p) for p in textmap._propagators]
    return len(kinds) == 2 and set(kinds) == {TraceContextTextMapPropagator, W3CBaggagePropagator}


def extract(headers: Mapping[str, str] | None) -> Context:
    """The trace context that `headers` carry (an empty one when none)."""
    if not _w3c:
        return propagate.extract(headers or {}, getter=GETTER)
    # What the default propagators would read, in one pass over the keys; anything beyond
    # a lone `traceparent` (tracestate, baggage, a second traceparent) goes to them.
    header = None
    if isinstance(headers, _CASE_INSENSITIVE) and not (
        TRACEPARENT in headers or "tracestate" in headers or "baggage" in headers
    ):  # an HTTP request's headers, most without a context: three lookups, not a pass
        return Context()
    if headers:
        for key in headers:
            low = key.lower()
            if low in W3C_FIELDS:
                if low != TRACEPARENT or header is not None:
                    return propagate.extract(headers, getter=GETTER)
                header = headers[key]
    if header is None:
        return Context()
    if len(header) > _TRACEPARENT_MAX:  # the SDK's, for its warning
        return propagate.extract(headers or {}, getter=GETTER)
    match = _TRACEPARENT_RE.search(header)
    if match is None:
        return Context()
    version, trace_id, span_id, flags, rest = match.groups()
    if (
        trace_id == _ZERO_TRACE_ID
        or span_id == _ZERO_SPAN_ID
        or version == "ff"
        or (version == "00" and rest)
    ):
        return Context()
    # Valid by the checks above: 32 and 16 hex digits, not all zero.
    remote = valid_span_context(int(trace_id, 16), int(span_id, 16), True, _TRACE_FLAGS[flags])
    return Context({_SPAN_KEY: NonRecordingSpan(remote)})


def valid_span_context(
    trace_id: int,
    span_id: int,
    is_remote: bool,
    trace_flags: TraceFlags,
    trace_state: TraceState | None = None,
) -> SpanContext:
    """`SpanContext(...)` for ids already known to be valid (non-zero, 128 and 64 bits),
    built as its `__new__` builds it (a tuple, `is_valid` last) without that Python call
    and its checks: over a quarter of starting a span, or of reading a `traceparent`
    (`tests/unit/test_spans.py` checks that both make equal contexts)."""
    if trace_state is None:
        trace_state = DEFAULT_TRACE_STATE
    return _new_tuple(SpanContext, (trace_id, span_id, is_remote, trace_flags, trace_state, True))


def _traceparent(out: dict[str, str], span: SpanContext) -> None:
    """Write `span`'s context as the SDK's `tracecontext` propagator does."""
    if span == INVALID_SPAN_CONTEXT:  # (the SDK's test: only that context writes nothing)
        return
    # A SpanContext is a tuple (valid_span_context): its fields read at once, not by five
    # properties.
    trace_id, span_id, _, flags, trace_state, _ = span
    # The ids' hex digits from their bytes: two thirds of the CPU of formatting them as
    # zero-padded ints (`f"{trace_id:032x}"`), one string built once.
    high, low = trace_id >> 64, trace_id & _LOW64
    out[TRACEPARENT] = f"00-{_id128(high, low).hex()}-{_id64(span_id).hex()}{_FLAGS_HEX[flags]}"
    if trace_state is not DEFAULT_TRACE_STATE and trace_state:
        out["tracestate"] = trace_state.to_header()


def inject(
    headers: Mapping[str, str] | None, span: Span, parent: Context | None = None
) -> dict[str, str]:
    """A copy of `headers` carrying `span`'s context (`traceparent`, and `tracestate` and
    `baggage` of `parent`), replacing those keys in whatever case they came."""
    if _w3c and not otel_context.get_value(_BAGGAGE_KEY, parent):
        out = {k: v for k, v in headers.items() if k.lower() not in W3C_FIELDS} if headers else {}
        _traceparent(out, span.get_span_context())
        return out
    fields = {f.lower() for f in propagate.get_global_textmap().fields}
    out = {k: v for k, v in (headers or {}).items() if k.lower() not in fields}
    propagate.inject(out, context=trace.set_span_in_context(span, parent))
    return out


def inject_current(headers: dict[str, str]) -> dict[str, str]:
    """`headers` plus the current trace context, for an outgoing HTTP call; `headers`
    itself when tracing is off."""
    if _tracer is None:
        return headers
    out = dict(headers)
    context = current()
    if _w3c and not context.get(_BAGGAGE_KEY):
        _traceparent(out, current_span_context(context))
    else:
        propagate.inject(out)
    return out


def admission_waited(span: Span | None, seconds: float) -> None:
    """Note on `span` (None: the current span) how long its request waited in an
    admission queue."""
    if _tracer is None:
        return
    target = span if span is not None else trace.get_current_span()
    if target.is_recording():
        target.set_attribute(ADMISSION_WAIT_MS, round(seconds * 1000.0, 3))


def nats_attributes(subject: str, operation: str, operation_type: str) -> dict[str, Any]:
    return {
        MESSAGING_SYSTEM: "nats",
        MESSAGING_DESTINATION: subject,
        MESSAGING_OPERATION: operation,
        MESSAGING_OPERATION_TYPE: operation_type,
    }


def attempt_of(envelope: Envelope) -> int:
    return envelope.continuation.attempt if envelope.continuation is not None else 1


def fail(span: Span, code: str, message: str) -> None:
    """Mark `span` as failed with a genmesh error code (a cancellation is no error)."""
    if code == _CANCELLED:
        span.set_attribute(GENMESH_ERROR_TYPE, code)
    else:
        span.set_attributes({GENMESH_ERROR_TYPE: code, ERROR_TYPE: code})
        span.set_status(Status(StatusCode.ERROR, message))


# --------------------------------------------------------------------- spans over frames


class FrameSpan:
    """A span over one stream of reply frames (an attempt, a worker's run): the first
    token and the finish are events, the token count an attribute, an `err` frame marks it
    ERROR. Ends once. A span that does not record (sampled out) looks at no frame."""

    __slots__ = ("_ended", "recording", "span", "summary")

    def __init__(self, span: Span) -> None:
        self.span = span
        self.recording = span.is_recording()
        self.summary = frames.Summary()
        self._ended = False

    def frame(self, frame: frames.Frame) -> None:
        """Note a frame of the stream; a terminal one ends the span."""
        if not self.recording:
            return
        summary = self.summary
        if frame["t"] == frames.OUT and summary.tokens:  # most frames: only the count moves
            summary.tokens += len(frame["tokens"])
            return
        tokens = summary.add(frame)
        if tokens and summary.tokens == len(tokens):
            self.span.add_event(FIRST_TOKEN)
        kind = frame["t"]
        if kind == frames.ACK:
            worker, dispatch = summary.worker, summary.dispatch
            if worker is not None and dispatch is not None:
                self.span.set_attributes({WORKER: worker, DISPATCH_ID: dispatch})
        elif kind == frames.END or kind == frames.ERR:
            self.end()

    def first_token(self) -> None:
        """The stream's first token, for a span whose owner counts its tokens itself
        (and gives the count to `end`) instead of showing it each frame."""
        if self.recording:
            self.span.add_event(FIRST_TOKEN)

    def end(
        self,
        last: frames.Frame | None = None,
        error_type: str | None = None,
        tokens: int | None = None,
    ) -> None:
        """End the span: with the stream's terminal frame `last` if `frame` has not seen
        it, or as failed with `error_type` when the stream had no terminal frame.
        `tokens`: the stream's output tokens, if its owner counted them."""
        if self._ended:
            return
        self._ended = True
        summary = self.summary
        if last is not None and last["t"] in frames.TERMINAL:
            summary.add(last)
        if tokens is not None:
            summary.tokens = tokens
        span = self.span
        if self.recording:
            attributes: dict[str, Any] = {TOKENS_OUTPUT: summary.tokens}
            if summary.finished:
                if summary.finish_reason is not None:
                    attributes[FINISH_REASON] = summary.finish_reason
                span.add_event(FINISH, attributes)
            span.set_attributes(attributes)
            if summary.error is not None:
                error = summary.error
                fail(span, str(error.get("code")), str(error.get("message") or ""))
            elif not summary.finished and error_type is not None:
                fail(span, error_type, error_type)
        span.end()


class remote_parent:  # a class: a generator-based context manager costs twice as much
    """Make the trace context that `headers` carry current for the block (a message
    callback: spans started inside, and tasks spawned inside, become its children)."""

    __slots__ = ("_token", "headers")

    def __init__(self, headers: Mapping[str, str] | None) -> None:
        self.headers = headers

    def __enter__(self) -> None:
        self._token = attach(extract(self.headers))

    def __exit__(self, *exc_info: object) -> None:
        detach(self._token)


def enter(span: FrameSpan) -> None:
    """Make `span` current for the rest of the calling task, which owns it (a worker's
    request task): the task's context is its own copy, so nothing leaks out."""
    attach(with_span(span.span))

"""The frontend's part of a request's trace, as an observer (observers.py).

Each HTTP request gets a SERVER span, a child of the caller's `traceparent` if it sent one.
The span is made current in the handler's task from `request()` to `finished()` (the
handler calls both in its own task), so the dispatch attempts that `MeshClient` starts for
the request, one CLIENT span each, are its children, migrations included.
"""

from __future__ import annotations

from typing import Any

from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from genmesh.client import MIG, ClientFrame
from genmesh.services.frontend.observers import RequestInfo
from genmesh.shared import frames, tracing
from genmesh.shared.errors import ErrorCode

MIGRATION = "migration"
_CANCELLED = ErrorCode.CANCELLED.value


class TraceObserver:
    """Add to `FrontendState.observers` only while tracing is on (`tracing.tracer()`)."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer

    def request(self, info: RequestInfo) -> RequestTrace:
        return RequestTrace(self.tracer, info)


class RequestTrace:
    """A sampled-out request's span records nothing, and this looks at none of its frames;
    its context is still current, so the hops downstream learn it is not sampled."""

    __slots__ = ("_token", "items", "recording", "span", "tokens")

    def __init__(self, tracer: Tracer, info: RequestInfo) -> None:
        parent = tracing.extract(info.headers)
        self.span: Span = tracer.start_span(
            f"{info.method} {info.endpoint}",
            parent,
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": info.method,
                "http.route": info.endpoint,
                "url.path": info.endpoint,
                tracing.FORMAT: info.format,
            },
        )
        self.recording = self.span.is_recording()
        # What each generation's frames said; the request's output tokens so far.
        self.items: list[frames.Summary] = []
        self.tokens = 0
        # Detached in finished(), which the handler calls in this same task.
        self._token = tracing.attach(tracing.with_span(self.span, parent))

    def dispatched(self, info: RequestInfo) -> None:
        if not self.recording:
            return
        self.items = [frames.Summary() for _ in info.items]
        span = self.span
        attributes: dict[str, Any] = {
            "genmesh.stream": info.stream,
            "genmesh.items": len(self.items),
        }
        if info.items:
            attributes[tracing.REQUEST_ID] = info.items[0].id
        if info.public_id is not None:
            attributes["genmesh.public_id"] = info.public_id
        if info.client_id is not None:
            attributes[tracing.CLIENT_ID] = info.client_id
        span.set_attributes(attributes)

    def frame(self, index: int, frame: ClientFrame) -> None:
        if not self.recording:
            return
        span = self.span
        if frame["t"] == MIG:
            span.add_event(
                MIGRATION,
                {
                    "genmesh.item": index,
                    tracing.ATTEMPT: frame["attempt"],
                    "genmesh.reason": frame["message"],
                    "genmesh.migration.cause": str(frame["reason"]),
                    "genmesh.from_worker": frame["from_worker"] or "",
                    "genmesh.delivered": frame["delivered"],
                },
            )
            return
        summary = self.items[index]
        if frame["t"] == frames.OUT and self.tokens:  # most frames: only the count moves
            count = len(frame["tokens"])
            summary.tokens += count
            self.tokens += count
            return
        tokens = summary.add(frame)
        if tokens:
            if not self.tokens:
                span.add_event(tracing.FIRST_TOKEN)
            self.tokens += len(tokens)
        if frame["t"] == frames.END:
            attributes: dict[str, Any] = {"genmesh.item": index}
            reason = summary.finish_reason
            if reason is not None:
                attributes[tracing.FINISH_REASON] = reason
                if len(self.items) == 1:
                    span.set_attribute(tracing.FINISH_REASON, reason)
            span.add_event(tracing.FINISH, attributes)

    def finished(self, status: int, error_type: str | None) -> None:
        span = self.span
        try:
            if self.recording:
                attributes: dict[str, Any] = {
                    "http.response.status_code": status,
                    tracing.TOKENS_OUTPUT: self.tokens,
                }
                if error_type is not None:
                    attributes[tracing.GENMESH_ERROR_TYPE] = error_type
                # As for any HTTP server span: 5xx is an error, 4xx the client's (499: it
                # went away). A stream that failed after its 200 is an error too.
                failed_in_band = status < 400 and error_type not in (None, _CANCELLED)
                if status >= 500 or failed_in_band:
                    attributes[tracing.ERROR_TYPE] = error_type or str(status)
                    span.set_status(Status(StatusCode.ERROR, error_type or str(status)))
                span.set_attributes(attributes)
            span.end()
        finally:
            tracing.detach(self._token)

"""The worker's spans: one per request it admitted (a child of the requester's attempt
span, through the NATS headers), and one that ends at once per request it refused."""

from __future__ import annotations

from typing import Any

from opentelemetry.trace import SpanKind

from genmesh.shared import tracing
from genmesh.shared.envelope import Envelope
from genmesh.shared.errors import ErrorCode
from genmesh.shared.tracing import (
    ATTEMPT,
    DISPATCH_ID,
    ENGINE,
    FORMAT,
    PD_PREFILL_WORKER,
    PD_ROLE,
    REQUEST_ID,
    WORKER,
    FrameSpan,
    attempt_of,
    fail,
    nats_attributes,
)


def _worker_attributes(subject: str, worker: str, engine: str) -> dict[str, Any]:
    attributes = nats_attributes(subject, "process", "process")
    attributes[WORKER] = worker
    attributes[ENGINE] = engine
    return attributes


def worker_span(
    subject: str,
    envelope: Envelope,
    worker: str,
    engine: str,
    dispatch: str,
    prefill_worker: str | None = None,
) -> FrameSpan | None:
    """A worker's span for a request it admitted, a child of the current context (the
    requester's, through `remote_parent`). Current in the request's task (`enter`)."""
    tracer = tracing.tracer()
    if tracer is None:
        return None
    attributes = _worker_attributes(subject, worker, engine)
    attributes[REQUEST_ID] = envelope.id
    attributes[DISPATCH_ID] = dispatch
    attributes[ATTEMPT] = attempt_of(envelope)
    attributes[FORMAT] = envelope.format
    if envelope.disagg is not None:
        attributes[PD_ROLE] = "prefill"
    elif prefill_worker is not None:
        attributes[PD_ROLE] = "decode"
        attributes[PD_PREFILL_WORKER] = prefill_worker
    # Given at the start: the span's attributes are built (and checked) once.
    span = tracer.start_span(f"process {subject}", kind=SpanKind.CONSUMER, attributes=attributes)
    return FrameSpan(span)


def worker_rejected(
    subject: str, worker: str, engine: str, request_id: str | None, code: ErrorCode, message: str
) -> None:
    """A worker's span for a request it refused: ERROR, and over at once."""
    tracer = tracing.tracer()
    if tracer is None:
        return
    span = tracer.start_span(f"process {subject}", kind=SpanKind.CONSUMER)
    if span.is_recording():
        attributes = _worker_attributes(subject, worker, engine)
        if request_id is not None:
            attributes[REQUEST_ID] = request_id
        span.set_attributes(attributes)
        fail(span, code.value, message)
    span.end()

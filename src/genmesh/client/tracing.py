"""The requester's span per dispatch attempt: a child of the caller's current span (the
frontend's request span), the parent of the router's and worker's spans."""

from __future__ import annotations

from opentelemetry.trace import SpanKind

from genmesh.shared import tracing
from genmesh.shared.envelope import Envelope
from genmesh.shared.tracing import (
    ATTEMPT,
    FORMAT,
    REQUEST_ID,
    FrameSpan,
    attempt_of,
    nats_attributes,
)


def attempt_span(envelope: Envelope, subject: str) -> FrameSpan | None:
    """One dispatch attempt of a requester (MeshClient), a child of the current span."""
    tracer = tracing.tracer()
    if tracer is None:
        return None
    span = tracer.start_span(f"send {subject}", kind=SpanKind.CLIENT)
    if span.is_recording():
        attributes = nats_attributes(subject, "send", "send")
        attributes[REQUEST_ID] = envelope.id
        attributes[ATTEMPT] = attempt_of(envelope)
        attributes[FORMAT] = envelope.format
        span.set_attributes(attributes)
    return FrameSpan(span)

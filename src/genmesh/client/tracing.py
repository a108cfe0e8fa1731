"""The requester's span per dispatch attempt: a child of the caller's current span (the
frontend's request span), the parent of the router's and worker's spans."""

from __future__ import annotations

from opentelemetry.trace import SpanKind

from genmesh.routing.choice import Decision
from genmesh.shared import tracing
from genmesh.shared.envelope import Envelope
from genmesh.shared.tracing import (
    ATTEMPT,
    FORMAT,
    REQUEST_ID,
    ROUTER_CANDIDATES,
    ROUTER_POLICY,
    WORKER,
    FrameSpan,
    attempt_of,
    nats_attributes,
)


def attempt_span(
    envelope: Envelope, subject: str, policy: str | None, decision: Decision | None
) -> FrameSpan | None:
    """One dispatch attempt of a requester (MeshClient), a child of the current span. A
    client that routes itself (`policy`) puts its decision, if it made one, on it: there
    is no router span then."""
    tracer = tracing.tracer()
    if tracer is None:
        return None
    span = tracer.start_span(f"send {subject}", kind=SpanKind.CLIENT)
    if span.is_recording():
        attributes = nats_attributes(subject, "send", "send")
        attributes[REQUEST_ID] = envelope.id
        attributes[ATTEMPT] = attempt_of(envelope)
        attributes[FORMAT] = envelope.format
        if policy is not None:
            attributes[ROUTER_POLICY] = policy
        if decision is not None:
            attributes[WORKER] = decision.worker.id
            attributes[ROUTER_CANDIDATES] = len(decision.candidates)
        span.set_attributes(attributes)
    return FrameSpan(span)

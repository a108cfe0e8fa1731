"""The requester's spans for its dispatch attempts.

A NATS-level requester (`genmesh request`, a program embedding `MeshClient`) has nothing
else that stands for the request: each attempt is a CLIENT span, a child of the caller's
current span (or a root), the parent of the router's and worker's spans.

Under the frontend the HTTP server span already stands for the request, so attempts make
no span of their own (`MeshClient(attempt_spans=False)`): the worker's span is a child of
the server span, and carries `genmesh.attempt`. Only an attempt that failed says something
the server span cannot (how long it ran, on which worker, why it failed, even when that
worker died with its span), so it gets a span after the fact, from its start to its
failure, status ERROR.
"""

from __future__ import annotations

from typing import Any

from opentelemetry.trace import SpanKind

from genmesh.routing.choice import Decision
from genmesh.shared import frames, tracing
from genmesh.shared.envelope import Envelope
from genmesh.shared.tracing import (
    ATTEMPT,
    FORMAT,
    PD_PREFILL_WORKER,
    REQUEST_ID,
    ROUTER_CANDIDATES,
    ROUTER_POLICY,
    WORKER,
    FrameSpan,
    attempt_of,
    fail,
    nats_attributes,
)


def _attributes(
    envelope: Envelope, subject: str, policy: str | None, decision: Decision | None
) -> dict[str, Any]:
    """An attempt span's attributes; a client that routes itself (`policy`) adds its
    decision, if it made one: there is no router span then."""
    attributes: dict[str, Any] = nats_attributes(subject, "send", "send")
    attributes[REQUEST_ID] = envelope.id
    attributes[ATTEMPT] = attempt_of(envelope)
    attributes[FORMAT] = envelope.format
    if policy is not None:
        attributes[ROUTER_POLICY] = policy
    if decision is not None:
        attributes[WORKER] = decision.worker.id
        attributes[ROUTER_CANDIDATES] = len(decision.candidates)
        if decision.prefill is not None:
            attributes[PD_PREFILL_WORKER] = decision.prefill.id
    return attributes


def attempt_span(
    envelope: Envelope, subject: str, policy: str | None, decision: Decision | None
) -> FrameSpan | None:
    """One dispatch attempt of a requester (MeshClient), a child of the current span."""
    tracer = tracing.tracer()
    if tracer is None:
        return None
    span = tracer.start_span(f"send {subject}", kind=SpanKind.CLIENT)
    if span.is_recording():
        span.set_attributes(_attributes(envelope, subject, policy, decision))
    return FrameSpan(span)


def failed_attempt_span(
    envelope: Envelope,
    subject: str,
    started_ns: int,
    worker: str | None,
    err: frames.ErrFrame,
    policy: str | None = None,
    decision: Decision | None = None,
) -> None:
    """The span of an attempt that failed with `err`, made when it failed: from
    `started_ns` to now, a child of the current span (the frontend's server span)."""
    tracer = tracing.tracer()
    if tracer is None:
        return
    span = tracer.start_span(f"send {subject}", kind=SpanKind.CLIENT, start_time=started_ns)
    if span.is_recording():
        attributes = _attributes(envelope, subject, policy, decision)
        if worker is not None:
            attributes[WORKER] = worker
        span.set_attributes(attributes)
        fail(span, err["code"], err["message"])
    span.end()

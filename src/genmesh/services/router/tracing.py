"""The router's span per request: a child of the requester's span (the frontend's request
span, or a `MeshClient`'s attempt span), ended with the routing decision; the forward
carries its context, so the worker's span is its child."""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind

from genmesh.shared import tracing
from genmesh.shared.discovery import WorkerInfo
from genmesh.shared.envelope import Envelope
from genmesh.shared.errors import ErrorCode
from genmesh.shared.tracing import (
    ATTEMPT,
    FORMAT,
    MAX_LISTED,
    PD_PREFILL_WORKER,
    REQUEST_ID,
    ROUTER,
    ROUTER_CANDIDATE_IDS,
    ROUTER_CANDIDATES,
    ROUTER_POLICY,
    WORKER,
    attempt_of,
    extract,
    fail,
    inject,
    nats_attributes,
)


class HopSpan:
    """A span with the context it continues (a router's: its forward carries both)."""

    __slots__ = ("parent", "span")

    def __init__(self, span: Span, parent: Context) -> None:
        self.span = span
        self.parent = parent


def router_span(
    headers: Mapping[str, str] | None, subject: str, envelope: Envelope, policy: str, router: str
) -> HopSpan | None:
    """A router's span for one request, a child of the requester's span in `headers`."""
    tracer = tracing.tracer()
    if tracer is None:
        return None
    parent = extract(headers)
    attributes = nats_attributes(subject, "process", "process")
    attributes[ROUTER] = router
    attributes[ROUTER_POLICY] = policy
    attributes[REQUEST_ID] = envelope.id
    attributes[ATTEMPT] = attempt_of(envelope)
    attributes[FORMAT] = envelope.format
    # Given at the start: the span's attributes are built (and checked) once.
    span = tracer.start_span(
        f"process {subject}", parent, kind=SpanKind.CONSUMER, attributes=attributes
    )
    return HopSpan(span, parent)


def routed(
    hop: HopSpan,
    worker: WorkerInfo,
    candidates: list[WorkerInfo],
    headers: Mapping[str, str] | None,
    prefill: WorkerInfo | None = None,
) -> dict[str, str]:
    """End the router's span with its decision (the worker, among how many free eligible
    ones, and its prefill worker if paired); the forward's headers, carrying the span's
    context (the requester's baggage kept), so that the worker's span is its child."""
    span = hop.span
    if span.is_recording():
        attributes: dict[str, str | int | list[str]] = {
            WORKER: worker.id,
            ROUTER_CANDIDATES: len(candidates),
            ROUTER_CANDIDATE_IDS: [w.id for w in candidates[:MAX_LISTED]],
        }
        if prefill is not None:
            attributes[PD_PREFILL_WORKER] = prefill.id
        span.set_attributes(attributes)
    forwarded = inject(headers, span, hop.parent)
    span.end()
    return forwarded


def rejected(hop: HopSpan | None, code: ErrorCode, message: str) -> None:
    """End a router's span whose request it could not route."""
    if hop is not None:
        if hop.span.is_recording():
            fail(hop.span, code.value, message)
        hop.span.end()

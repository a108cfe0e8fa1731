"""How the frontend's observers (metrics, traces, request records) see each request.

The shared handler tells every observer, for each HTTP request: that it arrived (and for
which format and route), what it dispatched (one envelope per generation), every reply
frame (including client-made `mig` frames and errors) and, exactly once, how it ended.
Observers keep their own per-request state; with none configured this costs nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from genmesh.client import ClientFrame
from genmesh.shared.envelope import Envelope


@dataclass(slots=True)
class RequestInfo:
    format: str
    method: str
    endpoint: str
    received_at: float  # time.monotonic()
    received_unix: float  # time.time()
    public_id: str | None = None
    client_id: str | None = None
    stream: bool = False
    # One per generation, with their private IDs; empty when refused before dispatch.
    items: list[Envelope] = field(default_factory=list)
    # The request's headers and body as received (the body once read); for request records.
    headers: Mapping[str, str] | None = None
    body: bytes = b""


class RequestObserver(Protocol):
    def dispatched(self, info: RequestInfo) -> None:
        """The items are about to be dispatched (their IDs and envelopes are final)."""
        ...

    def frame(self, index: int, frame: ClientFrame) -> None:
        """A reply frame of item `index` (ack, out, ka, end, err, or the client's mig)."""
        ...

    def finished(self, status: int, error_type: str | None) -> None:
        """Exactly once: the HTTP status sent (200 for a stream that then failed in-band,
        499 for a client that went away) and the error code, or None on success."""
        ...


class Observer(Protocol):
    def request(self, info: RequestInfo) -> RequestObserver:
        """Begin observing a request that just arrived."""
        ...


class Observation:
    """The observers of one request, fed in one place by the handler."""

    __slots__ = ("_done", "error_type", "info", "observers")

    def __init__(self, observers: list[Observer], info: RequestInfo) -> None:
        self.info = info
        self.observers = [o.request(info) for o in observers]
        # Set by the handler where the request fails (also in-band, after a 200).
        self.error_type: str | None = None
        self._done = False

    def dispatched(self) -> None:
        for observer in self.observers:
            observer.dispatched(self.info)

    def frame(self, index: int, frame: ClientFrame) -> None:
        for observer in self.observers:
            observer.frame(index, frame)

    def finished(self, status: int, error_type: str | None) -> None:
        if self._done:
            return
        self._done = True
        for observer in self.observers:
            observer.finished(status, error_type)

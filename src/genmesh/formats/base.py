"""The format contract: what is native to one HTTP API (`docs/architecture.md`, "Formats").

A format parses and binds a native request into one envelope per generation it asks for
(a batch, or `n` samples, fans out into several), renders reply frames into native
records, and says how records fold into a unary body (`merge_rules`). Everything else,
the request lifecycle, belongs to the shared handler in
`genmesh.services.frontend.generate`.

Per item `i` of a request, each `out`/`end` frame becomes one *record*
(`Exchange.render`). Records are what merge rules apply to: the handler streams
`Exchange.sse(i, record)` payloads, or folds each item's records and hands the folds to
`Exchange.body` for the unary answer. So a unary body is, by construction, the fold of
the same records a stream carries.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from genmesh.formats.merge import Joiner, Rule
from genmesh.shared.engine_info import NO_ENGINES, EngineCatalog
from genmesh.shared.envelope import Envelope
from genmesh.shared.errors import MeshError
from genmesh.shared.frames import OutputFrame
from genmesh.shared.ids import new_public_id

Record = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    path: str


class RequestRejected(Exception):
    """A request the format refuses; `body` is already in the format's native error shape."""

    def __init__(self, status: int, body: Any, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.body = body
        self.message = message


@dataclass(slots=True)
class Bound:
    """A request bound by its format, ready for dispatch."""

    # One envelope per generation, in the order of the response. Their `id`s are empty:
    # the shared handler mints the private IDs.
    items: list[Envelope]
    stream: bool
    # The client's own request ID (echoed, never used to address anything).
    client_id: str | None
    # Format-private response options, handed back to `exchange`.
    options: Any = None
    # None: the request may migrate to another worker; else why it must not.
    migration: str | None = None
    # The client IDs the real server refuses to see twice while they run (SGLang: the
    # rids of its rid_to_state). The shared handler refuses a request holding one that is
    # running, with `GenerateFormat.duplicate_id`, and holds them until this one ends.
    running_ids: list[str] = field(default_factory=list)


class Exchange(ABC):
    """Per-request rendering state: frames in, native records and bodies out."""

    # The joiners of this request's `delta` fields, when they are not its format's
    # `joiners` (a client codec encodes the answer to a request that came encoded only).
    joiners: Mapping[str, Joiner] | None = None

    @abstractmethod
    def render(self, index: int, frame: OutputFrame) -> Record:
        """The record of item `index` for one `out` or `end` frame."""

    @abstractmethod
    def sse(self, index: int, record: Record) -> list[Any]:
        """The SSE payloads (JSON values) that carry `record`."""

    def new_attempt(self, index: int) -> None:  # noqa: B027 - optional; most count nothing
        """Item `index` continues on another worker (a migration): reset what the exchange
        counts per attempt. Records stay attempt-local; the merge rules rebase them."""

    def sse_end(self) -> list[Any]:
        """Payloads sent after every item has ended, before `[DONE]` (e.g. a usage chunk)."""
        return []

    @abstractmethod
    def body(self, items: list[Record]) -> Any:
        """The unary body from each item's folded records, in item order."""

    @abstractmethod
    def error(self, error: MeshError, status: int) -> Any:
        """The native error object for a failure of this request."""


class GenerateFormat(ABC):
    name: str
    # Each record field's merge rule, by dotted path; unlisted fields are `last`.
    merge_rules: Mapping[str, Rule]
    # Joiners for `delta` fields that are not plain lists or strings.
    joiners: Mapping[str, Joiner] = {}

    def __init__(self, routes: tuple[Route, ...] | None = None) -> None:
        self.routes = routes or self.default_routes()

    @classmethod
    @abstractmethod
    def default_routes(cls) -> tuple[Route, ...]: ...

    @abstractmethod
    def parse(self, body: bytes) -> Any:
        """The request body as a JSON value; raise RequestRejected if it is not JSON."""

    @abstractmethod
    def bind(
        self, request: Any, headers: Mapping[str, str], engines: EngineCatalog = NO_ENGINES
    ) -> Bound:
        """Validate a parsed request; raise RequestRejected with a native error body.
        `engines` are the facts the workers advertise (context length, sampling defaults),
        for the defaults and checks the real server applies; it may know nothing."""

    def new_public_id(self) -> str:
        """The public ID of a request whose client sent none, minted the way the real
        server mints its request IDs (shown in the response and `X-Request-Id`)."""
        return new_public_id()

    @abstractmethod
    def exchange(self, bound: Bound, public_id: str, received_at: float) -> Exchange: ...

    @abstractmethod
    def error_body(self, status: int, message: str) -> Any:
        """A native error body for failures outside any request (readiness, limits)."""

    def duplicate_id(self, client_id: str) -> RequestRejected:
        """The native refusal of a request one of whose `Bound.running_ids` is running."""
        message = f"request ID {client_id} is already running"
        return RequestRejected(400, self.error_body(400, message), message)

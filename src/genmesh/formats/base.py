"""The format contract: what is native to one HTTP API (`docs/architecture.md`, "Formats").

A format turns a native request into an envelope (`bind`), turns reply frames into native
response chunks (`Exchange.render`), and says how chunks fold into a unary body
(`merge_rules`). Everything else, the request lifecycle, belongs to the shared handler in
`genmesh.services.frontend.generate`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from genmesh.formats.merge import Rule
from genmesh.shared.envelope import Envelope
from genmesh.shared.errors import MeshError
from genmesh.shared.frames import Frame


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

    # `id` is empty here: the shared handler mints the private ID.
    envelope: Envelope
    stream: bool
    # The client's own request ID (echoed, never used to address anything).
    client_id: str | None
    # Format-private response options, handed back to `exchange`.
    options: Any = None
    # None: the request may migrate to another worker; else why it must not.
    migration: str | None = None


class Exchange(ABC):
    """Per-request rendering state: frames in, native chunks out."""

    @abstractmethod
    def render(self, frame: Frame) -> list[Any]:
        """Native response chunks for one `out` or `end` frame (possibly none)."""

    @abstractmethod
    def error(self, error: MeshError, status: int) -> Any:
        """The native error object for a failure of this request."""


class GenerateFormat(ABC):
    name: ClassVar[str]
    # Each response field's merge rule, by dotted path; unlisted fields are `last`.
    merge_rules: ClassVar[Mapping[str, Rule]]

    def __init__(self, routes: tuple[Route, ...]) -> None:
        self.routes = routes

    @classmethod
    @abstractmethod
    def default_routes(cls) -> tuple[Route, ...]: ...

    @abstractmethod
    def bind(self, body: bytes, headers: Mapping[str, str]) -> Bound:
        """Parse and validate; raise RequestRejected with a native error body."""

    @abstractmethod
    def exchange(self, bound: Bound, public_id: str, received_at: float) -> Exchange: ...

    @abstractmethod
    def error_body(self, status: int, message: str) -> Any:
        """A native error body for failures outside any request (readiness, limits)."""

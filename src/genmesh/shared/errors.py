"""The one error vocabulary of the mesh: codes carried by `err` frames and mapped to HTTP.

Every service speaks these codes on the wire (`docs/protocol.md`, "Error codes"); the
frontend turns them into statuses, and formats turn them into their native error bodies.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class ErrorCode(StrEnum):
    INVALID_ARGUMENT = "invalid_argument"
    BAD_ENVELOPE = "bad_envelope"
    UNKNOWN_CODEC = "unknown_codec"
    NOT_FOUND = "not_found"
    NO_WORKER = "no_worker"
    OVERLOADED = "overloaded"
    UNAVAILABLE = "unavailable"
    CANCELLED = "cancelled"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    NOT_IMPLEMENTED = "not_implemented"
    INTERNAL = "internal"


@dataclass(frozen=True, slots=True)
class _CodeInfo:
    http_status: int
    retryable: bool


_INFO: dict[ErrorCode, _CodeInfo] = {
    ErrorCode.INVALID_ARGUMENT: _CodeInfo(400, False),
    ErrorCode.BAD_ENVELOPE: _CodeInfo(400, False),
    ErrorCode.UNKNOWN_CODEC: _CodeInfo(400, False),
    ErrorCode.NOT_FOUND: _CodeInfo(404, False),
    ErrorCode.NO_WORKER: _CodeInfo(503, False),
    # Another worker may have room: retrying elsewhere is correct.
    ErrorCode.OVERLOADED: _CodeInfo(503, True),
    # The worker or its engine went away mid-request: the request itself is fine.
    ErrorCode.UNAVAILABLE: _CodeInfo(503, True),
    ErrorCode.CANCELLED: _CodeInfo(499, False),
    ErrorCode.DEADLINE_EXCEEDED: _CodeInfo(504, False),
    ErrorCode.NOT_IMPLEMENTED: _CodeInfo(501, False),
    ErrorCode.INTERNAL: _CodeInfo(500, False),
}


def http_status(code: ErrorCode) -> int:
    return _INFO[code].http_status


def default_retryable(code: ErrorCode) -> bool:
    return _INFO[code].retryable


def parse_code(value: object) -> ErrorCode:
    """Read a code off the wire; an unknown code from a newer peer is treated as internal."""
    try:
        return ErrorCode(str(value))
    except ValueError:
        return ErrorCode.INTERNAL


class MeshError(Exception):
    """An error with a wire code. Raised inside services, sent as an `err` frame."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        retryable: bool | None = None,
        detail: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retryable = default_retryable(code) if retryable is None else retryable
        self.detail = detail or {}

    def __repr__(self) -> str:
        return f"MeshError({self.code.value}, {self.message!r})"

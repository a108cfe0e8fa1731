"""Reply frames, protocol v1: what a worker streams to the requester's reply subject.

Every frame is a map `{t, id, seq, ...}`; `seq` counts 0, 1, 2, ... per dispatch, so a
requester sees a lost frame as a gap. A stream is `ack`, then `out`/`ka` frames, then
exactly one terminal frame, `end` or `err` (`docs/protocol.md`, "Reply frames").
"""

from __future__ import annotations

from typing import Any

from genmesh.shared.errors import ErrorCode, MeshError, parse_code

Frame = dict[str, Any]

ACK = "ack"
OUT = "out"
KA = "ka"
END = "end"
ERR = "err"
TYPES = frozenset({ACK, OUT, KA, END, ERR})
TERMINAL = frozenset({END, ERR})


class FrameError(ValueError):
    """A reply that is not a valid frame."""


def ack(request_id: str, worker: str, dispatch: str) -> Frame:
    return {"t": ACK, "id": request_id, "seq": 0, "worker": worker, "dispatch": dispatch}


def err(request_id: str | None, seq: int, error: MeshError) -> Frame:
    frame: Frame = {
        "t": ERR,
        "id": request_id,
        "seq": seq,
        "code": error.code.value,
        "message": error.message,
        "retryable": error.retryable,
    }
    if error.detail:
        frame["detail"] = error.detail
    return frame


def check(obj: Any) -> Frame:
    """Validate the common fields of a received frame. Unknown types pass: a client skips
    them, so a newer worker can add frame types without breaking older clients."""
    if not isinstance(obj, dict):
        raise FrameError(f"frame: expected a map, got {type(obj).__name__}")
    if not isinstance(obj.get("t"), str):
        raise FrameError(f"frame: type must be a string, got {obj.get('t')!r}")
    seq = obj.get("seq")
    if isinstance(seq, bool) or not isinstance(seq, int):
        raise FrameError(f"frame: seq must be an integer, got {seq!r}")
    return obj


def error_of(frame: Frame) -> MeshError:
    """The MeshError an `err` frame carries."""
    detail = frame.get("detail")
    retryable = frame.get("retryable")
    return MeshError(
        parse_code(frame.get("code")),
        str(frame.get("message") or ""),
        retryable=retryable if isinstance(retryable, bool) else None,
        detail=detail if isinstance(detail, dict) else None,
    )


def synthetic_err(request_id: str, code: ErrorCode, message: str) -> Frame:
    """An `err` frame made by the requester itself (timeouts, lost frames, no responders)."""
    frame = err(request_id, -1, MeshError(code, message))
    frame["origin"] = "client"
    return frame

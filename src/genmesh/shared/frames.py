"""Reply frames, protocol v1: what a worker streams to the requester's reply subject.

Every frame is a map `{t, id, seq, ...}`; `seq` counts 0, 1, 2, ... per dispatch, so a
requester sees a lost frame as a gap. A stream is `ack`, then `out`/`ka` frames, then
exactly one terminal frame, `end` or `err` (`docs/protocol.md`, "Reply frames").

Frames stay plain dicts on the hot path (one per token): the types below are TypedDicts,
which cost nothing at run time, and `parse` is where a received map becomes one of them.
`Summary` is the one reading of a stream that metrics, traces and request records share.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, Required, TypedDict

from genmesh.shared.errors import ErrorCode, MeshError, parse_code

ACK: Literal["ack"] = "ack"
OUT: Literal["out"] = "out"
KA: Literal["ka"] = "ka"
END: Literal["end"] = "end"
ERR: Literal["err"] = "err"
TYPES = frozenset({ACK, OUT, KA, END, ERR})
TERMINAL = frozenset({END, ERR})

# (token_id, logprob) alternatives at one position, best first.
TopLogprobs = list[tuple[int, float]]


class Finish(TypedDict, total=False):
    """Why a generation stopped (`docs/protocol.md` §6.5)."""

    reason: Required[str]  # eos | stop | length | abort
    matched: int | None
    message: str
    # What an engine adds to an abort (the SGLang format reads these).
    status_code: int | None
    err_type: str | None


class Usage(TypedDict, total=False):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class AckFrame(TypedDict):
    t: Literal["ack"]
    id: str
    seq: int
    worker: str
    dispatch: str


class _Output(TypedDict, total=False):
    """The fields an `out` and an `end` frame share (`docs/protocol.md` §6.3)."""

    id: Required[str]
    seq: Required[int]
    tokens: Required[list[int]]
    logprobs: list[float]
    ranks: list[int]
    top_logprobs: list[TopLogprobs]
    prompt_logprobs: list[float | None]
    prompt_ranks: list[int | None]
    prompt_top_logprobs: list[TopLogprobs | None]
    token_ids_logprobs: list[TopLogprobs]
    prompt_token_ids_logprobs: list[TopLogprobs | None]
    routed_experts: list[list[int]]
    cached_tokens: int
    engine: dict[str, Any]


class OutFrame(_Output, total=False):
    t: Required[Literal["out"]]


class EndFrame(_Output, total=False):
    t: Required[Literal["end"]]
    finish: Required[Finish]
    usage: Required[Usage]
    # A prefill stage's result for its decode half (docs/protocol.md §14): opaque to the
    # mesh, read by the decode worker's engine (vLLM's kv_transfer_params, the mock's KV
    # handle).
    handoff: dict[str, Any]


class KaFrame(TypedDict):
    t: Literal["ka"]
    id: str
    seq: int


class ErrFrame(TypedDict):
    t: Literal["err"]
    id: str | None
    seq: int
    code: str
    message: str
    retryable: bool
    detail: NotRequired[dict[str, Any]]
    # "client": made by the requester itself, never sent by the mesh.
    origin: NotRequired[Literal["client"]]


OutputFrame = OutFrame | EndFrame
Frame = AckFrame | OutFrame | EndFrame | KaFrame | ErrFrame


class FrameError(ValueError):
    """A reply that is not a valid frame."""


def ack(request_id: str, worker: str, dispatch: str) -> AckFrame:
    return {"t": ACK, "id": request_id, "seq": 0, "worker": worker, "dispatch": dispatch}


def ka(request_id: str) -> KaFrame:
    return {"t": KA, "id": request_id, "seq": 0}


# The `seq` of the `ka` a router sends while it holds a request in its admission queue
# (docs/protocol.md §6.4): outside the stream's numbering, which the worker's `ack` starts.
HELD_SEQ = -1


def held(request_id: str) -> KaFrame:
    return {"t": KA, "id": request_id, "seq": HELD_SEQ}


def err(request_id: str | None, seq: int, error: MeshError) -> ErrFrame:
    frame: ErrFrame = {
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


def parse(obj: Any) -> tuple[int, Frame | None]:
    """A received map as (its `seq`, the frame); the frame is None for a type from a newer
    protocol, which a receiver counts and skips (a newer worker may add frame types without
    breaking older clients). Raises FrameError for anything else that is not a frame.

    Checks what a receiver relies on: the common fields, an `ack`'s worker and an output
    frame's token list; other keys are read with care where they are used."""
    if not isinstance(obj, dict):
        raise FrameError(f"frame: expected a map, got {type(obj).__name__}")
    kind = obj.get("t")
    if not isinstance(kind, str):
        raise FrameError(f"frame: type must be a string, got {kind!r}")
    seq = obj.get("seq")
    if isinstance(seq, bool) or not isinstance(seq, int):
        raise FrameError(f"frame: seq must be an integer, got {seq!r}")
    if kind in (OUT, END):
        if not isinstance(obj.get("tokens"), list):
            raise FrameError(f"frame: {kind} tokens must be a list, got {obj.get('tokens')!r}")
    elif kind == ACK:
        if not isinstance(obj.get("worker"), str):
            raise FrameError(f"frame: ack worker must be a string, got {obj.get('worker')!r}")
    elif kind not in TYPES:
        return seq, None
    frame: Frame = obj  # type: ignore[assignment]  # checked above, as far as it is read
    return seq, frame


def error_of(frame: ErrFrame) -> MeshError:
    """The MeshError an `err` frame carries."""
    detail = frame.get("detail")
    retryable = frame.get("retryable")
    return MeshError(
        parse_code(frame.get("code")),
        str(frame.get("message") or ""),
        retryable=retryable if isinstance(retryable, bool) else None,
        detail=detail if isinstance(detail, dict) else None,
    )


def synthetic_err(request_id: str, code: ErrorCode, message: str) -> ErrFrame:
    """An `err` frame made by the requester itself (timeouts, lost frames, no responders)."""
    frame = err(request_id, -1, MeshError(code, message))
    frame["origin"] = "client"
    return frame


def finish_reason(frame: EndFrame) -> str | None:
    """The `end` frame's finish reason, if it says one."""
    finish = frame.get("finish")
    reason = finish.get("reason") if isinstance(finish, dict) else None
    return reason if isinstance(reason, str) else None


class Summary:
    """What one stream of frames has said so far, read one frame at a time: the output
    tokens (a count, and the token IDs themselves with `keep_tokens`), the worker that
    acknowledged it, the first prompt-cache figure, how it ended. Traces, metrics and
    request records all read streams through it.

    `add` returns the tokens the frame carried, so that a caller can time them: the
    stream's first token came with the frame for which `add` returns as many tokens as
    `tokens` counts."""

    __slots__ = (
        "cached_tokens",
        "dispatch",
        "error",
        "finish_reason",
        "finished",
        "token_ids",
        "tokens",
        "worker",
    )

    def __init__(self, *, keep_tokens: bool = False) -> None:
        self.tokens = 0
        self.token_ids: list[int] | None = [] if keep_tokens else None
        self.worker: str | None = None
        self.dispatch: str | None = None
        self.cached_tokens: int | None = None
        self.finished = False  # an `end` frame came
        self.finish_reason: str | None = None  # its reason, if it gave one
        self.error: ErrFrame | None = None  # the `err` frame, if one came

    def add(self, frame: Frame) -> list[int]:
        if frame["t"] == OUT or frame["t"] == END:
            tokens = frame["tokens"]
            if tokens:
                self.tokens += len(tokens)
                if self.token_ids is not None:
                    self.token_ids.extend(tokens)
            if self.cached_tokens is None:
                cached = frame.get("cached_tokens")
                if cached is None and frame["t"] == END:
                    cached = (frame.get("usage") or {}).get("cached_tokens")
                if isinstance(cached, int):
                    self.cached_tokens = cached
            if frame["t"] == END:
                self.finished = True
                self.finish_reason = finish_reason(frame)
            return tokens
        if frame["t"] == ACK:
            self.worker = frame["worker"]
            dispatch = frame.get("dispatch")
            self.dispatch = dispatch if isinstance(dispatch, str) else None
        elif frame["t"] == ERR:
            self.error = frame
        return []

"""The request envelope, protocol v1: what a requester sends to a router or a worker.

On the wire it is a map with the field names below (`docs/protocol.md`, "Request
envelope"). `Envelope.from_wire` is the single place where untrusted maps become typed
values: anything malformed raises `EnvelopeError` naming the field, and unknown fields are
ignored so that newer requesters can talk to older workers.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeAlias, cast

from genmesh.codecs.int32 import TOKENS, first_high, from_le_bytes
from genmesh.shared.ids import MAX_CLIENT_ID_BYTES, MAX_ID_BYTES, id_problem

PROTOCOL_VERSION = 1
MAX_TOKEN_ID = 2**31 - 1


class EnvelopeError(ValueError):
    """A malformed envelope; the message names the offending field."""


def _int(
    obj: dict[str, Any], key: str, where: str, *, default: int | None, minimum: int | None = None
) -> int | None:
    value = obj.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise EnvelopeError(f"{where}{key}: expected an integer, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise EnvelopeError(f"{where}{key}: must be >= {minimum}, got {value}")
    return value


def finite_float(value: int | float) -> float | None:
    """`value` as a finite float, or None (NaN, infinities, JSON integers beyond a float)."""
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _float(obj: dict[str, Any], key: str, where: str) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    number = None
    if not isinstance(value, bool) and isinstance(value, int | float):
        number = finite_float(value)
    if number is None:
        raise EnvelopeError(f"{where}{key}: expected a finite number, got {value!r:.40}")
    return number


def _bool(obj: dict[str, Any], key: str, where: str, default: bool = False) -> bool:
    value = obj.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise EnvelopeError(f"{where}{key}: expected a boolean, got {type(value).__name__}")
    return value


def _str(obj: dict[str, Any], key: str, where: str) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise EnvelopeError(f"{where}{key}: expected a string, got {type(value).__name__}")
    return value


def _id(obj: dict[str, Any], key: str, where: str, limit: int = MAX_ID_BYTES) -> str | None:
    """A string field that holds an ID: bounded (`shared/ids.py`), never echoed when bad."""
    value = _str(obj, key, where)
    if value is not None:
        problem = id_problem(value, limit)
        if problem is not None:
            raise EnvelopeError(f"{where}{key}: {problem}")
    return value


def _map(obj: dict[str, Any], key: str) -> dict[str, Any]:
    value = obj.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise EnvelopeError(f"{key}: expected a map, got {type(value).__name__}")
    return value


def token_list(value: Any, where: str) -> list[int]:
    """Validate a list of token IDs (integers in [0, 2^31))."""
    if not isinstance(value, list):
        raise EnvelopeError(f"{where}: expected a list of token ids, got {type(value).__name__}")
    # Checked in C (a set of the entries' types, then min and max), so a 32k-token prompt
    # costs well under a millisecond; only a bad list is walked in Python, to say where.
    if value and (set(map(type, value)) != {int} or min(value) < 0 or max(value) > MAX_TOKEN_ID):
        for i, tid in enumerate(value):
            if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid <= MAX_TOKEN_ID:
                raise _bad_token(where, i, tid)
    return value


# An array of C ints, as mypy sees it.
if TYPE_CHECKING:
    IntArray: TypeAlias = array[int]
else:  # `array` takes no subscript at run time before Python 3.12
    IntArray = array


class TokenIds(IntArray):
    """A prompt: token IDs as unsigned 4-byte C ints, made from a request in one C pass and
    carried as one bin on msgpack (`codecs/int32.py`); whatever needs a list converts once. Equal
    to a list of the same IDs, and joined with one by `+`, as the list it replaces was
    (a slice is a plain array)."""

    __slots__ = ()
    __hash__ = None  # mutable, as arrays and lists are

    def __new__(cls, values: Iterable[int] = ()) -> TokenIds:
        return super().__new__(cls, TOKENS, values)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, list):
            return self.tolist() == other
        return array.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __add__(self, other: Iterable[int]) -> TokenIds:
        joined = TokenIds(self)
        joined.extend(other)
        return joined

    def __radd__(self, other: Iterable[int]) -> TokenIds:
        return TokenIds(other) + self

    # A copy is a TokenIds too (array's own copies are plain arrays).
    def __copy__(self) -> TokenIds:
        return TokenIds(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> TokenIds:
        return TokenIds(self)


def pack_token_ids(values: list[int]) -> TokenIds | None:
    """`values` as TokenIds when every one is a token ID, checked in C (no Python int is
    made); None when one is not, for the caller to find and name in its own words. An
    entry that is no integer raises TypeError (booleans are integers here)."""
    try:
        packed = TokenIds(values)  # refuses negatives and ids of 2^32 and above
    except OverflowError:
        return None
    return packed if first_high(packed) is None else None


def _bad_token(where: str, i: int, tid: int) -> EnvelopeError:
    return EnvelopeError(f"{where}[{i}]: expected a token id in [0, 2^31), got {tid!r}")


def token_array(value: Any, where: str) -> TokenIds:
    """Validate a prompt: a bin of little-endian int32 (genmesh's own requesters, on
    msgpack), a list of token IDs (JSON, and clients that send lists), or a token array
    (in-process). Token IDs are in [0, 2^31); a bad bin is refused as a bad list is."""
    if isinstance(value, bytes):
        if len(value) % 4:
            raise EnvelopeError(
                f"{where}: a bin of little-endian int32 must be a multiple of 4 bytes long, "
                f"got {len(value)} bytes"
            )
        packed = from_le_bytes(value, TokenIds())
        i = first_high(packed)
        if i is not None:  # the bin carries int32: an entry with its top bit set is negative
            raise _bad_token(where, i, packed[i] - (1 << 32))
        return packed
    if isinstance(value, TokenIds):
        i = first_high(value)
        if i is not None:
            raise _bad_token(where, i, value[i])
        return value
    # A list is checked as today (which refuses booleans too), then packed.
    return TokenIds(token_list(value, where))


def _str_list(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise EnvelopeError(f"{where}: expected a list of strings")
    return value


@dataclass(slots=True)
class Sampling:
    """Generation controls every engine understands. None = the engine's default."""

    max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> Sampling:
        w = "sampling."
        sampling = cls(
            max_tokens=_int(obj, "max_tokens", w, default=None, minimum=0),
            min_tokens=_int(obj, "min_tokens", w, default=0, minimum=0) or 0,
            temperature=_float(obj, "temperature", w),
            top_p=_float(obj, "top_p", w),
            top_k=_int(obj, "top_k", w, default=None),
            min_p=_float(obj, "min_p", w),
            seed=_int(obj, "seed", w, default=None),
            stop_token_ids=token_list(
                [] if obj.get("stop_token_ids") is None else obj["stop_token_ids"],
                "sampling.stop_token_ids",
            ),
            ignore_eos=_bool(obj, "ignore_eos", w),
        )
        if sampling.max_tokens is not None and sampling.min_tokens > sampling.max_tokens:
            raise EnvelopeError(
                f"sampling.min_tokens ({sampling.min_tokens}) exceeds "
                f"sampling.max_tokens ({sampling.max_tokens})"
            )
        return sampling

    def copy(self) -> Sampling:
        return replace(self, stop_token_ids=list(self.stop_token_ids))

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"min_tokens": self.min_tokens, "ignore_eos": self.ignore_eos}
        for key in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.stop_token_ids:
            out["stop_token_ids"] = self.stop_token_ids
        return out


@dataclass(slots=True)
class OutputOptions:
    """What the engine reports besides token IDs."""

    logprobs: bool = False
    top_logprobs: int = 0
    # Prompt position from which prompt logprobs are wanted; None = no prompt logprobs.
    prompt_logprobs_start: int | None = None
    # Position from which MoE routed-expert rows are wanted; None = not wanted.
    routed_experts_start: int | None = None
    # Token IDs whose logprobs are wanted at every generated position (and every prompt
    # position prompt logprobs are asked for), as SGLang's `token_ids_logprob`; None = none.
    logprob_token_ids: list[int] | None = None

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> OutputOptions:
        w = "output."
        token_ids = obj.get("logprob_token_ids")
        return cls(
            logprobs=_bool(obj, "logprobs", w),
            top_logprobs=_int(obj, "top_logprobs", w, default=0, minimum=0) or 0,
            prompt_logprobs_start=_int(obj, "prompt_logprobs_start", w, default=None, minimum=0),
            routed_experts_start=_int(obj, "routed_experts_start", w, default=None, minimum=0),
            logprob_token_ids=None
            if token_ids is None
            else token_list(token_ids, "output.logprob_token_ids") or None,
        )

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.logprobs:
            out["logprobs"] = True
        if self.top_logprobs:
            out["top_logprobs"] = self.top_logprobs
        if self.prompt_logprobs_start is not None:
            out["prompt_logprobs_start"] = self.prompt_logprobs_start
        if self.routed_experts_start is not None:
            out["routed_experts_start"] = self.routed_experts_start
        if self.logprob_token_ids:
            out["logprob_token_ids"] = self.logprob_token_ids
        return out


@dataclass(slots=True)
class Routing:
    """Hints for the router. Only `worker` and `exclude` are binding."""

    worker: str | None = None
    exclude: list[str] = field(default_factory=list)
    dp_rank: int | None = None
    priority: int | None = None
    cache_salt: str | None = None
    session: str | None = None

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> Routing:
        w = "routing."
        return cls(
            worker=_str(obj, "worker", w),
            exclude=_str_list(obj.get("exclude"), "routing.exclude"),
            dp_rank=_int(obj, "dp_rank", w, default=None, minimum=0),
            priority=_int(obj, "priority", w, default=None),
            cache_salt=_str(obj, "cache_salt", w),
            session=_str(obj, "session", w),
        )

    def copy(self) -> Routing:
        return replace(self, exclude=list(self.exclude))

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in ("worker", "dp_rank", "priority", "cache_salt", "session"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.exclude:
            out["exclude"] = self.exclude
        return out


@dataclass(slots=True)
class Continuation:
    """Set on a re-dispatch after a worker failed mid-stream: what was already delivered."""

    attempt: int
    delivered: int
    prompt_len: int
    max_tokens: int | None

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> Continuation:
        w = "continuation."
        return cls(
            attempt=_int(obj, "attempt", w, default=1, minimum=1) or 1,
            delivered=_int(obj, "delivered", w, default=0, minimum=0) or 0,
            prompt_len=_int(obj, "prompt_len", w, default=0, minimum=0) or 0,
            max_tokens=_int(obj, "max_tokens", w, default=None, minimum=0),
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "attempt": self.attempt,
            "delivered": self.delivered,
            "prompt_len": self.prompt_len,
            "max_tokens": self.max_tokens,
        }


# A prefill stage's envelope ID: its parent's, suffixed, so that a cancel of the parent
# reaches it too (workers match both, docs/protocol.md §14) while the decode worker can
# cancel the stage alone.
PREFILL_SUFFIX = "~p"
PREFILL_STAGE = "prefill"


def prefill_stage_id(parent_id: str) -> str:
    return parent_id + PREFILL_SUFFIX


@dataclass(slots=True)
class Disagg:
    """Marks an envelope as the prefill half of a disaggregated request (docs/protocol.md
    §14): sent by the decode worker that runs the request to the prefill worker the
    router paired it with. `ticket` is what both halves' engines must agree on (SGLang's
    bootstrap triple; empty for engines that hand the KV over after the prefill)."""

    parent: str
    ticket: dict[str, Any] = field(default_factory=dict)
    stage: str = PREFILL_STAGE

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> Disagg:
        w = "disagg."
        stage = _str(obj, "stage", w)
        if stage != PREFILL_STAGE:
            raise EnvelopeError(f"disagg.stage: expected {PREFILL_STAGE!r}, got {stage!r:.40}")
        parent = _id(obj, "parent", w)
        if not parent:
            raise EnvelopeError("disagg.parent: required, a non-empty string")
        ticket = obj.get("ticket")
        if ticket is None:
            ticket = {}
        if not isinstance(ticket, dict):
            raise EnvelopeError(f"disagg.ticket: expected a map, got {type(ticket).__name__}")
        return cls(parent=parent, ticket=ticket, stage=stage)

    def to_wire(self) -> dict[str, Any]:
        return {"stage": self.stage, "parent": self.parent, "ticket": self.ticket}


@dataclass(slots=True)
class Envelope:
    id: str
    token_ids: TokenIds
    format: str = ""
    model: str | None = None
    client_id: str | None = None
    sampling: Sampling = field(default_factory=Sampling)
    output: OutputOptions = field(default_factory=OutputOptions)
    routing: Routing = field(default_factory=Routing)
    # The format's native request fields, passed through to engines that speak that format.
    engine: dict[str, Any] = field(default_factory=dict)
    continuation: Continuation | None = None
    # Absolute deadline, Unix seconds; None = no deadline.
    deadline: float | None = None
    # Set on the prefill half of a disaggregated request only.
    disagg: Disagg | None = None

    def __post_init__(self) -> None:
        # Formats from other packages (and tests) may build envelopes from lists of ints;
        # every consumer reads the prompt as a token array.
        values: object = self.token_ids
        if not isinstance(values, TokenIds):
            self.token_ids = TokenIds(cast("Iterable[int]", values))

    @classmethod
    def from_wire(cls, obj: Any) -> Envelope:
        if not isinstance(obj, dict):
            raise EnvelopeError(f"envelope: expected a map, got {type(obj).__name__}")
        version = obj.get("v")
        if type(version) is not int or version != PROTOCOL_VERSION:
            raise EnvelopeError(f"v: unsupported protocol version {version!r:.40} (this is v1)")
        request_id = _id(obj, "id", "")
        if not request_id:
            raise EnvelopeError("id: required, a non-empty string")
        if "token_ids" not in obj:
            raise EnvelopeError("token_ids: required")
        token_ids = token_array(obj["token_ids"], "token_ids")
        if not token_ids:
            raise EnvelopeError("token_ids: must not be empty")
        continuation = _map(obj, "continuation")
        disagg = _map(obj, "disagg")
        envelope = cls(
            id=request_id,
            token_ids=token_ids,
            format=_str(obj, "format", "") or "",
            model=_str(obj, "model", ""),
            client_id=_id(obj, "client_id", "", MAX_CLIENT_ID_BYTES),
            sampling=Sampling.from_wire(_map(obj, "sampling")),
            output=OutputOptions.from_wire(_map(obj, "output")),
            routing=Routing.from_wire(_map(obj, "routing")),
            engine=_map(obj, "engine"),
            continuation=Continuation.from_wire(continuation) if continuation else None,
            deadline=_float(obj, "deadline", ""),
            disagg=Disagg.from_wire(disagg) if disagg else None,
        )
        start = envelope.output.prompt_logprobs_start
        if start is not None and start >= len(token_ids):
            raise EnvelopeError(
                f"output.prompt_logprobs_start ({start}) must be below the prompt length "
                f"({len(token_ids)})"
            )
        experts = envelope.output.routed_experts_start
        if experts is not None and experts > len(token_ids):
            raise EnvelopeError(
                f"output.routed_experts_start ({experts}) must not exceed the prompt length "
                f"({len(token_ids)})"
            )
        return envelope

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "v": PROTOCOL_VERSION,
            "id": self.id,
            "token_ids": self.token_ids,
            "format": self.format,
            "sampling": self.sampling.to_wire(),
        }
        for key in ("model", "client_id", "deadline"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        output = self.output.to_wire()
        if output:
            out["output"] = output
        routing = self.routing.to_wire()
        if routing:
            out["routing"] = routing
        if self.engine:
            out["engine"] = self.engine
        if self.continuation is not None:
            out["continuation"] = self.continuation.to_wire()
        if self.disagg is not None:
            out["disagg"] = self.disagg.to_wire()
        return out


def peek_id(obj: Any) -> str | None:
    """The request ID of a possibly malformed envelope (or of a cancel), for addressing an
    `err` frame: None unless it is a valid ID (a refusal never echoes an ID too long to
    send back)."""
    if isinstance(obj, dict):
        value = obj.get("id")
        if isinstance(value, str) and value and id_problem(value, MAX_ID_BYTES) is None:
            return value
    return None

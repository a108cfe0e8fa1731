"""`sampling_params` as vLLM builds and verifies `SamplingParams`.

pydantic checks each field's JSON type first (`1 validation error for GenerateRequest`),
then `SamplingParams._verify_args` checks the values, in vLLM's order and wording, as a
`VLLMValidationError` naming the parameter. Both answer HTTP 400 `BadRequestError`. Keys
the struct does not have are ignored, as pydantic ignores extra keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from genmesh.testkit.vllm.errors import ApiError, type_error

# `SamplingParams.max_tokens`' dataclass default: what old builds use when it is omitted.
DEFAULT_MAX_TOKENS = 16
INT64_MIN, INT64_MAX, UINT64_MAX = -(2**63), 2**63 - 1, 2**64 - 1

# The knobs that shape the distribution: the mock checks them but samples greedily anyway.
_FLOAT_KNOBS = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "min_p",
)
# Flags the mock only type-checks: they change text output, which a tokens-only server has not.
_TEXT_FLAGS = (
    "detokenize",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
)


@dataclass(frozen=True, slots=True)
class Sampling:
    """The `SamplingParams` fields the mock acts on, verified."""

    n: int
    seed: int | None
    # As sent: None = omitted or null (see `request.budget`).
    max_tokens: int | None
    max_tokens_sent: bool
    min_tokens: int
    stop_token_ids: list[int]
    ignore_eos: bool
    logprobs: int | None
    prompt_logprobs: int | None


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _opt_int(sp: dict[str, Any], key: str) -> int | None:
    value = sp.get(key)
    if value is not None and not is_int(value):
        raise type_error(f"sampling_params.{key}", "integer", value)
    return value


def _opt_number(sp: dict[str, Any], key: str) -> float | None:
    value = sp.get(key)
    if value is None:
        return None
    if not _is_number(value):
        raise type_error(f"sampling_params.{key}", "number", value)
    return float(value)


def _opt_bool(sp: dict[str, Any], key: str) -> bool | None:
    value = sp.get(key)
    if value is not None and not isinstance(value, bool):
        raise type_error(f"sampling_params.{key}", "boolean", value)
    return value


def _invalid(message: str, param: str) -> ApiError:
    """`SamplingParams._verify_args` failures: VLLMValidationError with its parameter."""
    return ApiError(message, 400, param)


def parse_sampling(sp: dict[str, Any]) -> Sampling:
    """`SamplingParams` as vLLM builds and verifies them: every field's type, then values."""
    n = _opt_int(sp, "n")
    knobs: dict[str, float | None] = {key: _opt_number(sp, key) for key in _FLOAT_KNOBS}
    knobs["top_k"] = _opt_int(sp, "top_k")
    seed = _opt_int(sp, "seed")
    max_tokens = _opt_int(sp, "max_tokens")
    min_tokens = _opt_int(sp, "min_tokens")
    logprobs = _opt_int(sp, "logprobs")
    prompt_logprobs = _opt_int(sp, "prompt_logprobs")
    ignore_eos = _opt_bool(sp, "ignore_eos")
    for key in _TEXT_FLAGS:
        _opt_bool(sp, key)
    stop_ids = _check_stops(sp)
    extra = sp.get("extra_args")
    if extra is not None and not isinstance(extra, dict):
        raise type_error("sampling_params.extra_args", "dictionary", extra)
    sampling = Sampling(
        n=1 if n is None else n,
        seed=seed,
        max_tokens=max_tokens,
        max_tokens_sent="max_tokens" in sp,
        min_tokens=0 if min_tokens is None else min_tokens,
        stop_token_ids=list(stop_ids),
        ignore_eos=bool(ignore_eos),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )
    _verify_args(sampling, knobs)
    return sampling


def _check_stops(sp: dict[str, Any]) -> list[Any]:
    """The types of `stop` and `stop_token_ids`; the stop ids as sent (or [])."""
    stop = sp.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise type_error("sampling_params.stop", "string or list of strings", stop)
    stop_ids = sp.get("stop_token_ids")
    if stop_ids is None:
        stop_ids = []
    if not isinstance(stop_ids, list) or not all(is_int(t) for t in stop_ids):
        raise type_error("sampling_params.stop_token_ids", "list of integers", stop_ids)
    return stop_ids


# _verify_args' checks of the knobs, in vLLM's order: (name, refuses, rule). A null knob
# is not checked; NaN passes where vLLM's comparison lets it pass.
_KNOB_CHECKS: tuple[tuple[str, Callable[[float], bool], str], ...] = (
    ("presence_penalty", lambda v: not -2.0 <= v <= 2.0, "must be in [-2, 2]"),
    ("frequency_penalty", lambda v: not -2.0 <= v <= 2.0, "must be in [-2, 2]"),
    ("repetition_penalty", lambda v: v <= 0.0, "must be greater than zero"),
    ("temperature", lambda v: v < 0.0, "must be non-negative"),
    ("top_p", lambda v: not 0.0 < v <= 1.0, "must be in (0, 1]"),
    ("top_k", lambda v: v < -1, "must be 0 (disable), or at least 1"),
    ("min_p", lambda v: not 0.0 <= v <= 1.0, "must be in [0, 1]"),
)


def _verify_args(s: Sampling, knobs: dict[str, float | None]) -> None:
    """`SamplingParams._verify_args`, in vLLM's order and wording."""
    if s.n < 1:
        raise _invalid(f"n must be at least 1, got {s.n}.", "n")
    for name, refuses, rule in _KNOB_CHECKS:
        value = knobs[name]
        if value is not None and refuses(value):
            raise _invalid(f"{name} {rule}, got {value}.", name)
    _verify_lengths(s)
    for key, value in (("logprobs", s.logprobs), ("prompt_logprobs", s.prompt_logprobs)):
        if value is not None and value < -1:
            raise _invalid(f"{key} must be non-negative or -1, got {value}.", key)
    if s.seed is not None and not INT64_MIN <= s.seed <= UINT64_MAX:
        raise ApiError(f"int too big to convert: seed {s.seed}", 400, "seed")
    if any(not 0 <= t <= UINT64_MAX for t in s.stop_token_ids):
        raise type_error("sampling_params.stop_token_ids", "list of non-negative integers",
                         s.stop_token_ids)  # fmt: skip


def _verify_lengths(s: Sampling) -> None:
    # The struct is built (and verified) with the dataclass default when max_tokens is
    # omitted; the newest route replaces it only afterwards. So `min_tokens > 16` without
    # `max_tokens` is refused, as in vLLM.
    verified_max = s.max_tokens if s.max_tokens_sent else DEFAULT_MAX_TOKENS
    if verified_max is not None and verified_max < 1:
        raise _invalid(f"max_tokens must be at least 1, got {verified_max}.", "max_tokens")
    if s.min_tokens < 0:
        raise _invalid(
            f"min_tokens must be greater than or equal to 0, got {s.min_tokens}.", "min_tokens"
        )
    if verified_max is not None and s.min_tokens > verified_max:
        raise _invalid(
            f"min_tokens must be less than or equal to max_tokens={verified_max}, "
            f"got {s.min_tokens}.",
            "min_tokens",
        )

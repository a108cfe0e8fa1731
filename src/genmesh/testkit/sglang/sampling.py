"""`sampling_params` as SGLang's `SamplingParams` builds, normalizes and verifies them."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from genmesh.testkit.sglang.request import JSON, Rejected, is_int


def _number(sp: JSON, name: str, default: float) -> float:
    value = sp.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Rejected(f"{name} must be a number, got {value!r}.")
    return float(value)


def _integer(sp: JSON, name: str, default: int | None) -> int | None:
    value = sp.get(name, default)
    if value is None:
        return None
    if not is_int(value):
        raise Rejected(f"{name} must be an integer, got {value!r}.")
    return int(value)


@dataclass(frozen=True, slots=True)
class Sampling:
    max_new_tokens: int | None
    min_new_tokens: int
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    seed: int
    stream_interval: int
    grammar: str | None


def parse_sampling(sp: JSON, vocab_size: int) -> Sampling:
    """`SamplingParams(**sp)`, `.normalize(None)` and `.verify(vocab)`, with SGLang's messages.

    Unknown keys are tolerated (SGLang itself would raise a TypeError). Wrong value types
    get this mock's own messages (SGLang would fail with a 500)."""
    _refuse_string_stops(sp)
    # Every value is read (and type-checked) before any range is verified, as in SGLang.
    knobs = _knobs(sp)
    min_new_tokens = _integer(sp, "min_new_tokens", 0) or 0
    max_new_tokens = _integer(sp, "max_new_tokens", 128)
    _verify_knobs(knobs)
    _verify_lengths(min_new_tokens, max_new_tokens)
    _verify_logit_bias(sp.get("logit_bias"), vocab_size)
    grammar = _grammar(sp)
    stop_ids = _stop_token_ids(sp)
    ignore_eos = sp.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise Rejected(f"ignore_eos must be a boolean, got {ignore_eos!r}.")
    seed = _integer(sp, "sampling_seed", None)
    interval = _integer(sp, "stream_interval", None)
    if interval is not None and interval < 1:
        raise Rejected(f"stream_interval must be at least 1, got {interval}.")
    return Sampling(
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens,
        stop_token_ids=stop_ids,
        ignore_eos=bool(ignore_eos),
        seed=seed or 0,
        stream_interval=interval or 1,
        grammar=grammar,
    )


def _refuse_string_stops(sp: JSON) -> None:
    """normalize(tokenizer=None): string stops need a tokenizer."""
    for key in ("stop", "stop_regex"):
        value = sp.get(key)
        if value is None:
            continue
        if isinstance(value, str):
            value = [value]
        if value:
            raise Rejected(
                f"{key}={value!r} is unavailable when skip_tokenizer_init=True "
                "(requires tokenizer to decode tokens to text for matching)."
            )


def _knobs(sp: JSON) -> dict[str, float]:
    """The knobs that shape the distribution, in the order SamplingParams takes them."""
    knobs = {"temperature": _number(sp, "temperature", 1.0), "top_p": _number(sp, "top_p", 1.0)}
    top_k = _integer(sp, "top_k", -1)
    knobs["top_k"] = -1 if top_k is None else top_k
    knobs["min_p"] = _number(sp, "min_p", 0.0)
    knobs["frequency_penalty"] = _number(sp, "frequency_penalty", 0.0)
    knobs["presence_penalty"] = _number(sp, "presence_penalty", 0.0)
    knobs["repetition_penalty"] = _number(sp, "repetition_penalty", 1.0)
    # __post_init__: a zero temperature means greedy, i.e. top_k = 1.
    if 0 <= knobs["temperature"] < 1e-6:
        knobs["top_k"] = 1
    return knobs


# verify(vocab_size): each knob's valid values, in the order SGLang checks them.
_KNOB_RANGES: tuple[tuple[str, Callable[[float], bool], str], ...] = (
    ("temperature", lambda v: math.isfinite(v) and v >= 0.0, "a non-negative finite number"),
    ("top_p", lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
    ("min_p", lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
    ("top_k", lambda v: v >= 1 or v == -1, "-1 (disable) or at least 1"),
    ("frequency_penalty", lambda v: -2.0 <= v <= 2.0, "in [-2, 2]"),
    ("presence_penalty", lambda v: -2.0 <= v <= 2.0, "in [-2, 2]"),
    ("repetition_penalty", lambda v: 0.0 < v <= 2.0, "in (0, 2] (1.0 = no penalty)"),
)


def _verify_knobs(knobs: dict[str, float]) -> None:
    for name, valid, rule in _KNOB_RANGES:
        if not valid(knobs[name]):
            raise Rejected(f"{name} must be {rule}, got {knobs[name]}.")


def _verify_lengths(min_new_tokens: int, max_new_tokens: int | None) -> None:
    if min_new_tokens < 0:
        raise Rejected(f"min_new_tokens must be in [0, max_new_tokens], got {min_new_tokens}.")
    if max_new_tokens is None:
        return
    if max_new_tokens < 0:
        raise Rejected(f"max_new_tokens must be at least 0, got {max_new_tokens}.")
    if not min_new_tokens <= max_new_tokens:
        raise Rejected(
            f"min_new_tokens must be in [0, max_new_tokens({max_new_tokens})], "
            f"got {min_new_tokens}."
        )


def _verify_logit_bias(logit_bias: Any, vocab_size: int) -> None:
    if logit_bias is None:
        return
    if not isinstance(logit_bias, dict):
        raise Rejected(f"logit_bias must be an object, got {logit_bias!r}.")
    for token_id in logit_bias:
        try:
            bias_id = int(token_id)
        except ValueError as exc:  # SGLang's int(token_id) fails the same way
            raise Rejected(str(exc)) from exc
        if not 0 <= bias_id < vocab_size:
            raise Rejected(f"logit_bias must has keys in [0, {vocab_size - 1}], got {token_id}.")


def _grammar(sp: JSON) -> str | None:
    """Which kind of guided decoding the request asks for, if any."""
    grammars = [k for k in ("json_schema", "regex", "ebnf") if sp.get(k) is not None]
    if len(grammars) > 1:
        raise Rejected("Only one of regex, json_schema, or ebnf can be set.")
    if sp.get("structural_tag") is not None:
        grammars.append("structural_tag")
    return grammars[0] if grammars else None


def _stop_token_ids(sp: JSON) -> frozenset[int]:
    stop_ids = sp.get("stop_token_ids")
    if stop_ids is not None and not (
        isinstance(stop_ids, list) and all(t is None or is_int(t) for t in stop_ids)
    ):
        raise Rejected(f"stop_token_ids must be a list of integers, got {stop_ids!r}.")
    return frozenset(t for t in stop_ids or [] if t is not None)

"""`sampling_params` as SGLang's tokenizer manager turns them into `SamplingParams`: the
server's preferred sampling params under the request's own, `__post_init__`'s null handling,
`normalize(tokenizer=None)` and `verify()`, with SGLang's messages; then genmesh's canonical
`Sampling` for the envelope, and whether replaying output as prompt would change the run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from genmesh.formats.sglang.errors import value_error
from genmesh.formats.sglang.schema import SamplingParams
from genmesh.shared.engine_info import EngineInfo
from genmesh.shared.envelope import MAX_TOKEN_ID, Sampling, finite_float

DEFAULT_MAX_NEW_TOKENS = 128
# SamplingParams' defaults for a key set to null (also over a preferred default).
_SGLANG_DEFAULTS: dict[str, float | int] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}
_SAMPLING_EPS = 1e-6


@dataclass(slots=True)
class Sampled:
    """One prompt's sampling, as SGLang's SamplingParams would have it."""

    sampling: Sampling
    repetition_penalty: float
    params: SamplingParams


def _effective(
    params: SamplingParams, sent: Mapping[str, Any], defaults: Mapping[str, Any], key: str
) -> Any:
    """SGLang's `{**preferred_sampling_params, **sampling_params}`: what the request sent
    (null included) wins over the server's default; a null over a default is SamplingParams'
    own default."""
    if key in sent:
        value = getattr(params, key)
        if value is None and key in defaults:
            return _SGLANG_DEFAULTS.get(key)
        return value
    return defaults.get(key)


def _number(value: Any) -> float | None:
    return None if value is None else float(value)


def resolve_sampling(
    params: SamplingParams, sent: Mapping[str, Any], info: EngineInfo | None
) -> Sampled:
    """`SamplingParams(**merged)`, `normalize(tokenizer=None)`, `verify()`, with SGLang's
    messages; the result as the envelope's canonical sampling."""
    defaults: Mapping[str, Any] = info.sampling_defaults if info else {}

    def get(key: str) -> Any:
        return _effective(params, sent, defaults, key)

    temperature = _number(get("temperature"))
    top_p = _number(get("top_p"))
    min_p = _number(get("min_p"))
    top_k = get("top_k")
    top_k = None if top_k is None else int(top_k)
    repetition = _number(get("repetition_penalty"))
    frequency = _number(params.frequency_penalty)
    presence = _number(params.presence_penalty)
    max_new: int | None = DEFAULT_MAX_NEW_TOKENS
    if "max_new_tokens" in sent:
        max_new = params.max_new_tokens
    elif "max_new_tokens" in defaults:
        max_new = int(defaults["max_new_tokens"])
    min_new = params.min_new_tokens or 0
    # normalize(None): what needs a tokenizer.
    for key in ("stop", "stop_regex"):
        value = getattr(params, key)
        values = [value] if isinstance(value, str) else value
        if values:
            raise value_error(
                f"{key}={values!r} is unavailable when skip_tokenizer_init=True "
                "(requires tokenizer to decode tokens to text for matching)."
            )
    if params.beam_width is not None and params.beam_width > 1:
        raise value_error(
            "beam search (sampling_params.beam_width) is not supported by this server"
        )
    # __post_init__: a (near) zero temperature is greedy, i.e. top_k = 1.
    if temperature is not None and 0 <= temperature < _SAMPLING_EPS:
        top_k = 1
    _verify(temperature, top_p, min_p, top_k, frequency, presence, repetition, min_new, max_new)
    _verify_logit_bias(params.logit_bias)
    if sum(getattr(params, key) is not None for key in ("json_schema", "regex", "ebnf")) > 1:
        raise value_error("Only one of regex, json_schema, or ebnf can be set.")
    stop_ids = [t for t in params.stop_token_ids or [] if t is not None]
    for tid in stop_ids:
        if not 0 <= tid <= MAX_TOKEN_ID:
            raise value_error(f"stop_token_ids: token id {tid} is out of range")
    ignore_eos = bool(params.ignore_eos)
    sampling = Sampling(
        max_tokens=max_new,
        min_tokens=min_new,
        temperature=temperature,
        top_p=top_p,
        top_k=None if top_k == -1 else top_k,
        min_p=min_p,
        seed=params.sampling_seed,
        # SGLang's Req.check_finished skips stop token ids as well as EOS under
        # ignore_eos; canonical stop_token_ids are honoured by every engine, so say so here.
        stop_token_ids=[] if ignore_eos else stop_ids,
        ignore_eos=ignore_eos,
    )
    return Sampled(sampling, 1.0 if repetition is None else repetition, params)


def _verify(
    temperature: float | None,
    top_p: float | None,
    min_p: float | None,
    top_k: int | None,
    frequency: float | None,
    presence: float | None,
    repetition: float | None,
    min_new: int,
    max_new: int | None,
) -> None:
    """SamplingParams.verify, in its order and words (null: SamplingParams' default)."""
    t = 1.0 if temperature is None else temperature
    if not math.isfinite(t) or t < 0.0:
        raise value_error(f"temperature must be a non-negative finite number, got {t}.")
    p = 1.0 if top_p is None else top_p
    if not 0.0 < p <= 1.0:
        raise value_error(f"top_p must be in (0, 1], got {p}.")
    m = 0.0 if min_p is None else min_p
    if not 0.0 <= m <= 1.0:
        raise value_error(f"min_p must be in [0, 1], got {m}.")
    if top_k is not None and top_k != -1 and top_k < 1:
        raise value_error(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    f = 0.0 if frequency is None else frequency
    if not -2.0 <= f <= 2.0:
        raise value_error(f"frequency_penalty must be in [-2, 2], got {f}.")
    pr = 0.0 if presence is None else presence
    if not -2.0 <= pr <= 2.0:
        raise value_error(f"presence_penalty must be in [-2, 2], got {pr}.")
    r = 1.0 if repetition is None else repetition
    if not 0.0 < r <= 2.0:
        raise value_error(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {r}.")
    if min_new < 0:
        raise value_error(f"min_new_tokens must be in [0, max_new_tokens], got {min_new}.")
    if max_new is not None:
        if max_new < 0:
            raise value_error(f"max_new_tokens must be at least 0, got {max_new}.")
        if min_new > max_new:
            raise value_error(
                f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new}."
            )


def _verify_logit_bias(logit_bias: Mapping[str, float] | None) -> None:
    """The keys are token ids (the vocabulary's bound is the engine's to check)."""
    for key in logit_bias or {}:
        try:
            token = int(key)
        except ValueError as exc:  # SGLang's int(token_id) fails the same way
            raise value_error(str(exc)) from None
        if not 0 <= token <= MAX_TOKEN_ID:
            raise value_error(f"logit_bias must has keys in [0, vocab_size - 1], got {key}.")
    if logit_bias is not None:
        for value in logit_bias.values():
            if finite_float(value) is None:
                raise value_error(f"logit_bias values must be finite numbers, got {value}.")


def migration_refusal(params: SamplingParams, repetition_penalty: float = 1.0) -> str | None:
    """Why replaying the delivered tokens as prompt would change what comes next."""
    for key in ("json_schema", "regex", "ebnf", "structural_tag"):
        if getattr(params, key) is not None:
            return f"guided decoding ({key}) would restart its grammar from the schema root"
    for key in ("presence_penalty", "frequency_penalty"):
        if getattr(params, key):
            return f"{key} counts generated tokens, which a continuation sees as prompt"
    # SGLang's repetition penalizer counts output tokens only, too.
    if repetition_penalty != 1.0:
        return "repetition_penalty counts generated tokens, which a continuation sees as prompt"
    return None

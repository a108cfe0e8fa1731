"""`logit_bias` on the mock's hash-defined model: what a bias added to a token's logit
does to greedy decoding, and to the logprobs each real engine reports.

Both SGLang and vLLM take `sampling_params.logit_bias`, {token id: bias}, and add each bias
to that token's next-token logit before sampling: a large positive bias forces the token,
a large negative one bans it. They differ in the logprobs they report:

- SGLang adds the bias in place to the next-token logits (`ModelRunner._preprocess_logits`
  -> `SamplingBatchInfo.apply_logits_bias`) before its sampler takes the log-softmax, so
  its output logprobs, top lists and `token_ids_logprob` are the *biased* distribution's;
- vLLM computes logprobs from the raw logits, before any logits processor (its sampler's
  step 1, `logprobs_mode` "raw_logprobs" by default), so it reports the *unbiased* ones:
  only the token it picks changes.

Prompt logprobs are never biased (the bias is a sampling step).

The mock's raw logprobs are read as a distribution: adding `b_u` to the logits of the
biased tokens `u` renormalises by `Z = log(1 - sum p_u + sum p_u e^b_u)`, the exact
log-softmax had the rest of the vocabulary the remaining mass. The mock's candidates are
not quite normalised (their probabilities may sum past 1), so `Z` is never taken below the
best biased logit: every logprob stays <= 0. No bias, or zero biases, changes nothing; a
+100 bias gives its token ~0 and the others ~-100; a -100 one gives the rest a little more.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from genmesh.shared.errors import ErrorCode, MeshError
from genmesh.shared.frames import TopLogprobs

# Formats whose engine reports logprobs after the bias (the others: before it).
BIASED_LOGPROB_FORMATS = frozenset({"sglang"})


def _sglang_out_of_vocab(tokens: list[int], vocab_size: int) -> str:
    # SGLang's SamplingParams.verify, for the first key outside the vocabulary.
    return f"logit_bias must has keys in [0, {vocab_size - 1}], got {tokens[0]}."


def _vllm_out_of_vocab(tokens: list[int], vocab_size: int) -> str:
    # vLLM's input processor (_validate_logit_bias).
    return (
        f"token_id(s) {tokens} in logit_bias contain out-of-vocab token ids. "
        f"Vocabulary size: {vocab_size}"
    )


_OUT_OF_VOCAB: Mapping[str, Callable[[list[int], int], str]] = {
    "sglang": _sglang_out_of_vocab,
    "vllm": _vllm_out_of_vocab,
}


def _invalid(message: str) -> MeshError:
    return MeshError(ErrorCode.INVALID_ARGUMENT, message)


def read_logit_bias(
    fmt: str, engine: Mapping[str, Any], vocab_size: int
) -> dict[int, float] | None:
    """The request's `engine.sampling_params.logit_bias` as {token id: bias}, or None.
    The formats have checked its shape; an envelope from another client may not have, so
    anything else is refused here rather than guessed at."""
    sampling = engine.get("sampling_params")
    raw = sampling.get("logit_bias") if isinstance(sampling, Mapping) else None
    if not raw:
        return None
    if not isinstance(raw, Mapping):
        raise _invalid(f"logit_bias must be an object, got {raw!r}.")
    bias: dict[int, float] = {}
    for key, value in raw.items():
        try:
            token = int(key)
            number = float(value)
        except (TypeError, ValueError):
            raise _invalid(f"logit_bias: {key!r}: {value!r} is not token id: number") from None
        if not math.isfinite(number):
            raise _invalid(f"logit_bias values must be finite numbers, got {value}.")
        bias[token] = number
    # In the order sent, as both engines walk the dict.
    outside = [t for t in bias if not 0 <= t < vocab_size]
    if outside:
        message = _OUT_OF_VOCAB.get(fmt, _vllm_out_of_vocab)(outside, vocab_size)
        raise _invalid(message)
    return bias


def _logsumexp(values: list[float]) -> float:
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


@dataclass(frozen=True, slots=True)
class BiasedStep:
    """One decode position under a bias: the candidates (the 20 best raw ones and every
    biased token), best biased logit first, as (token, raw logprob, biased logit), and the
    shift `Z` that turns a biased logit into the logprob SGLang reports."""

    ranked: list[tuple[int, float, float]]
    shift: float

    @classmethod
    def at(
        cls, top: TopLogprobs, extra: Mapping[int, float], bias: Mapping[int, float]
    ) -> BiasedStep:
        """`top`: the raw best candidates, best first; `extra`: the raw logprobs of the
        biased tokens not among them."""
        raw = dict(top)
        for token, logprob in extra.items():
            raw.setdefault(token, logprob)
        # Stable sort: equal biased logits keep the raw order.
        ranked = sorted(
            ((t, lp, lp + bias.get(t, 0.0)) for t, lp in raw.items()),
            key=lambda c: c[2],
            reverse=True,
        )
        # log(1 - sum p_u + sum p_u e^b_u) over the biased tokens u, computed in log space.
        biased = [(raw[t], b) for t, b in bias.items()]
        rest = 1.0 - sum(math.exp(lp) for lp, _ in biased)
        terms = [lp + b for lp, b in biased] + ([math.log(rest)] if rest > 0 else [])
        return cls(ranked, max(_logsumexp(terms), ranked[0][2]))

    def logprob(self, biased_logit: float) -> float:
        return round(biased_logit - self.shift, 6)

    def top(self, k: int) -> TopLogprobs:
        return [(t, self.logprob(b)) for t, _, b in self.ranked[:k]]

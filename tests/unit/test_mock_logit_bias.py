"""The mock honours `sampling_params.logit_bias` (engines/logit_bias.py): the bias moves
the greedy pick, and the logprobs are those each real engine reports: SGLang's after the
bias (it biases the logits before its log-softmax), vLLM's before it (raw logprobs)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from genmesh.engines.base import EngineOutput
from genmesh.engines.mock import MockConfig, MockEngine
from genmesh.shared.envelope import Envelope
from genmesh.shared.errors import ErrorCode, MeshError

pytestmark = pytest.mark.unit

CONFIG = MockConfig(vocab_size=1000, eos_token_id=7)
PROMPT = [11, 12, 13]


def envelope(fmt: str, bias: dict[Any, Any] | None, *, tokens: int = 6, top: int = 5) -> Envelope:
    engine = {"sampling_params": {"logit_bias": bias}} if bias is not None else {}
    env = Envelope(id="r", token_ids=list(PROMPT), format=fmt, engine=engine)
    env.sampling.max_tokens = tokens
    env.sampling.ignore_eos = True
    env.output.logprobs = True
    env.output.top_logprobs = top
    return env


def run(env: Envelope) -> list[EngineOutput]:
    async def collect() -> list[EngineOutput]:
        return [out async for out in MockEngine(CONFIG).generate(env)]

    return [out for out in asyncio.run(collect()) if out.tokens]


def tokens(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.tokens]


def per_token(outs: list[EngineOutput]) -> list[tuple[Any, ...]]:
    """(token, logprob, top logprobs) of each token, however the outputs are cut."""
    return [
        row
        for o in outs
        for row in zip(o.tokens, o.logprobs or [], o.top_logprobs or [], strict=True)
    ]


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_a_large_positive_bias_forces_the_token(fmt: str) -> None:
    free = tokens(run(envelope(fmt, None)))
    target = next(t for t in range(100, 1000) if t not in free)
    assert tokens(run(envelope(fmt, {str(target): 100.0}))) == [target] * 6


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_a_large_negative_bias_bans_the_token(fmt: str) -> None:
    free = tokens(run(envelope(fmt, None, tokens=40)))
    banned = max(set(free), key=free.count)
    assert banned not in tokens(run(envelope(fmt, {banned: -100.0}, tokens=40)))


def test_a_small_bias_changes_the_argmax_only_when_it_closes_the_gap() -> None:
    """At the first step the candidates are fixed (same prompt): a bias just above the
    gap between the best and the second-best raw logprob makes the second the pick; just
    below, the best stays."""
    first = run(envelope("vllm", None, tokens=1))[0]
    assert first.top_logprobs is not None
    (best, best_lp), (second, second_lp) = first.top_logprobs[0][:2]
    gap = best_lp - second_lp
    assert tokens(run(envelope("vllm", {second: gap + 0.01}, tokens=1))) == [second]
    assert tokens(run(envelope("vllm", {second: gap - 0.01}, tokens=1))) == [best]


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
def test_zero_bias_changes_nothing(fmt: str) -> None:
    free = run(envelope(fmt, None))
    zero = run(envelope(fmt, {str(free[0].tokens[0]): 0.0, "3": 0}))
    assert [(o.tokens, o.logprobs, o.top_logprobs) for o in zero] == [
        (o.tokens, o.logprobs, o.top_logprobs) for o in free
    ]


def test_sglang_reports_logprobs_after_the_bias() -> None:
    free = run(envelope("sglang", None, tokens=1))[0]
    target = 999
    forced = run(envelope("sglang", {str(target): 100.0}, tokens=1))[0]
    assert forced.tokens == [target]
    assert forced.logprobs is not None
    assert forced.top_logprobs is not None
    # The forced token holds (nearly) all the mass, so its logprob is ~0 and it heads
    # the top list; every other token falls by the forced one's biased logit, as a
    # log-softmax over the biased logits says.
    assert forced.logprobs[0] == pytest.approx(0.0, abs=1e-3)
    assert forced.top_logprobs[0][0] == (target, forced.logprobs[0])
    raw_target = run(envelope("vllm", {str(target): 100.0}, tokens=1))[0].logprobs
    assert free.top_logprobs is not None
    assert raw_target is not None
    leader, leader_lp = free.top_logprobs[0][0]
    expected = leader_lp - (raw_target[0] + 100.0)
    assert dict(forced.top_logprobs[0])[leader] == pytest.approx(expected, abs=1e-3)
    assert all(lp <= 0.0 for _, lp in forced.top_logprobs[0])


def test_sglang_token_ids_logprob_is_biased_too() -> None:
    env = envelope("sglang", {"999": 100.0}, tokens=1)
    env.output.logprob_token_ids = [999, 5]
    out = run(env)[0]
    assert out.token_ids_logprobs is not None
    listed = dict(out.token_ids_logprobs[0])
    assert listed[999] == pytest.approx(0.0, abs=1e-3)
    assert listed[5] < -50.0


def test_vllm_reports_raw_logprobs_and_ranks() -> None:
    free = run(envelope("vllm", None, tokens=1))[0]
    target = 999
    env = envelope("vllm", {str(target): 100.0}, tokens=1)
    forced = run(env)[0]
    assert forced.tokens == [target]
    # The same position, so the raw top list is the unbiased run's...
    assert forced.top_logprobs == free.top_logprobs
    # ...and the forced token's logprob and rank are its raw ones, below that list.
    assert forced.logprobs is not None
    assert forced.ranks is not None
    assert free.top_logprobs is not None
    assert forced.logprobs[0] < free.top_logprobs[0][-1][1]
    assert forced.ranks[0] > 5


@pytest.mark.parametrize(
    ("fmt", "message"),
    [
        ("sglang", "logit_bias must has keys in [0, 999], got 5000."),
        (
            "vllm",
            "token_id(s) [5000, 1000] in logit_bias contain out-of-vocab token ids. "
            "Vocabulary size: 1000",
        ),
    ],
)
def test_out_of_vocabulary_keys_refused_in_the_engines_words(fmt: str, message: str) -> None:
    """Both engines walk the keys in the order sent: SGLang names the first bad one,
    vLLM lists them all."""
    with pytest.raises(MeshError) as caught:
        run(envelope(fmt, {"5000": 1.0, "1000": 1.0, "3": 1.0}))
    assert caught.value.code is ErrorCode.INVALID_ARGUMENT
    assert caught.value.message == message


@pytest.mark.parametrize("bias", [{"x": 1.0}, {"3": "high"}, {"3": float("inf")}, [1, 2]])
def test_malformed_bias_from_a_raw_envelope_refused(bias: Any) -> None:
    """The formats check the shape; a NATS client's envelope may not have been."""
    with pytest.raises(MeshError) as caught:
        run(envelope("sglang", bias))
    assert caught.value.code is ErrorCode.INVALID_ARGUMENT


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_a_continuation_under_bias_gives_the_rest(fmt: str, k: int) -> None:
    """Migration replays the delivered tokens with the same native body: the biased
    generation goes on exactly as if it had never moved."""
    bias = {"42": 3.0, "7": -100.0, "100": 1.5}
    full = run(envelope(fmt, bias, tokens=6))
    rest_env = envelope(fmt, bias, tokens=6 - k)
    rest_env.token_ids = PROMPT + tokens(full)[:k]
    rest = run(rest_env)
    assert per_token(rest) == per_token(full)[k:]

"""The deterministic mock engine: the behaviour migration and the e2e tests stand on."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from genmesh.client import request
from genmesh.engines.base import EngineOutput
from genmesh.engines.mock import (
    MAX_TOP_LOGPROBS,
    MOCK_CHUNK_TOKENS,
    MockConfig,
    MockEngine,
    decode_step_ms,
    prefill_ms,
)
from genmesh.shared.envelope import Envelope
from genmesh.shared.errors import ErrorCode, MeshError

pytestmark = pytest.mark.unit

TINY = MockConfig(vocab_size=8, eos_token_id=7)


async def collect(engine: MockEngine, env: Envelope) -> list[EngineOutput]:
    return [out async for out in engine.generate(env)]


def run(env: Envelope, config: MockConfig | None = None) -> list[EngineOutput]:
    return asyncio.run(collect(MockEngine(config), env))


def tokens_of(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.tokens]


def logprobs_of(outs: list[EngineOutput]) -> list[float]:
    return [lp for o in outs for lp in (o.logprobs or [])]


def tops_of(outs: list[EngineOutput]) -> list[list[tuple[int, float]]]:
    return [top for o in outs for top in (o.top_logprobs or [])]


def refusal(env: Envelope, config: MockConfig | None = None) -> MeshError:
    with pytest.raises(MeshError) as info:
        run(env, config)
    return info.value


prompts = st.lists(st.integers(min_value=0, max_value=7), min_size=1, max_size=12)
seeds = st.none() | st.integers(min_value=0, max_value=2**64 - 1)


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (MockConfig(vocab_size=1, eos_token_id=0), "vocab_size"),
        (MockConfig(vocab_size=8, eos_token_id=8), "eos_token_id"),
        (MockConfig(vocab_size=8, eos_token_id=-1), "eos_token_id"),
        (MockConfig(speedup=-1.0), "speedup"),
    ],
)
def test_bad_config_refused(config: MockConfig, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MockEngine(config)


def test_describe() -> None:
    card = MockEngine(MockConfig(model="m", vocab_size=100, eos_token_id=5)).describe()
    assert card["model"] == "m"
    assert card["formats"] == ["*"]
    assert card["vocab_size"] == 100
    assert card["eos_token_id"] == 5
    assert card["max_model_len"] == 32_768


def test_default_config_is_instant_qwen_sized() -> None:
    engine = MockEngine()
    assert engine.config.vocab_size == 151_936
    assert engine.config.speedup == 0.0


# ---------------------------------------------------------------- determinism


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.lists(st.integers(min_value=0, max_value=151_935), min_size=1, max_size=10),
    seed=seeds,
    top=st.integers(min_value=0, max_value=5),
)
def test_same_envelope_twice_identical(prompt: list[int], seed: int | None, top: int) -> None:
    env = request(
        prompt,
        max_tokens=12,
        seed=seed,
        logprobs=True,
        top_logprobs=top,
        prompt_logprobs_start=0,
    )
    engine = MockEngine()
    first = asyncio.run(collect(engine, env))
    again = asyncio.run(collect(engine, env))
    elsewhere = asyncio.run(collect(MockEngine(), env))  # another worker
    assert first == again == elsewhere
    assert len(tokens_of(first)) == 12


def test_request_id_does_not_matter() -> None:
    a = request([1, 2, 3], max_tokens=10, seed=4)
    b = request([1, 2, 3], max_tokens=10, seed=4)
    assert a.id != b.id
    assert tokens_of(run(a)) == tokens_of(run(b))


def test_seed_and_prompt_change_the_output() -> None:
    base = tokens_of(run(request([1, 2, 3], max_tokens=10, seed=1)))
    assert tokens_of(run(request([1, 2, 3], max_tokens=10, seed=2))) != base
    assert tokens_of(run(request([1, 2, 4], max_tokens=10, seed=1))) != base
    # seed None behaves as seed 0
    assert tokens_of(run(request([9], max_tokens=10, seed=None))) == tokens_of(
        run(request([9], max_tokens=10, seed=0))
    )


@pytest.mark.parametrize(
    ("speedup", "sizes"),
    [
        # A timed mock: one token per decode step, one output each.
        (1e6, [1] * 40),
        # The instant mock: the first token alone, then MOCK_CHUNK_TOKENS per output.
        (0.0, [1, MOCK_CHUNK_TOKENS, 40 - 1 - MOCK_CHUNK_TOKENS]),
    ],
)
def test_outputs_chunk_only_when_instant_finish_only_on_last(
    speedup: float, sizes: list[int]
) -> None:
    config = MockConfig(speedup=speedup)
    outs = run(request([1, 2, 3], max_tokens=40, logprobs=True, top_logprobs=2), config)
    assert [len(o.tokens) for o in outs] == sizes
    assert [o.finish for o in outs[:-1]] == [None] * (len(sizes) - 1)
    assert outs[-1].finish == {"reason": "length"}
    assert outs[-1].usage == {"prompt_tokens": 3, "completion_tokens": 40, "cached_tokens": 0}
    assert all(o.usage is None for o in outs[:-1])
    assert outs[0].cached_tokens == 0
    for o in outs:
        assert o.logprobs is not None
        assert len(o.logprobs) == len(o.tokens)
        assert o.top_logprobs is not None
        assert len(o.top_logprobs) == len(o.tokens)
    # Chunking changes how the outputs are cut, never what they say.
    slow = run(request([1, 2, 3], max_tokens=40, logprobs=True, top_logprobs=2))
    assert tokens_of(outs) == tokens_of(slow)
    assert logprobs_of(outs) == logprobs_of(slow)
    assert tops_of(outs) == tops_of(slow)


# ---------------------------------------------------------------- continuation


@st.composite
def continuation_cases(draw: st.DrawFn) -> tuple[MockConfig, Envelope, int]:
    # Short contexts, so that a None budget (clamped to the context) stays cheap.
    config = draw(
        st.sampled_from(
            [
                MockConfig(vocab_size=8, eos_token_id=7, max_model_len=48),
                MockConfig(vocab_size=16, eos_token_id=3, max_model_len=48),
                MockConfig(max_model_len=48),
            ]
        )
    )
    vocab = config.vocab_size
    prompt = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=10))
    max_tokens = draw(st.none() | st.integers(min_value=1, max_value=40))
    upper = 40 if max_tokens is None else max_tokens
    env = request(
        prompt,
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(min_value=0, max_value=upper)),
        seed=draw(seeds),
        stop_token_ids=draw(st.lists(st.integers(0, vocab - 1), max_size=3)),
        ignore_eos=draw(st.booleans()),
        logprobs=True,
        top_logprobs=draw(st.integers(min_value=0, max_value=4)),
    )
    return config, env, draw(st.integers(min_value=0, max_value=1000))


@settings(max_examples=150, deadline=None)
@given(continuation_cases())
def test_continuation_from_any_point_gives_the_rest(
    case: tuple[MockConfig, Envelope, int],
) -> None:
    config, env, pick = case
    full = run(env, config)
    tokens = tokens_of(full)
    assert tokens, "budget >= 1 always yields a token"
    k = pick % len(tokens)  # replay the first k generated tokens, k < len(tokens)

    rest_env = request(
        env.token_ids + tokens[:k],
        max_tokens=None if env.sampling.max_tokens is None else env.sampling.max_tokens - k,
        min_tokens=max(0, env.sampling.min_tokens - k),
        seed=env.sampling.seed,
        stop_token_ids=env.sampling.stop_token_ids,
        ignore_eos=env.sampling.ignore_eos,
        logprobs=True,
        top_logprobs=env.output.top_logprobs,
    )
    rest = run(rest_env, config)
    assert tokens_of(rest) == tokens[k:]
    assert logprobs_of(rest) == logprobs_of(full)[k:]
    assert tops_of(rest) == tops_of(full)[k:]
    assert rest[-1].finish == full[-1].finish
    assert rest[-1].usage is not None
    assert rest[-1].usage["completion_tokens"] == len(tokens) - k


@settings(max_examples=60, deadline=None)
@given(prompt=prompts, seed=seeds, top=st.integers(min_value=0, max_value=5))
def test_prompt_logprobs_of_replayed_output_match_output_logprobs(
    prompt: list[int], seed: int | None, top: int
) -> None:
    """What a migrated request reports about replayed tokens is what was first streamed."""
    out = run(
        request(prompt, max_tokens=10, seed=seed, ignore_eos=True, logprobs=True, top_logprobs=top),
        TINY,
    )
    generated = tokens_of(out)
    replay = run(
        request(
            prompt + generated,
            max_tokens=0,
            seed=seed,
            prompt_logprobs_start=len(prompt) - 1,
            top_logprobs=top,
        ),
        TINY,
    )
    assert len(replay) == 1
    plp = replay[0].prompt_logprobs
    assert plp is not None
    assert plp[0] is None
    assert plp[1:] == logprobs_of(out)
    if top:
        ptop = replay[0].prompt_top_logprobs
        assert ptop is not None
        assert ptop[0] is None
        assert ptop[1:] == tops_of(out)


# ---------------------------------------------------------------- stopping


@st.composite
def stop_cases(draw: st.DrawFn) -> Envelope:
    max_tokens = draw(st.integers(min_value=1, max_value=60))
    return request(
        draw(prompts),
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(min_value=0, max_value=max_tokens)),
        seed=draw(seeds),
        # at most 5 of 8 ids (6 with EOS): an allowed token always exists
        stop_token_ids=draw(st.lists(st.integers(0, 7), max_size=5)),
        ignore_eos=draw(st.booleans()),
        logprobs=True,
    )


@settings(max_examples=200, deadline=None)
@given(stop_cases())
def test_stop_eos_and_min_tokens_invariants(env: Envelope) -> None:
    eos = TINY.eos_token_id
    s = env.sampling
    assert s.max_tokens is not None
    stops = set(s.stop_token_ids)
    ending = stops if s.ignore_eos else stops | {eos}
    outs = run(env, TINY)
    tokens = tokens_of(outs)
    finish = outs[-1].finish
    assert finish is not None
    assert 1 <= len(tokens) <= s.max_tokens

    # Nothing that ends a generation appears before the last token...
    assert not ending & set(tokens[:-1])
    # ...nor within the first min_tokens tokens (masked, like real engines).
    assert not ending & set(tokens[: s.min_tokens])

    last = tokens[-1]
    if finish["reason"] == "eos":
        assert not s.ignore_eos
        assert last == eos
        assert finish["matched"] == eos
    elif finish["reason"] == "stop":
        assert last in stops
        assert finish["matched"] == last
    else:
        assert finish == {"reason": "length"}
        assert len(tokens) == s.max_tokens
    if finish["reason"] in ("eos", "stop"):
        assert len(tokens) > s.min_tokens  # never stops before min_tokens
        if not s.ignore_eos and last in stops and last == eos:
            assert finish["reason"] == "eos"


def test_eos_actually_ends_generation_with_tiny_vocab() -> None:
    finishes = [
        run(request([1, 2], max_tokens=200, seed=seed), TINY)[-1].finish for seed in range(20)
    ]
    assert finishes == [{"reason": "eos", "matched": 7}] * 20


def test_ignore_eos_runs_through_eos() -> None:
    outs = run(request([1, 2, 3], max_tokens=100, seed=0, ignore_eos=True), TINY)
    tokens = tokens_of(outs)
    assert len(tokens) == 100
    assert 7 in tokens[:-1]
    assert outs[-1].finish == {"reason": "length"}


def test_ignore_eos_keeps_the_eos_prefix() -> None:
    stopped = tokens_of(run(request([1, 2, 3], max_tokens=100, seed=0), TINY))
    ignored = tokens_of(run(request([1, 2, 3], max_tokens=100, seed=0, ignore_eos=True), TINY))
    assert stopped[-1] == 7
    assert ignored[: len(stopped)] == stopped


def test_stop_token_ids_still_apply_with_ignore_eos() -> None:
    outs = run(
        request([1, 2, 3], max_tokens=100, seed=0, ignore_eos=True, stop_token_ids=[7]), TINY
    )
    assert outs[-1].finish == {"reason": "stop", "matched": 7}
    assert tokens_of(outs)[-1] == 7


def test_stop_token_ends_generation() -> None:
    free = tokens_of(run(request([1, 2, 3], max_tokens=100, seed=1, ignore_eos=True), TINY))
    target = free[2]
    first = free.index(target)
    outs = run(
        request([1, 2, 3], max_tokens=100, seed=1, ignore_eos=True, stop_token_ids=[target]),
        TINY,
    )
    assert tokens_of(outs) == free[: first + 1]
    assert outs[-1].finish == {"reason": "stop", "matched": target}


@settings(max_examples=100, deadline=None)
@given(prompt=prompts, seed=seeds, min_tokens=st.integers(min_value=1, max_value=20))
def test_min_tokens_only_changes_masked_positions(
    prompt: list[int], seed: int | None, min_tokens: int
) -> None:
    free = tokens_of(run(request(prompt, max_tokens=60, seed=seed), TINY))
    held = tokens_of(run(request(prompt, max_tokens=60, seed=seed, min_tokens=min_tokens), TINY))
    stop_at = len(free) - 1  # free ends with EOS (or the budget)
    if free[-1] != 7 or stop_at >= min_tokens:
        assert held == free
    else:
        assert held[:stop_at] == free[:stop_at]
        assert held[stop_at] != 7
        assert len(held) > min_tokens


def test_min_tokens_has_no_effect_when_nothing_is_banned() -> None:
    plain = tokens_of(run(request([1, 2, 3], max_tokens=40, seed=0, ignore_eos=True), TINY))
    held = tokens_of(
        run(request([1, 2, 3], max_tokens=40, seed=0, ignore_eos=True, min_tokens=40), TINY)
    )
    assert held == plain
    assert 7 in held[:20]  # EOS is not masked under ignore_eos


def test_masked_position_takes_the_best_allowed_candidate() -> None:
    vocab = TINY.vocab_size
    stops = [0, 1]
    banned = {*stops, TINY.eos_token_id}
    outs = run(
        request(
            [4, 5],
            max_tokens=30,
            min_tokens=30,
            seed=3,
            stop_token_ids=stops,
            logprobs=True,
            top_logprobs=vocab,
        ),
        TINY,
    )
    assert outs[-1].finish == {"reason": "length"}
    masked = 0
    for token, logprob, top in zip(tokens_of(outs), logprobs_of(outs), tops_of(outs), strict=True):
        ids = [t for t, _ in top]
        assert token not in banned
        position = ids.index(token)
        # everything ranked above the sampled token is banned
        assert all(t in banned for t in ids[:position])
        masked += position > 0
        assert logprob == top[position][1]
    assert masked > 0  # the mask actually did something in this run


# ---------------------------------------------------------------- budgets and limits


def test_max_tokens_zero_is_prefill_only() -> None:
    outs = run(request([1, 2, 3], max_tokens=0, prompt_logprobs_start=1, top_logprobs=2))
    assert len(outs) == 1
    (out,) = outs
    assert out.tokens == []
    assert out.finish == {"reason": "length"}
    assert out.usage == {"prompt_tokens": 3, "completion_tokens": 0, "cached_tokens": 0}
    assert out.prompt_logprobs is not None
    assert len(out.prompt_logprobs) == 2
    assert out.logprobs is None
    assert out.top_logprobs is None


@pytest.mark.parametrize(
    ("prompt_len", "max_tokens", "expected"),
    [(10, None, 30), (10, 1000, 30), (10, 30, 30), (10, 5, 5), (39, None, 1)],
)
def test_budget_clamps_to_the_context_length(
    prompt_len: int, max_tokens: int | None, expected: int
) -> None:
    config = MockConfig(max_model_len=40)
    outs = run(request([1] * prompt_len, max_tokens=max_tokens, ignore_eos=True), config)
    assert len(tokens_of(outs)) == expected
    assert outs[-1].finish == {"reason": "length"}


@pytest.mark.parametrize("prompt_len", [40, 41, 100])
def test_prompt_not_shorter_than_context_refused(prompt_len: int) -> None:
    err = refusal(request([1] * prompt_len, max_tokens=1), MockConfig(max_model_len=40))
    assert err.code is ErrorCode.INVALID_ARGUMENT
    assert not err.retryable
    assert f"The input ({prompt_len} tokens)" in err.message
    assert "context length (40 tokens)" in err.message


def test_out_of_vocabulary_id_refused() -> None:
    err = refusal(request([1, 7, 8, 9], max_tokens=1), TINY)
    assert err.code is ErrorCode.INVALID_ARGUMENT
    assert "token id 8 at position 2" in err.message
    assert "size 8" in err.message
    assert tokens_of(run(request([0, 7], max_tokens=1), TINY))  # 7 = vocab - 1 is fine


@pytest.mark.parametrize(
    "key", ["json_schema", "regex", "ebnf", "structural_tag", "structured_outputs"]
)
def test_guided_decoding_refused(key: str) -> None:
    env = request([1, 2], max_tokens=2)
    env.engine = {"sampling_params": {key: '{"type": "object"}'}}
    err = refusal(env)
    assert err.code is ErrorCode.INVALID_ARGUMENT
    assert f"guided decoding ({key})" in err.message


def test_null_guided_keys_and_other_native_fields_are_fine() -> None:
    env = request([1, 2], max_tokens=2)
    env.engine = {
        "sampling_params": {"json_schema": None, "regex": None, "temperature": 0.5},
        "return_text_in_logprobs": True,
    }
    assert len(tokens_of(run(env))) == 2
    env.engine = {"sampling_params": "not a map"}
    assert len(tokens_of(run(env))) == 2


def test_lora_refused() -> None:
    env = request([1, 2], max_tokens=2)
    env.engine = {"lora_path": "my-adapter"}
    err = refusal(env)
    assert err.code is ErrorCode.INVALID_ARGUMENT
    assert "'my-adapter'" in err.message


def test_too_many_top_logprobs_refused() -> None:
    err = refusal(request([1], max_tokens=1, top_logprobs=MAX_TOP_LOGPROBS + 1))
    assert err.code is ErrorCode.INVALID_ARGUMENT
    assert "at most 20" in err.message
    outs = run(request([1], max_tokens=1, top_logprobs=MAX_TOP_LOGPROBS))
    assert len(tops_of(outs)[0]) == MAX_TOP_LOGPROBS


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"logprobs": 21}, "Requested sample logprobs of 21, which is greater than max "
         "allowed: 20 (parameter=logprobs, value=21)"),
        ({"logprobs": 2, "prompt_logprobs": -1}, "Requested prompt logprobs of 1000, which is "
         "greater than max allowed: 20 (parameter=prompt_logprobs, value=1000)"),
    ],
)  # fmt: skip
def test_too_many_logprobs_in_a_vllm_request_get_vllms_words(
    params: dict[str, Any], message: str
) -> None:
    """A vLLM-format request that reaches the mock (its frontend knew no max_logprobs)
    is refused as vLLM's SamplingParams validation refuses it."""
    env = request([1], max_tokens=1, top_logprobs=21)
    env.format = "vllm"
    env.engine = {"sampling_params": params}
    err = refusal(env, MockConfig(vocab_size=1000, eos_token_id=2))
    assert err.code is ErrorCode.INVALID_ARGUMENT
    assert err.message == message


async def test_refusal_happens_before_any_output() -> None:
    env = request([1, 2], max_tokens=5)
    env.engine = {"lora_path": "x"}
    gen = MockEngine().generate(env)
    with pytest.raises(MeshError):
        await anext(gen)


# ---------------------------------------------------------------- logprobs


def test_no_logprobs_unless_asked() -> None:
    outs = run(request([1, 2, 3], max_tokens=4))
    assert all(o.logprobs is None for o in outs)
    assert all(o.top_logprobs is None for o in outs)
    assert all(o.prompt_logprobs is None and o.prompt_top_logprobs is None for o in outs)


def test_top_logprobs_without_logprobs() -> None:
    outs = run(request([1, 2, 3], max_tokens=4, top_logprobs=3))
    assert all(o.logprobs is None for o in outs)
    assert all(o.top_logprobs is not None and len(o.top_logprobs[0]) == 3 for o in outs)


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.lists(st.integers(min_value=0, max_value=151_935), min_size=1, max_size=8),
    seed=seeds,
)
def test_top_lists_sorted_distinct_and_nested(prompt: list[int], seed: int | None) -> None:
    def gen(k: int) -> list[EngineOutput]:
        return run(request(prompt, max_tokens=8, seed=seed, logprobs=True, top_logprobs=k))

    three, five = gen(3), gen(5)
    assert tokens_of(three) == tokens_of(five)
    assert logprobs_of(three) == logprobs_of(five)
    for token, logprob, top3, top5 in zip(
        tokens_of(five), logprobs_of(five), tops_of(three), tops_of(five), strict=True
    ):
        assert len(top3) == 3
        assert len(top5) == 5
        assert top5[:3] == top3
        ids = [t for t, _ in top5]
        lps = [lp for _, lp in top5]
        assert len(set(ids)) == 5
        assert lps == sorted(lps, reverse=True)
        assert len(set(lps)) == 5  # strictly better first
        assert all(lp < 0 and math.isfinite(lp) for lp in lps)
        # greedy: the sampled token is the best candidate, with the same logprob
        assert (token, logprob) == top5[0]


def test_top_list_is_capped_by_vocab() -> None:
    outs = run(
        request([1], max_tokens=5, top_logprobs=10, ignore_eos=True),
        MockConfig(vocab_size=4, eos_token_id=0),
    )
    for top in tops_of(outs):
        assert sorted(t for t, _ in top) == [0, 1, 2, 3]


@pytest.mark.parametrize(("start", "top"), [(0, 0), (0, 3), (2, 2), (4, 1)])
def test_prompt_logprobs_shape(start: int, top: int) -> None:
    prompt = [10, 11, 12, 13, 14]
    outs = run(request(prompt, max_tokens=3, prompt_logprobs_start=start, top_logprobs=top))
    first = outs[0]
    plp = first.prompt_logprobs
    assert plp is not None
    assert len(plp) == len(prompt) - start
    assert plp[0] is None
    assert all(isinstance(lp, float) and lp < 0 for lp in plp[1:])
    if top:
        ptop = first.prompt_top_logprobs
        assert ptop is not None
        assert len(ptop) == len(plp)
        assert ptop[0] is None
        for lists in ptop[1:]:
            assert lists is not None
            assert len(lists) == top
    else:
        assert first.prompt_top_logprobs is None
    # only the first output carries them
    assert all(o.prompt_logprobs is None for o in outs[1:])


def test_prompt_logprobs_do_not_depend_on_start() -> None:
    prompt = [10, 11, 12, 13, 14, 15]
    full = run(request(prompt, max_tokens=1, prompt_logprobs_start=0))[0].prompt_logprobs
    tail = run(request(prompt, max_tokens=1, prompt_logprobs_start=3))[0].prompt_logprobs
    assert full is not None
    assert tail is not None
    assert tail == [None, *full[4:]]


# ---------------------------------------------------------------- timing


def test_prefill_polynomial() -> None:
    assert prefill_ms(0) == pytest.approx(16.50142)
    assert prefill_ms(1000) == pytest.approx(32.1, abs=0.05)
    assert prefill_ms(1000) == pytest.approx(0.4209989 + 15.18344 + 16.50142)
    assert prefill_ms(8192) == pytest.approx(
        4.209989e-07 * 8192**2 + 1.518344e-02 * 8192 + 16.50142
    )
    assert prefill_ms(2000) > prefill_ms(1000) > prefill_ms(1)


def test_decode_polynomial() -> None:
    assert decode_step_ms(0) == pytest.approx(5.74)
    assert decode_step_ms(1) == pytest.approx(34.0, abs=0.05)
    assert decode_step_ms(0.5) == pytest.approx(-25.74 * 0.25 + 54.01 * 0.5 + 5.74)
    # the KV fraction is capped to [0, 1]
    assert decode_step_ms(-3) == decode_step_ms(0)
    assert decode_step_ms(7) == decode_step_ms(1)


async def test_speedup_one_takes_real_time() -> None:
    engine = MockEngine(MockConfig(speedup=1.0))
    started = time.monotonic()
    outs = await collect(engine, request([1], max_tokens=3))
    elapsed = time.monotonic() - started
    assert len(outs) == 3
    expected_s = (prefill_ms(1) + 2 * decode_step_ms(0)) / 1000
    assert elapsed >= expected_s * 0.9


async def test_kv_accounting_returns_to_zero() -> None:
    engine = MockEngine(MockConfig(speedup=1e6))  # one output per token, to watch each
    seen: list[int] = []
    async for _ in engine.generate(request([1, 2, 3], max_tokens=4)):
        seen.append(engine._active_kv_tokens)
    assert seen == [4, 5, 6, 7]
    assert engine._active_kv_tokens == 0


# ---------------------------------------------------------------- cancellation


async def test_cancelling_the_consumer_stops_generation_promptly() -> None:
    engine = MockEngine(MockConfig(speedup=1.0))
    received: list[EngineOutput] = []
    three = asyncio.Event()

    async def consume() -> None:
        async for out in engine.generate(request([1, 2, 3], max_tokens=10_000)):
            received.append(out)
            if len(received) == 3:
                three.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(three.wait(), timeout=5)
    assert engine._active_kv_tokens > 0
    task.cancel()
    started = time.monotonic()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=1)
    assert time.monotonic() - started < 0.1
    assert task.cancelled()
    count = len(received)
    assert count < 10
    assert received[-1].finish is None
    assert engine._active_kv_tokens == 0  # the finally block ran
    await asyncio.sleep(0.05)
    assert len(received) == count  # nothing more arrives


async def test_cancelling_an_instant_engine_between_tokens() -> None:
    engine = MockEngine()
    received: list[Any] = []

    async def consume() -> None:
        async for out in engine.generate(request([1], max_tokens=1_000_000, ignore_eos=True)):
            received.append(out)

    task = asyncio.create_task(consume())
    for _ in range(20):
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert 0 < len(received) < 1000
    assert engine._active_kv_tokens == 0

"""Continuation envelopes and the Rebaser: the pure parts of migration."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from genmesh.client import request
from genmesh.client.migration import attempt_id, continuation
from genmesh.engines.mock import MockConfig, MockEngine
from genmesh.formats.merge import Merger, Rebaser, Rule
from genmesh.shared.envelope import Envelope

pytestmark = pytest.mark.unit


def base(**kwargs: object) -> Envelope:
    env = request([5, 6, 7], **kwargs)  # type: ignore[arg-type]
    env.id = "req"
    return env


def test_nothing_delivered_is_the_same_request_elsewhere() -> None:
    env = base(max_tokens=10, min_tokens=3, prompt_logprobs_start=1)
    again = continuation(env, [], 2, ["w1"])
    assert again.id == "req~2"
    assert again.token_ids == env.token_ids
    assert again.sampling == env.sampling
    assert again.output.prompt_logprobs_start == 1  # never delivered: ask again
    assert again.routing.exclude == ["w1"]
    assert again.continuation is not None
    assert again.continuation.delivered == 0


def test_delivered_tokens_move_into_the_prompt() -> None:
    env = base(max_tokens=10, min_tokens=4, prompt_logprobs_start=0)
    env.output.routed_experts_start = 1
    env.routing.exclude = ["w0"]
    after = continuation(env, [40, 41, 42], 3, ["w1", "w2"])
    assert after.id == attempt_id("req", 3) == "req~3"
    assert after.token_ids == [5, 6, 7, 40, 41, 42]
    assert after.sampling.max_tokens == 7
    assert after.sampling.min_tokens == 1
    assert after.output.prompt_logprobs_start is None  # the first attempt delivered them
    # Rows from the original start again: the client drops those it already delivered.
    assert after.output.routed_experts_start == 1
    assert after.routing.exclude == ["w0", "w1", "w2"]
    assert after.continuation is not None
    assert (after.continuation.attempt, after.continuation.delivered) == (3, 3)
    assert (after.continuation.prompt_len, after.continuation.max_tokens) == (3, 10)
    # The original is untouched: every attempt starts from it.
    assert env.token_ids == [5, 6, 7]
    assert env.sampling.max_tokens == 10
    assert env.routing.exclude == ["w0"]


def test_budgets_never_go_negative_and_none_stays_none() -> None:
    after = continuation(base(max_tokens=2, min_tokens=1), [1, 2], 2, [])
    assert after.sampling.max_tokens == 0
    assert after.sampling.min_tokens == 0
    assert continuation(base(max_tokens=None), [1], 2, []).sampling.max_tokens is None


def test_continuation_envelopes_are_valid_on_the_wire() -> None:
    after = continuation(base(max_tokens=5), [9, 9], 2, ["w"])
    assert Envelope.from_wire(after.to_wire()) == after


async def _tokens(env: Envelope) -> list[int]:
    engine = MockEngine(MockConfig(vocab_size=500, eos_token_id=3))
    return [t async for out in engine.generate(env) for t in out.tokens]


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 499), min_size=1, max_size=12),
    budget=st.integers(1, 20),
    min_tokens=st.integers(0, 5),
    split=st.integers(0, 20),
)
def test_the_law_on_the_engine_itself(
    prompt: list[int], budget: int, min_tokens: int, split: int
) -> None:
    """Delivered k tokens, then a continuation: together exactly the uninterrupted run."""
    env = request(prompt, max_tokens=budget, min_tokens=min(min_tokens, budget))
    env.id = "x"
    full = asyncio.run(_tokens(env))
    k = min(split, max(len(full) - 1, 0))
    rest = asyncio.run(_tokens(continuation(env, full[:k], 2, [])))
    assert full[:k] + rest == full


# ---------------------------------------------------------------- Rebaser

RULES = {
    "n": Rule.ATTEMPT,
    "p": Rule.PROMPT,
    "meta.n": Rule.ATTEMPT,
    "ids": Rule.DELTA,
}


def test_rebaser_adds_earlier_attempts_and_keeps_the_first_prompt() -> None:
    rebaser = Rebaser(RULES)
    out = [
        rebaser.rebase({"n": 1, "p": 7, "ids": [1]}, 0),
        rebaser.rebase({"n": 2, "p": 7, "ids": [2]}, 0),
        rebaser.rebase({"n": 1, "p": 99, "ids": [3]}, 1),  # the continuation's own counts
        rebaser.rebase({"n": 2, "p": 99, "ids": [4]}, 1),
        rebaser.rebase({"n": 1, "p": 55, "ids": [5]}, 2),
    ]
    assert [r["n"] for r in out] == [1, 2, 3, 4, 5]
    assert [r["p"] for r in out] == [7, 7, 7, 7, 7]
    assert [r["ids"] for r in out] == [[1], [2], [3], [4], [5]]


def test_rebaser_handles_nested_fields_and_leaves_its_input_alone() -> None:
    rebaser = Rebaser(RULES)
    rebaser.rebase({"meta": {"n": 3}}, 0)
    record = {"meta": {"n": 2, "other": "x"}}
    out = rebaser.rebase(record, 1)
    assert out == {"meta": {"n": 5, "other": "x"}}
    assert record == {"meta": {"n": 2, "other": "x"}}


@settings(max_examples=100, deadline=None)
@given(attempt_lengths=st.lists(st.integers(1, 6), min_size=1, max_size=4))
def test_rebased_stream_folds_to_the_merged_body(attempt_lengths: list[int]) -> None:
    """SSE (rebased record by record) and unary (merged by attempt) tell the same story."""
    rebaser, merger, folded = Rebaser(RULES), Merger(RULES), Merger(RULES)
    token = 0
    for attempt, length in enumerate(attempt_lengths):
        for i in range(length):
            token += 1
            record = {"n": i + 1, "p": 100 + attempt, "ids": [token]}
            merger.add(record, attempt)
            folded.add(rebaser.rebase(record, attempt))
    assert folded.result() == merger.result()
    assert merger.result()["n"] == sum(attempt_lengths)
    assert merger.result()["p"] == 100

"""Coalescing engine outputs: exact merges, and merging only what is ready at once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from dataclasses import fields
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from genmesh.engines import coalesce as coalesce_module
from genmesh.engines.base import EngineOutput
from genmesh.engines.coalesce import coalesce, merge, mergeable, split

pytestmark = pytest.mark.unit

PER_TOKEN = ("tokens", "logprobs", "ranks", "top_logprobs", "token_ids_logprobs")


@st.composite
def streams(draw: st.DrawFn) -> list[EngineOutput]:
    """A request's outputs as an engine yields them: prompt facts and cached tokens in
    the first, per-token fields on every output or none, routing rows anywhere, extras
    anywhere, finish and usage on the last."""
    logprobs = draw(st.booleans())
    top = draw(st.booleans())
    listed = draw(st.booleans())
    experts = draw(st.booleans())
    count = draw(st.integers(1, 6))
    outs: list[EngineOutput] = []
    for i in range(count):
        n = draw(st.integers(0 if i == 0 else 1, 3))
        tokens = draw(st.lists(st.integers(0, 1000), min_size=n, max_size=n))
        pairs = st.lists(st.tuples(st.integers(0, 9), st.floats(-9, 0)), max_size=3)
        out = EngineOutput(tokens=tokens)
        if logprobs:
            out.logprobs = draw(st.lists(st.floats(-9, 0), min_size=n, max_size=n))
            out.ranks = draw(st.lists(st.integers(1, 20), min_size=n, max_size=n))
        if top:
            out.top_logprobs = draw(st.lists(pairs, min_size=n, max_size=n))
        if listed:
            out.token_ids_logprobs = draw(st.lists(pairs, min_size=n, max_size=n))
        if experts and draw(st.booleans()):
            out.routed_experts = draw(st.lists(st.lists(st.integers(0, 15), max_size=4)))
        if draw(st.booleans()):
            out.engine = {draw(st.sampled_from("abc")): i}
        if i == 0:
            out.cached_tokens = draw(st.integers(0, 64))
            out.prompt_logprobs = [None, -1.0]
            out.prompt_ranks = [None, 1]
        outs.append(out)
    outs[-1].finish = {"reason": "length"}
    outs[-1].usage = {"prompt_tokens": 2, "completion_tokens": 9, "cached_tokens": 0}
    return outs


def concatenated(outs: list[EngineOutput], name: str) -> list[Any] | None:
    lists = [getattr(o, name) for o in outs if getattr(o, name) is not None]
    return None if not lists else [x for part in lists for x in part]


@given(streams())
@settings(max_examples=300, deadline=None)
def test_merged_is_the_concatenation(outs: list[EngineOutput]) -> None:
    merged = outs[0]
    for out in outs[1:]:
        assert mergeable(merged, out)
        merged = merge(merged, out)
    for name in (*PER_TOKEN, "routed_experts"):
        expected = concatenated(outs, name)
        assert getattr(merged, name) == ([] if name == "tokens" and expected is None else expected)
    for name in ("prompt_logprobs", "prompt_ranks", "cached_tokens"):
        assert getattr(merged, name) == getattr(outs[0], name)  # once, from the first
    assert merged.finish == outs[-1].finish
    assert merged.usage == outs[-1].usage
    newest: dict[str, Any] = {}
    for out in outs:
        newest |= out.engine or {}
    assert (merged.engine or {}) == newest
    # The inputs are untouched: an engine may still hold them.
    assert all(o.tokens is not merged.tokens for o in outs[1:])


@given(streams(), st.data())
@settings(max_examples=200, deadline=None)
def test_split_is_the_inverse_of_merge(outs: list[EngineOutput], data: st.DataObject) -> None:
    merged = outs[0]
    for out in outs[1:]:
        merged = merge(merged, out)
    if len(merged.tokens) < 2:
        return
    k = data.draw(st.integers(1, len(merged.tokens) - 1))
    head, tail = split(merged, k)
    assert len(head.tokens) == k
    assert head.finish is None
    assert merge(head, tail) == merged


def test_what_cannot_merge_exactly_is_refused() -> None:
    with_lp = EngineOutput(tokens=[1], logprobs=[-0.5])
    assert not mergeable(EngineOutput(tokens=[2]), with_lp)  # logprobs of one token only
    assert mergeable(EngineOutput(tokens=[], cached_tokens=3), with_lp)  # nothing to align
    assert not mergeable(
        EngineOutput(tokens=[], cached_tokens=3), EngineOutput([], cached_tokens=4)
    )
    assert not mergeable(EngineOutput(tokens=[1], finish={"reason": "eos"}), with_lp)
    # Every field of EngineOutput is handled by merge (a new field must be thought about).
    assert {f.name for f in fields(EngineOutput)} == {
        *PER_TOKEN,
        "routed_experts",
        "prompt_logprobs",
        "prompt_ranks",
        "prompt_top_logprobs",
        "prompt_token_ids_logprobs",
        "cached_tokens",
        "finish",
        "usage",
        "engine",
        "handoff",  # on the last output only, like finish: `b`'s
    }


async def engine(
    chunks: list[list[int]], *, log: list[str] | None = None, block: float = 0.0
) -> AsyncGenerator[EngineOutput, None]:
    """Yields each chunk's tokens as outputs without suspending, and suspends between
    chunks (for `block` seconds, or forever with a negative one)."""
    try:
        for i, chunk in enumerate(chunks):
            if i:
                if block < 0:
                    await asyncio.Event().wait()
                await asyncio.sleep(block)
            for j, token in enumerate(chunk):
                last = i == len(chunks) - 1 and j == len(chunk) - 1
                yield EngineOutput(tokens=[token], finish={"reason": "length"} if last else None)
    finally:
        if log is not None:
            log.append("closed")


async def collect(outputs: AsyncGenerator[EngineOutput, None]) -> list[list[int]]:
    async with contextlib.aclosing(outputs) as gen, contextlib.aclosing(coalesce(gen)) as merged:
        return [out.tokens async for out in merged]


async def test_outputs_ready_at_once_travel_together() -> None:
    chunks = [[1], [2, 3, 4], [5], [6, 7]]
    assert await collect(engine(chunks)) == chunks
    # An engine that suspends before every output gets one output per frame.
    assert await collect(engine([[1], [2], [3]], block=0.001)) == [[1], [2], [3]]


async def test_nothing_after_the_finish_is_asked_for() -> None:
    pulled: list[int] = []

    async def chatty() -> AsyncGenerator[EngineOutput, None]:
        for i in range(5):
            pulled.append(i)
            yield EngineOutput(tokens=[i], finish={"reason": "eos"} if i == 1 else None)

    assert await collect(chatty()) == [[0, 1]]
    assert pulled == [0, 1]


async def test_a_merged_output_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(coalesce_module, "MAX_MERGED_ENTRIES", 4)
    assert await collect(engine([list(range(10))])) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    monkeypatch.setattr(coalesce_module, "MAX_HOLD_S", 0.0)
    assert await collect(engine([[1, 2, 3]])) == [[1], [2], [3]]


async def test_cancel_while_the_engine_waits_reaches_the_engine() -> None:
    log: list[str] = []
    seen: list[list[int]] = []

    async def consume() -> None:
        gen = engine([[1, 2], [3]], log=log, block=-1)
        async with contextlib.aclosing(gen), contextlib.aclosing(coalesce(gen)) as merged:
            async for out in merged:
                seen.append(out.tokens)

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.01)
    assert seen == [[1, 2]]
    assert log == []
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert log == ["closed"]


async def test_closing_while_a_step_is_half_done_closes_the_engine() -> None:
    """The consumer stops at the frame sent while the engine was about to block."""
    log: list[str] = []
    gen = engine([[1, 2], [3]], log=log, block=-1)
    async with contextlib.aclosing(gen), contextlib.aclosing(coalesce(gen)) as merged:
        async for out in merged:
            assert out.tokens == [1, 2]
            break
    assert log == ["closed"]


async def test_engine_errors_pass_through_after_what_came_before() -> None:
    async def failing() -> AsyncGenerator[EngineOutput, None]:
        yield EngineOutput(tokens=[1])
        await asyncio.sleep(0)
        yield EngineOutput(tokens=[2])
        raise RuntimeError("boom")

    seen: list[list[int]] = []

    async def consume() -> None:
        async with contextlib.aclosing(coalesce(failing())) as merged:
            async for out in merged:
                seen.append(out.tokens)

    with pytest.raises(RuntimeError, match="boom"):
        await consume()
    assert seen == [[1], [2]]  # what was pending when the engine failed still goes

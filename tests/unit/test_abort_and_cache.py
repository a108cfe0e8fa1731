"""Abort orders, and the mock engine's abort and flush (its cache: test_block_pool.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from genmesh.client import request
from genmesh.engines.base import EngineOutput
from genmesh.engines.mock import MockConfig, MockEngine
from genmesh.services.frontend.local import LocalBackend
from genmesh.shared.abort import AbortOrder
from genmesh.shared.envelope import Envelope
from genmesh.shared.errors import MeshError

pytestmark = pytest.mark.unit


def env(client_id: str | None, fmt: str = "sglang") -> Envelope:
    return Envelope(id="x", token_ids=[1], format=fmt, client_id=client_id)


# ------------------------------------------------------------------ abort orders


def test_order_round_trips_and_refuses_what_is_not_one() -> None:
    order = AbortOrder(("a", "b"), "prefix", "sglang")
    assert AbortOrder.from_wire(order.to_wire()) == order
    assert AbortOrder.from_wire({"match": "all"}) == AbortOrder((), "all")
    for bad in (
        [],
        {"ids": ["a"]},
        {"match": "fuzzy", "ids": ["a"]},
        {"match": "exact", "ids": "a"},
        {"match": "exact", "ids": [""]},
        {"match": "exact", "ids": ["a"], "format": 1},
    ):
        with pytest.raises(ValueError, match="abort"):
            AbortOrder.from_wire(bad)


def test_matching_rules() -> None:
    exact = AbortOrder(("r-1",), "exact", "vllm")
    assert exact.hits(env("r-1", "vllm"))
    assert not exact.hits(env("r-12", "vllm"))
    assert not exact.hits(env("r-1", "sglang"))  # another format's ID space
    prefix = AbortOrder(("r-1",), "prefix", "sglang")
    assert prefix.hits(env("r-1"))
    assert prefix.hits(env("r-12"))
    assert not prefix.hits(env("r-2"))
    assert not prefix.hits(env(None))  # nothing to match
    everything = AbortOrder((), "all")
    assert everything.hits(env(None, "vllm"))


# ------------------------------------------------------------------ the mock engine


def mock(**knobs: Any) -> MockEngine:
    return MockEngine(MockConfig(vocab_size=1000, eos_token_id=7, **knobs))


async def test_mock_abort_ends_with_sglangs_abort_finish() -> None:
    engine = mock(speedup=1000.0)
    e = request([1, 2, 3], max_tokens=500, ignore_eos=True)
    e.id = "m-1"
    outs: list[EngineOutput] = []
    async for out in engine.generate(e):
        outs.append(out)
        if len(outs) == 3:
            assert await engine.abort("m-1") is True
    assert outs[-1].finish == {"reason": "abort", "message": "Aborted"}
    assert outs[-1].usage == {"prompt_tokens": 3, "completion_tokens": 3, "cached_tokens": 0}
    assert sum(len(o.tokens) for o in outs) == 3
    assert await engine.abort("m-1") is False  # finished: nothing runs under that id


async def test_mock_cache_reports_cached_tokens_and_flushes_only_when_idle() -> None:
    engine = mock(prefix_cache=True, block_size=4)
    prompt = list(range(100, 110))
    first = [o async for o in engine.generate(request(prompt, max_tokens=2))]
    again = [o async for o in engine.generate(request(prompt, max_tokens=2))]
    assert first[0].cached_tokens == 0
    assert again[0].cached_tokens == 8
    assert again[-1].usage == {"prompt_tokens": 10, "completion_tokens": 2, "cached_tokens": 8}
    running = engine.generate(request(prompt, max_tokens=50))
    await anext(running)
    with pytest.raises(MeshError, match="pending requests"):
        await engine.flush_cache()
    await running.aclose()
    await engine.flush_cache()
    after = [o async for o in engine.generate(request(prompt, max_tokens=2))]
    assert after[0].cached_tokens == 0


async def test_mock_without_a_cache_reports_none() -> None:
    engine = mock()
    prompt = list(range(40))
    for _ in range(2):
        outs = [o async for o in engine.generate(request(prompt, max_tokens=1))]
        assert outs[0].cached_tokens == 0
    await engine.flush_cache()  # nothing to empty, nothing refused


async def test_local_backend_aborts_and_flushes_its_engine() -> None:
    backend = LocalBackend(mock(speedup=1000.0, prefix_cache=True))
    e = request([1, 2, 3], max_tokens=500, ignore_eos=True)
    e.id, e.client_id, e.format = "l-1", "px-1", "sglang"
    frames: list[Any] = []
    running = asyncio.Event()

    async def run() -> None:
        async for frame in backend.generate(e):
            frames.append(frame)
            if len(frames) == 3:
                running.set()

    task = asyncio.create_task(run())
    await asyncio.wait_for(running.wait(), 5)
    assert await backend.abort(AbortOrder(("px-1",), "exact", "sglang")) == ["px-1"]
    await asyncio.wait_for(task, 5)
    assert frames[-1]["finish"] == {"reason": "abort", "message": "Aborted"}
    report = await backend.flush_cache()
    assert (report.ok, report.flushed) == (True, ["local"])

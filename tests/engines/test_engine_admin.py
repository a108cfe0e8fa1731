"""The adapters' abort by ID and cache flush, against genmesh's mock SGLang and vLLM
servers (real HTTP): what a worker asks of its engine for `/abort_request`,
`/abort_requests` and `/flush_cache` (services/worker/admin.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest

from genmesh.client import request
from genmesh.engines.base import EngineOutput
from genmesh.engines.faults import ServerState
from genmesh.engines.http import HttpEngineConfig
from genmesh.engines.sglang import SglangEngine
from genmesh.engines.vllm import ABORT_PROBE_ID, ENGINE_ID_PREFIX, VllmEngine
from genmesh.shared.errors import ErrorCode, MeshError
from genmesh.testkit.common import STATE, serving
from genmesh.testkit.config import MockServerConfig
from genmesh.testkit.sglang import build_app as sglang_app
from genmesh.testkit.vllm import build_app as vllm_app
from genmesh.testkit.vllm import state_of as vllm_state

pytestmark = pytest.mark.inproc

# Slow enough (20 ms a token) that an abort lands mid-stream.
CONFIG = MockServerConfig(vocab_size=1000, eos_token_id=7, token_delay_ms=20)


async def abort_after_two_tokens(engine: Any, state: ServerState) -> list[EngineOutput]:
    env = request([11, 22, 33], max_tokens=500, ignore_eos=True)
    env.id = "env-1"
    outs: list[EngineOutput] = []
    aborted = False
    async for out in engine.generate(env):
        outs.append(out)
        if not aborted and sum(len(o.tokens) for o in outs) >= 2:
            aborted = True
            assert await engine.abort(env.id) is True
    assert await engine.abort(env.id) is False  # over: nothing to abort any more
    return outs


@pytest.fixture
async def sglang() -> AsyncIterator[tuple[SglangEngine, ServerState]]:
    app = sglang_app(CONFIG)
    async with serving(app) as url:
        engine = SglangEngine(HttpEngineConfig(url=url))
        await engine.start()
        assert await engine.healthy()
        yield engine, app[STATE]
        await engine.close()


@pytest.fixture(params=[True, False], ids=["tokens-only", "plain"])
async def vllm(request: pytest.FixtureRequest) -> AsyncIterator[tuple[VllmEngine, ServerState]]:
    config = replace(CONFIG, tokens_only=request.param)
    app = vllm_app(config)
    async with serving(app) as url:
        engine = VllmEngine(HttpEngineConfig(url=url))
        await engine.start()
        assert await engine.healthy()
        yield engine, vllm_state(app)
        await engine.close()


async def test_sglang_abort_ends_with_the_engines_abort_finish(sglang: Any) -> None:
    engine, state = sglang
    outs = await abort_after_two_tokens(engine, state)
    assert outs[-1].finish == {"reason": "abort", "message": "Aborted"}
    assert 2 <= outs[-1].usage["completion_tokens"] < 500
    [call] = state.abort_calls
    assert len(call["ids"]) == 1
    assert call["ids"][0] != "env-1"  # the adapter's own engine rid, never the envelope's


async def test_sglang_flush(sglang: Any) -> None:
    engine, state = sglang
    await engine.flush_cache()
    assert state.flush_calls == 1
    env = request([1, 2], max_tokens=500, ignore_eos=True)
    env.id = "busy"
    outputs = engine.generate(env)
    await anext(outputs)  # running now
    with pytest.raises(MeshError) as refused:
        await engine.flush_cache()
    assert refused.value.code is ErrorCode.UNAVAILABLE
    assert "HTTP 400" in refused.value.message
    assert "Cache flushed." in refused.value.message  # SGLang's text, as it answers
    await outputs.aclose()


async def test_vllm_abort(vllm: Any) -> None:
    engine, state = vllm
    if not engine.describe()["abort_requests"]:
        # Without --tokens-only there is no abort route: the worker cancels instead.
        env = request([11, 22, 33], max_tokens=500, ignore_eos=True)
        env.id = "env-2"
        outputs = engine.generate(env)
        await anext(outputs)
        assert await engine.abort(env.id) is False
        await outputs.aclose()
        return
    outs = await abort_after_two_tokens(engine, state)
    assert outs[-1].finish == {"reason": "abort"}
    # The health check's probe names ABORT_PROBE_ID (an empty list would abort everything
    # on a current vLLM); the abort itself is the other call.
    [call] = [c for c in state.abort_calls if c["ids"] != [ABORT_PROBE_ID]]
    assert call["ids"][0].startswith(ENGINE_ID_PREFIX)


async def test_vllm_flush_resets_the_prefix_cache(vllm: Any) -> None:
    engine, state = vllm
    await engine.flush_cache()
    await engine.flush_cache()
    assert state.flush_calls == 2

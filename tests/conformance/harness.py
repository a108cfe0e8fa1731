"""One engine under test, with the controls the conformance scenarios use.

Each harness runs an engine adapter the way a worker does, against the thing it adapts:
`mock` (in-process, faults injected by FaultyEngine), `sglang` (cumulative and
incremental streaming) and `vllm` (with and without `/abort_requests`) against the
testkit's mock HTTP servers on real sockets. Faults and observations use the same
vocabulary everywhere (`genmesh.engines.faults`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from genmesh.client import request
from genmesh.engines.base import Engine
from genmesh.engines.faults import Fault, FaultyEngine, ServerState
from genmesh.engines.http import HttpEngineConfig
from genmesh.engines.mock import MockConfig, MockEngine
from genmesh.shared.envelope import Envelope
from genmesh.shared.ids import new_request_id
from genmesh.testkit.common import serving
from genmesh.testkit.config import MockServerConfig

VOCAB, EOS = 1000, 7
ENGINES = ("mock", "sglang", "sglang-incremental", "vllm", "vllm-no-abort")


def envelope(prompt: list[int] | None = None, **kwargs: Any) -> Envelope:
    env = request(prompt or [11, 12, 13], **kwargs)
    env.id = new_request_id()
    return env


async def expected(env: Envelope) -> list[int]:
    """What an uninterrupted engine generates for `env` (the mock is the reference)."""
    engine = MockEngine(MockConfig(vocab_size=VOCAB, eos_token_id=EOS))
    return [t async for out in engine.generate(env) for t in out.tokens]


@dataclass
class Harness:
    name: str
    engine: Engine
    _state: ServerState | None = None  # in-process engines
    _url: str | None = None  # HTTP engines' mock server
    _session: aiohttp.ClientSession | None = None

    @property
    def aborts_carry_a_status(self) -> bool:
        """SGLang's abort finish reason carries a status code and message; vLLM's does not."""
        return not self.name.startswith("vllm")

    async def inject(self, kind: str, **fields: Any) -> None:
        if self._state is not None:
            self._state.faults.append(Fault.from_json({"kind": kind, **fields}))
            return
        assert self._session is not None
        async with self._session.post(
            f"{self._url}/testkit/faults", json={"kind": kind, **fields}
        ) as r:
            assert r.status == 200, await r.text()

    async def token_delay(self, ms: float) -> None:
        if self._state is not None:
            self._state.token_delay_s = ms / 1000
            return
        assert self._session is not None
        async with self._session.post(
            f"{self._url}/testkit/config", json={"token_delay_ms": ms}
        ) as r:
            assert r.status == 200

    async def state(self) -> dict[str, Any]:
        """{"received", "completed", "running", "aborted", "disconnected"} of the engine."""
        if self._state is not None:
            return self._state.snapshot()
        assert self._session is not None
        async with self._session.get(f"{self._url}/testkit/state") as r:
            snapshot: dict[str, Any] = await r.json()
            return snapshot


@contextlib.asynccontextmanager
async def harness(name: str) -> AsyncIterator[Harness]:
    if name == "mock":
        faulty = FaultyEngine(MockEngine(MockConfig(vocab_size=VOCAB, eos_token_id=EOS)))
        await faulty.start()
        try:
            yield Harness(name, faulty, _state=faulty.state)
        finally:
            await faulty.close()
        return
    config = MockServerConfig(
        vocab_size=VOCAB,
        eos_token_id=EOS,
        incremental=name == "sglang-incremental",
        tokens_only=name != "vllm-no-abort",
    )
    if name.startswith("sglang"):
        from genmesh.engines.sglang import SglangEngine
        from genmesh.testkit.sglang import build_app

        def make(url: str) -> Engine:
            return SglangEngine(HttpEngineConfig(url, read_timeout_s=10))
    else:
        from genmesh.engines.vllm import VllmEngine
        from genmesh.testkit.vllm import build_app

        def make(url: str) -> Engine:
            return VllmEngine(HttpEngineConfig(url, read_timeout_s=10))

    async with serving(build_app(config)) as url, aiohttp.ClientSession() as session:
        engine = make(url)
        await engine.start()
        try:
            assert await engine.healthy(), f"the mock {name} server is not healthy"
            yield Harness(name, engine, _url=url, _session=session)
        finally:
            await engine.close()

"""Injected engine faults: what the testkit's mock servers do on the wire and
`FaultyEngine` does to an in-process engine, with one vocabulary.

A `Fault` is queued on a `ServerState`, which also records what ran (received, completed,
running, aborted requests): the mock SGLang and vLLM servers (`genmesh.testkit`) consult it
per generate request, and `FaultyEngine` wraps any engine (the `mock` engine, in a worker
started with `--testkit-faults`) with the error each fault means to a worker, so that one
scenario list runs against every engine adapter alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from genmesh.engines.base import Engine, EngineOutput, KvUsage, usage
from genmesh.engines.coalesce import split
from genmesh.engines.http import incomplete, unavailable
from genmesh.shared.envelope import Envelope
from genmesh.shared.errors import ErrorCode, MeshError
from genmesh.shared.kv_events import KvEventBatch

FaultKind = Literal["http_error", "drop", "no_terminal", "done_early", "hang", "abort"]
FAULT_KINDS: tuple[str, ...] = ("http_error", "drop", "no_terminal", "done_early", "hang", "abort")


@dataclass(slots=True)
class Fault:
    kind: FaultKind
    status: int = 500
    after_tokens: int = 0
    count: int = 1
    message: str = "injected fault"

    @classmethod
    def from_json(cls, obj: Any) -> Fault:
        if not isinstance(obj, dict) or obj.get("kind") not in FAULT_KINDS:
            raise ValueError(f"a fault needs 'kind', one of {', '.join(FAULT_KINDS)}")
        fault = cls(kind=obj["kind"])
        for key in ("status", "after_tokens", "count"):
            value = obj.get(key, getattr(fault, key))
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"fault {key} must be an integer")
            setattr(fault, key, value)
        message = obj.get("message", fault.message)
        if not isinstance(message, str):
            raise ValueError("fault message must be a string")
        fault.message = message
        return fault


@dataclass(slots=True)
class Running:
    """One generation in progress: abort() makes its loop finish with an abort reason."""

    rid: str
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    # True while still waiting for a free slot (SGLang's waiting queue).
    waiting: bool = True


@dataclass
class ServerState:
    token_delay_s: float = 0.0
    healthy: bool = True
    received: int = 0
    completed: int = 0
    faults: deque[Fault] = field(default_factory=deque)
    running: dict[str, Running] = field(default_factory=dict)
    aborted: list[str] = field(default_factory=list)
    disconnected: list[str] = field(default_factory=list)
    # Every abort call: {"ids": [...], "at": Unix time of its arrival}.
    abort_calls: list[dict[str, Any]] = field(default_factory=list)
    # Cache flushes asked of the server (SGLang's /flush_cache, vLLM's /reset_prefix_cache).
    flush_calls: int = 0
    # The W3C `traceparent` header of each generate request that carried one.
    traceparents: list[str] = field(default_factory=list)
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    def next_fault(self) -> Fault | None:
        """The fault for the request arriving now, if one is queued."""
        if not self.faults:
            return None
        fault = self.faults[0]
        if fault.count > 0:
            fault.count -= 1
            if fault.count == 0:
                self.faults.popleft()
        return fault

    def start(self, rid: str) -> Running:
        self.received += 1
        running = Running(rid)
        self.running[rid] = running
        return running

    def finish(self, running: Running, *, completed: bool) -> None:
        self.running.pop(running.rid, None)
        if completed:
            self.completed += 1

    def abort_matching(self, predicate: Callable[[str], bool]) -> list[str]:
        hits = [rid for rid in self.running if predicate(rid)]
        for rid in hits:
            self.running[rid].aborted.set()
            self.aborted.append(rid)
        return hits

    def snapshot(self) -> dict[str, Any]:
        return {
            "received": self.received,
            "completed": self.completed,
            "running": sorted(self.running),
            "aborted": list(self.aborted),
            "disconnected": list(self.disconnected),
            "abort_calls": list(self.abort_calls),
            "flush_calls": self.flush_calls,
            "traceparents": list(self.traceparents),
            "faults_pending": [asdict(f) for f in self.faults],
            "token_delay_ms": self.token_delay_s * 1000,
            "healthy": self.healthy,
        }


class FaultyEngine:
    """`inner`, plus the faults queued in `state`; `state` also records what ran."""

    def __init__(self, inner: Engine, state: ServerState | None = None) -> None:
        self.inner = inner
        self.state = state or ServerState()
        self.name = inner.name

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    async def healthy(self) -> bool:
        return self.state.healthy and await self.inner.healthy()

    def describe(self) -> dict[str, Any]:
        return self.inner.describe()

    async def abort(self, request_id: str) -> bool:
        return await self.inner.abort(request_id)

    async def flush_cache(self) -> None:
        await self.inner.flush_cache()

    def kv_usage(self) -> KvUsage | None:
        return self.inner.kv_usage()

    def kv_events(self) -> AsyncIterator[KvEventBatch] | None:
        return self.inner.kv_events()

    async def generate(self, envelope: Envelope) -> AsyncGenerator[EngineOutput, None]:
        fault = self.state.next_fault()
        running = self.state.start(envelope.id)
        ended = completed = False
        try:
            if fault is not None and fault.kind == "http_error":
                ended = True
                if 400 <= fault.status < 500:
                    raise MeshError(ErrorCode.INVALID_ARGUMENT, fault.message)
                raise unavailable(f"engine answered HTTP {fault.status}: {fault.message}")
            delivered = 0
            # Closed with this generator, so the inner engine stops at once too.
            outputs = self._per_token(self.inner.generate(envelope), fault)
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    if fault is not None and delivered >= fault.after_tokens:
                        if fault.kind == "abort" and not fault.status and delivered:
                            # A plain abort on decode: the engine stopped the request.
                            out.tokens, out.finish = [], {"reason": "abort", "message": "Aborted"}
                            out.usage = usage(len(envelope.token_ids), delivered)
                        else:
                            ended = fault.kind != "hang"
                            await self._fail(fault.kind, fault.status, fault.message)
                    if self.state.token_delay_s:
                        await asyncio.sleep(self.state.token_delay_s)
                    delivered += len(out.tokens)
                    if out.finish is not None:
                        ended = True
                        completed = out.finish.get("reason") != "abort"
                    yield out
                    if out.finish is not None:
                        return
        finally:
            if not ended:  # cancelled: for an in-process engine, that is the abort
                self.state.aborted.append(envelope.id)
            self.state.finish(running, completed=completed)

    async def _per_token(
        self, outputs: AsyncGenerator[EngineOutput, None], fault: Fault | None
    ) -> AsyncGenerator[EngineOutput, None]:
        """The inner engine's outputs, one token each while a fault or a token delay is
        set: both count tokens, and the instant mock sends many per output."""
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                if fault is None and not self.state.token_delay_s:
                    yield out
                    continue
                while len(out.tokens) > 1:
                    head, out = split(out, 1)
                    yield head
                yield out

    @staticmethod
    async def _fail(kind: str, status: int, message: str) -> None:
        if kind == "hang":
            await asyncio.Event().wait()  # until cancelled
        if kind in ("no_terminal", "done_early"):
            raise incomplete("the engine stream ended before a terminal response")
        if kind == "drop":
            raise unavailable("the engine connection dropped", reason="connection_lost")
        if 400 <= status < 500:  # abort with a status
            raise MeshError(ErrorCode.INVALID_ARGUMENT, message)
        if status >= 500:  # the engine failed: retryable, as the SGLang adapter says
            raise unavailable(f"engine ended the request (abort): {message}", status_code=status)
        raise MeshError(ErrorCode.INTERNAL, f"engine ended the request (abort): {message}")

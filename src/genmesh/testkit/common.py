"""What the mock engine servers share: generation state, injected faults, admin routes.

The mock SGLang and vLLM servers stand in for GPU engines in tests. Tests steer them
through a small admin API on the same port (all under `/testkit/`):

- `POST /testkit/faults` `{"kind", "status"?, "after_tokens"?, "count"?, "message"?}` queues
  a fault for the next `count` generate requests (`count: -1` = every request until
  cleared); `DELETE /testkit/faults` clears the queue. Kinds:
  - `http_error`: answer with HTTP `status` and the engine's native error body;
  - `drop`: after `after_tokens` tokens, drop the TCP connection mid-stream;
  - `no_terminal`: after `after_tokens` tokens, end the response without a terminal chunk
    (and without `[DONE]`);
  - `done_early`: after `after_tokens` tokens, send `data: [DONE]` without a terminal chunk;
  - `hang`: after `after_tokens` tokens, send nothing more until the client goes away or
    the request is aborted;
  - `abort`: after `after_tokens` tokens, finish with the engine's abort finish reason
    carrying `status` (0 = none) and `message`.
- `POST /testkit/config` `{"token_delay_ms"?, "healthy"?}` changes the per-token delay, or
  makes `/health` fail (a down engine).
- `GET /testkit/state`: `{"received", "completed", "running": [ids], "aborted": [ids],
  "disconnected": [ids], "abort_calls", "faults_pending"}`: what a test asserts on.
  `abort_calls` lists every abort call (SGLang `/abort_request`, vLLM `/abort_requests`) as
  `{"ids": [...] ("*" for SGLang's abort_all), "at": <Unix time it arrived>}`.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from aiohttp import web

FaultKind = Literal["http_error", "drop", "no_terminal", "done_early", "hang", "abort"]
FAULT_KINDS: tuple[str, ...] = ("http_error", "drop", "no_terminal", "done_early", "hang", "abort")


@dataclass(frozen=True, slots=True)
class MockServerConfig:
    """Settings of a mock engine server (`genmesh testkit sglang|vllm --help`)."""

    model: str = "genmesh-mock"
    vocab_size: int = 151_936
    eos_token_id: int = 151_645
    max_model_len: int = 32_768
    token_delay_ms: float = 0.0
    # SGLang: --incremental-streaming-output (deltas) instead of cumulative chunks.
    incremental: bool = False
    # vLLM: --tokens-only, which also registers POST /abort_requests.
    tokens_only: bool = True


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
            "traceparents": list(self.traceparents),
            "faults_pending": [asdict(f) for f in self.faults],
            "token_delay_ms": self.token_delay_s * 1000,
            "healthy": self.healthy,
        }


STATE = web.AppKey("testkit_state", ServerState)


def add_admin_routes(app: web.Application, state: ServerState) -> None:
    app[STATE] = state
    app.router.add_post("/testkit/faults", _add_fault)
    app.router.add_delete("/testkit/faults", _clear_faults)
    app.router.add_post("/testkit/config", _config)
    app.router.add_get("/testkit/state", _state)


async def _add_fault(request: web.Request) -> web.Response:
    try:
        fault = Fault.from_json(await request.json())
    except ValueError as exc:
        return web.json_response({"error": str(exc)}, status=400)
    request.app[STATE].faults.append(fault)
    return web.json_response(asdict(fault))


async def _clear_faults(request: web.Request) -> web.Response:
    request.app[STATE].faults.clear()
    return web.Response()


async def _config(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        body = await request.json()
    except ValueError:
        return web.json_response({"error": "send a JSON object"}, status=400)
    if not isinstance(body, dict):
        return web.json_response({"error": "send a JSON object"}, status=400)
    if "token_delay_ms" in body:
        state.token_delay_s = float(body["token_delay_ms"]) / 1000
    if "healthy" in body:
        state.healthy = bool(body["healthy"])
    return web.json_response(state.snapshot())


async def _state(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE].snapshot())

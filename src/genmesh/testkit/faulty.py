"""An engine wrapper that injects the testkit's faults in-process.

The mock HTTP servers inject faults on the wire (`genmesh.testkit.common`); this does the
same to an in-process engine (the `mock` engine), with the error each fault means to a
worker, so that one scenario list runs against every engine adapter alike.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from genmesh.services.worker.engines.base import Engine, EngineOutput
from genmesh.services.worker.engines.http import incomplete, unavailable
from genmesh.shared.envelope import Envelope
from genmesh.shared.errors import ErrorCode, MeshError
from genmesh.testkit.common import Fault, ServerState


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
            async for out in self.inner.generate(envelope):
                if fault is not None and delivered >= fault.after_tokens:
                    if fault.kind == "abort" and not fault.status and delivered:
                        # A plain abort on decode: the engine stopped the request.
                        out.tokens, out.finish = [], {"reason": "abort", "message": "Aborted"}
                        out.usage = _usage(len(envelope.token_ids), delivered)
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


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "cached_tokens": 0,
    }


def control_subject(namespace: str, worker_id: str) -> str:
    """Where a test steers the faults of a worker started with --testkit-faults."""
    return f"genmesh.{namespace}.testkit.{worker_id}"


async def serve_fault_control(
    nc: Client, namespace: str, worker_id: str, engine: FaultyEngine
) -> Subscription:
    """Answer `<control>` requests: a JSON Fault queues it, `{"clear": true}` drops the
    queued faults, `{}` reads the state.

    Test-only: a worker exposes this only when started with --testkit-faults.
    """

    async def on_request(msg: Msg) -> None:
        try:
            body = json.loads(msg.data or b"{}")
            if isinstance(body, dict) and body.get("clear") is True:
                engine.state.faults.clear()
            elif body:
                engine.state.faults.append(Fault.from_json(body))
            answer: dict[str, Any] = engine.state.snapshot()
        except ValueError as exc:
            answer = {"error": str(exc)}
        if msg.reply:
            await nc.publish(msg.reply, json.dumps(answer).encode())

    return await nc.subscribe(control_subject(namespace, worker_id), cb=on_request)

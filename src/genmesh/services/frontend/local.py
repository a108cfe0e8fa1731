"""A frontend backend with the engine in-process: the frontend without the mesh.

It produces exactly the frames a worker would (`genmesh.engines.execute`), so the
same handler serves them. The benchmark uses it as the direct-engine baseline; it also
suits embedding one engine in one process.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from genmesh.engines.base import Engine
from genmesh.engines.execute import execute
from genmesh.services.frontend.fanout import FlushReport
from genmesh.shared import frames
from genmesh.shared.abort import AbortOrder
from genmesh.shared.engine_info import EngineCatalog, EngineInfo
from genmesh.shared.envelope import Envelope
from genmesh.shared.errors import MeshError
from genmesh.shared.ids import new_request_id


class LocalBackend:
    def __init__(self, engine: Engine, worker_id: str = "local") -> None:
        self.engine = engine
        self.worker_id = worker_id
        # What runs now, by private id: what an abort by client ID looks through.
        self._running: dict[str, Envelope] = {}

    async def generate(
        self, envelope: Envelope, *, no_migration: str | None = None
    ) -> AsyncGenerator[frames.Frame, None]:
        seq = 0
        yield frames.ack(envelope.id, self.worker_id, new_request_id())
        self._running[envelope.id] = envelope
        try:
            async for frame in execute(envelope, self.engine.generate(envelope)):
                seq += 1
                frame["seq"] = seq
                yield frame
        finally:
            self._running.pop(envelope.id, None)

    async def abort(self, order: AbortOrder) -> list[str]:
        """The engine ends what the order names (an engine that cannot leaves it be)."""
        hits = [env for env in self._running.values() if order.hits(env)]
        for env in hits:
            await self.engine.abort(env.id)
        return [env.client_id for env in hits if env.client_id]

    async def flush_cache(self) -> FlushReport:
        report = FlushReport([self.worker_id])
        try:
            await self.engine.flush_cache()
            report.flushed.append(self.worker_id)
        except MeshError as exc:
            report.failed[self.worker_id] = exc.message
        return report

    def not_ready_reason(self) -> str | None:
        return None

    async def ready(self, limit_s: float | None) -> str | None:
        return None

    def workers(self) -> list[dict[str, Any]]:
        return [{**self.engine.describe(), "id": self.worker_id, "engine": self.engine.name}]

    def engines(self) -> EngineCatalog:
        info = EngineInfo.from_wire(self.engine.describe().get("engine_info"))
        return EngineCatalog([info] if info else [])

    async def close(self) -> None:
        await self.engine.close()

"""What the frontend's handlers share: a backend to dispatch to, and a few facts.

`MeshBackend` dispatches over NATS (the normal case); `LocalBackend`
(`genmesh.services.frontend.local`) runs an engine in-process, the same frontend with no
mesh behind it, which is what the benchmark's direct-engine baseline is.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, Protocol

from nats.aio.client import Client

from genmesh.client import ClientFrame, MeshClient
from genmesh.services.frontend.fanout import FlushReport, broadcast_abort, flush_all
from genmesh.services.frontend.observers import Observer
from genmesh.shared.abort import AbortOrder
from genmesh.shared.bus import drain_or_close
from genmesh.shared.discovery import WorkerDirectory
from genmesh.shared.engine_info import EngineCatalog, EngineInfo
from genmesh.shared.envelope import Envelope
from genmesh.shared.subjects import Subjects


class Backend(Protocol):
    def generate(
        self, envelope: Envelope, *, no_migration: str | None = None
    ) -> AsyncGenerator[ClientFrame, None]:
        """Reply frames of one request, ending with exactly one `end` or `err` frame;
        `mig` frames mark a move to another worker (`no_migration`: why it must not)."""
        ...

    def not_ready_reason(self) -> str | None:
        """Why requests cannot be served right now, or None when they can."""
        ...

    async def ready(self, limit_s: float | None) -> str | None:
        """`not_ready_reason()` for a request about to be dispatched, which first waits
        (at most `limit_s`) for a connection to the mesh that is being re-established."""
        ...

    def workers(self) -> list[dict[str, Any]]:
        """The cards of the workers that can serve requests."""
        ...

    def engines(self) -> EngineCatalog:
        """What those workers' engines advertise (`engine_info`), by model."""
        ...

    async def abort(self, order: AbortOrder) -> list[str]:
        """Abort the admitted requests `order` names, wherever they run; the client IDs
        of those aborted (as far as the workers answered in time)."""
        ...

    async def flush_cache(self) -> FlushReport:
        """Flush every worker's engine cache."""
        ...

    async def close(self) -> None: ...


@dataclass(slots=True)
class MeshBackend:
    nc: Client
    client: MeshClient
    directory: WorkerDirectory
    namespace: str
    # How long admin fan-outs (abort, flush) wait for the workers' answers.
    admin_timeout_s: float = 5.0
    # The catalog of the last engines() call and the infos it was built from: every
    # request asks, and the infos change only when a worker joins, leaves or restarts.
    _catalog: tuple[tuple[EngineInfo, ...], EngineCatalog] = ((), EngineCatalog())

    def generate(
        self, envelope: Envelope, *, no_migration: str | None = None
    ) -> AsyncGenerator[ClientFrame, None]:
        return self.client.generate(envelope, no_migration=no_migration)

    def not_ready_reason(self) -> str | None:
        if not self.nc.is_connected:
            return "genmesh is not ready: not connected to NATS"
        # A client that routes itself needs no router.
        if self.client.router is None and not self.directory.routers:
            return f"genmesh is not ready: no router is running in namespace {self.namespace!r}"
        if not self.directory.workers:
            return f"genmesh is not ready: no worker is registered in namespace {self.namespace!r}"
        return None

    async def ready(self, limit_s: float | None) -> str | None:
        # A request that arrives while NATS reconnects is held for the client's reconnect
        # hold and sent once the connection is back, rather than refused: a node's death
        # costs the clients of the frontend on it nothing (docs/limits.md).
        if not self.nc.is_connected and self.client.reconnect_hold_s > 0:
            why = await self.client.hold_until_connected(limit_s)
            if why is not None:
                return f"genmesh is not ready: {why}"
        return self.not_ready_reason()

    def workers(self) -> list[dict[str, Any]]:
        return [w.card for w in self.directory.live()]

    def engines(self) -> EngineCatalog:
        infos = tuple(w.engine_info for w in self.directory.workers.values() if w.engine_info)
        if infos != self._catalog[0]:  # identical objects compare at once
            self._catalog = (infos, EngineCatalog(infos))
        return self._catalog[1]

    def _worker_ids(self) -> set[str]:
        return set(self.directory.workers)

    async def abort(self, order: AbortOrder) -> list[str]:
        subject = Subjects(self.namespace).abort
        expected = self._worker_ids()
        aborted = await broadcast_abort(self.nc, subject, order, expected, self.admin_timeout_s)
        return aborted or []

    async def flush_cache(self) -> FlushReport:
        subject = Subjects(self.namespace).flush_cache
        return await flush_all(self.nc, subject, self._worker_ids(), self.admin_timeout_s)

    async def close(self) -> None:
        await self.directory.close()
        await self.client.close()
        await drain_or_close(self.nc)


@dataclass(slots=True)
class FrontendState:
    backend: Backend
    namespace: str
    default_model: str
    started: float
    # Every request's deadline unless it asks for a shorter one; None = no limit.
    request_timeout_s: float | None = None
    # Metrics, traces, request records: each sees every request (see observe.py).
    observers: list[Observer] = field(default_factory=list)

    def models(self) -> list[str]:
        found = sorted(
            {m for card in self.backend.workers() if isinstance(m := card.get("model"), str)}
        )
        return found or [self.default_model]

    def engine_info(self, model: str | None = None) -> EngineInfo:
        """The advertised facts of `model` (default: the first), or just its name."""
        return self.backend.engines().get(model) or EngineInfo(model or self.models()[0])

"""What the frontend's handlers share: the NATS connection, the client, the worker set."""

from __future__ import annotations

from dataclasses import dataclass

from nats.aio.client import Client

from genmesh.client import MeshClient
from genmesh.shared.discovery import WorkerDirectory


@dataclass(slots=True)
class FrontendState:
    nc: Client
    client: MeshClient
    directory: WorkerDirectory
    namespace: str
    default_model: str
    started: float

    def not_ready_reason(self) -> str | None:
        """Why requests cannot be served right now, or None when they can."""
        if not self.nc.is_connected:
            return "genmesh is not ready: not connected to NATS"
        if not self.directory.workers:
            return f"genmesh is not ready: no worker is registered in namespace {self.namespace!r}"
        return None

    def models(self) -> list[str]:
        found = sorted({w.model for w in self.directory.live() if w.model})
        return found or [self.default_model]

"""The options every process that joins a mesh takes: which NATS, which namespace, how
much to log. Declared once here; each role's config holds it as its `mesh` group."""

from __future__ import annotations

from dataclasses import dataclass

from genmesh.shared.settings import option

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True, slots=True)
class MeshConnection:
    nats_url: str = option(
        DEFAULT_NATS_URL, help="NATS server URL; several, comma-separated, for a cluster"
    )
    namespace: str = option("default", help="mesh namespace (a subject token)")
    log_level: str = option("info", choices=LOG_LEVELS, help="log level")

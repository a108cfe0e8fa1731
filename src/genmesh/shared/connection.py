"""The options every process that joins a mesh takes: which NATS, which namespace, how
much to log (`MeshConnection`, each role's `mesh` group), and where a router or worker
serves its metrics (`MetricsConfig`). Declared once here, in a module that imports no
NATS or HTTP library, so that a command's --help stays quick."""

from __future__ import annotations

from dataclasses import dataclass

from genmesh.shared.settings import option, subject_token

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
LOG_LEVELS = ("debug", "info", "warning", "error")
EVENT_LOOPS = ("uvloop", "asyncio")


@dataclass(frozen=True, slots=True)
class MeshConnection:
    nats_url: str = option(
        DEFAULT_NATS_URL, help="NATS server URL; several, comma-separated, for a cluster"
    )
    namespace: str = option(
        "default",
        parse=subject_token,
        help="mesh namespace (a subject token: NATS subjects hold it)",
    )
    log_level: str = option("info", choices=LOG_LEVELS, help="log level")
    # asyncio's own loop stays one option away: for debugging, or a platform without uvloop.
    event_loop: str = option(
        "uvloop", choices=EVENT_LOOPS, help="event loop (shared/loop.py); uvloop is faster"
    )


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    """Where a router or worker serves its metrics (`--metrics-port`, `--metrics-host`)."""

    port: int = option(
        0,
        flag="--metrics-port",
        help="HTTP port serving Prometheus metrics on /metrics; 0 = off",
    )
    host: str = option("127.0.0.1", flag="--metrics-host", help="metrics listen address")

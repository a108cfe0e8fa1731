"""Prometheus exposition shared by every service (docs/observability.md, "Metrics").

Each service keeps its own `CollectorRegistry` (never the process-global default), so
several services in one process, as in tests, never collide. The frontend serves its
registry on `GET /metrics` of its own HTTP port; routers and workers serve theirs on a
small HTTP server of their own when started with `--metrics-port` (0 = off).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.process_collector import ProcessCollector

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"


def new_registry() -> CollectorRegistry:
    """A service's own registry, with the standard `process_*` metrics (CPU, memory, fds)."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    return registry


def metrics_response(registry: CollectorRegistry) -> web.Response:
    """The registry in the Prometheus text format (a few hundred lines at most: rendered
    inline, it takes well under a millisecond)."""
    return web.Response(
        body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


def metrics_handler(registry: CollectorRegistry) -> Handler:
    async def handle(request: web.Request) -> web.Response:
        return metrics_response(registry)

    return handle


@dataclass(slots=True)
class MetricsServer:
    """A started metrics endpoint: `http://<host>:<port>/metrics`."""

    runner: web.AppRunner
    port: int

    async def close(self) -> None:
        await self.runner.cleanup()


async def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    """Serve `registry` on `GET /metrics` at host:port (port 0 would pick a free port; the
    services call this only for a port other than 0, which means "off")."""
    app = web.Application()
    app.router.add_get(METRICS_PATH, metrics_handler(registry))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = runner.addresses[0][1]
    log.info("metrics on http://%s:%d%s", host, bound, METRICS_PATH)
    return MetricsServer(runner, bound)


@contextlib.asynccontextmanager
async def serving_metrics(
    host: str, port: int, registry: Callable[[], CollectorRegistry]
) -> AsyncIterator[MetricsServer | None]:
    """A router's or worker's metrics endpoint for the duration of the block; nothing when
    `port` is 0 (the default: off)."""
    if not port:
        yield None
        return
    server = await serve_metrics(registry(), host, port)
    try:
        yield server
    finally:
        await server.close()

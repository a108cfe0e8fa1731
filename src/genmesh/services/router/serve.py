"""Run a router: for a block (`running_router`), or until a stop signal (`serve_router`)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from genmesh.services.router.config import RouterConfig
from genmesh.services.router.metrics import router_registry
from genmesh.services.router.service import Router
from genmesh.shared import tracing
from genmesh.shared.bus import connect, drain_or_close
from genmesh.shared.lifecycle import stop_signals, tune_gc
from genmesh.shared.metrics import serving_metrics
from genmesh.shared.subjects import Subjects

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def running_router(config: RouterConfig) -> AsyncIterator[Router]:
    """A router, connected and started for the block (with its metrics endpoint)."""
    # Closed in reverse: the router stops (leaves discovery, unsubscribes), then the
    # metrics endpoint, then the connection drains.
    async with contextlib.AsyncExitStack() as stack:
        nc = await connect(
            config.mesh.nats_url,
            name=f"genmesh-router-{config.router_id}",
            inbox_prefix="_INBOX_router",
            auth=config.auth,
        )
        stack.push_async_callback(drain_or_close, nc)
        router = Router(
            nc,
            Subjects(config.mesh.namespace),
            policy=config.policy,
            kv=config.kv,
            router_id=config.router_id,
            admission=config.admission,
            pd=config.pd,
        )
        await stack.enter_async_context(
            serving_metrics(config.metrics, lambda: router_registry(router))
        )
        yield await stack.enter_async_context(router)


async def serve_router(config: RouterConfig) -> None:
    # The stop signals stay caught until the connection has drained.
    async with (
        tracing.running("router", config.router_id),
        stop_signals() as stop,
        running_router(config),
    ):
        tune_gc()
        await stop.wait()
        log.info("router %s stopping", config.router_id)

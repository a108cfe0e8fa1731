"""Run a router until a stop signal."""

from __future__ import annotations

import contextlib
import logging

from genmesh.services.router.config import RouterConfig
from genmesh.services.router.metrics import router_registry
from genmesh.services.router.service import Router
from genmesh.shared import tracing
from genmesh.shared.bus import connect, drain_or_close
from genmesh.shared.lifecycle import stop_signals
from genmesh.shared.metrics import serving_metrics
from genmesh.shared.subjects import Subjects

log = logging.getLogger(__name__)


async def serve_router(config: RouterConfig) -> None:
    router_id = config.router_id
    # Closed in reverse: the router stops (leaves discovery, unsubscribes), then the
    # metrics endpoint, then the connection drains while a second signal is still caught.
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(tracing.running("router", router_id))
        stop = await stack.enter_async_context(stop_signals())
        nc = await connect(
            config.mesh.nats_url,
            name=f"genmesh-router-{router_id}",
            inbox_prefix="_INBOX_router",
            auth=config.auth,
        )
        stack.push_async_callback(drain_or_close, nc)
        router = Router(
            nc, Subjects(config.mesh.namespace), policy=config.policy, router_id=router_id
        )
        await stack.enter_async_context(
            serving_metrics(config.metrics, lambda: router_registry(router))
        )
        stack.push_async_callback(router.stop)
        await router.start()
        await stop.wait()
        log.info("router %s stopping", router_id)

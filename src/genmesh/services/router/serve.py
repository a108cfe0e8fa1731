"""Run a router until a stop signal."""

from __future__ import annotations

import logging

from genmesh.services.router.metrics import router_registry
from genmesh.services.router.service import Router
from genmesh.shared import tracing
from genmesh.shared.bus import NO_AUTH, NatsAuth, connect, drain_or_close
from genmesh.shared.ids import new_router_id
from genmesh.shared.lifecycle import stop_signals
from genmesh.shared.metrics import serving_metrics
from genmesh.shared.subjects import Subjects

log = logging.getLogger(__name__)


async def serve_router(
    nats_url: str,
    namespace: str,
    policy: str,
    *,
    metrics_host: str = "127.0.0.1",
    metrics_port: int = 0,
    auth: NatsAuth = NO_AUTH,
) -> None:
    router_id = new_router_id()
    nc = await connect(
        nats_url, name=f"genmesh-router-{router_id}", inbox_prefix="_INBOX_router", auth=auth
    )
    router = Router(nc, Subjects(namespace), policy=policy, router_id=router_id)
    async with (
        tracing.running("router", router_id),
        stop_signals() as stop,
        serving_metrics(metrics_host, metrics_port, lambda: router_registry(router)),
    ):
        try:
            await router.start()
            await stop.wait()
            log.info("router %s stopping", router_id)
        finally:
            await router.stop()
            await drain_or_close(nc)

"""Run a worker in front of its engine until a stop signal."""

from __future__ import annotations

import logging

from genmesh.engines.base import Engine
from genmesh.engines.faults import FaultyEngine
from genmesh.services.worker.faults import serve_fault_control
from genmesh.services.worker.metrics import worker_registry
from genmesh.services.worker.service import Worker, WorkerConfig
from genmesh.shared import tracing
from genmesh.shared.bus import NO_AUTH, NatsAuth, connect, drain_or_close
from genmesh.shared.lifecycle import stop_signals
from genmesh.shared.metrics import serving_metrics
from genmesh.shared.subjects import Subjects

log = logging.getLogger(__name__)


async def serve_worker(
    nats_url: str,
    namespace: str,
    engine: Engine,
    worker: WorkerConfig,
    *,
    testkit_faults: bool = False,
    metrics_host: str = "127.0.0.1",
    metrics_port: int = 0,
    auth: NatsAuth = NO_AUTH,
) -> None:
    nc = await connect(
        nats_url,
        name=f"genmesh-worker-{worker.worker_id}",
        inbox_prefix="_INBOX_worker",
        auth=auth,
    )
    if testkit_faults:
        engine = FaultyEngine(engine)
        await serve_fault_control(nc, namespace, worker.worker_id, engine)
    service = Worker(nc, Subjects(namespace), engine, worker)
    async with (
        tracing.running("worker", worker.worker_id),
        stop_signals() as stop,
        serving_metrics(metrics_host, metrics_port, lambda: worker_registry(service)),
    ):
        try:
            await service.start()
            await stop.wait()
            log.info("worker %s stopping", worker.worker_id)
        finally:
            await service.stop()
            await drain_or_close(nc)

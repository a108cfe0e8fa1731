"""Run a worker in front of its engine: for a block (`running_worker`), or until a stop
signal (`serve_worker`)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from genmesh.engines.base import Engine
from genmesh.engines.faults import FaultyEngine
from genmesh.services.worker.config import WorkerProcessConfig
from genmesh.services.worker.faults import serve_fault_control
from genmesh.services.worker.metrics import worker_registry
from genmesh.services.worker.service import Worker
from genmesh.shared import tracing
from genmesh.shared.bus import connect, drain_or_close
from genmesh.shared.cards import ROLE_DECODE
from genmesh.shared.lifecycle import stop_signals, tune_gc
from genmesh.shared.metrics import serving_metrics
from genmesh.shared.subjects import Subjects

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def running_worker(config: WorkerProcessConfig, engine: Engine) -> AsyncIterator[Worker]:
    """A worker in front of `engine`, connected and started for the block (with its
    metrics endpoint, and fault control with `testkit_faults`)."""
    worker_id = config.service.worker_id
    namespace = config.mesh.namespace
    # Closed in reverse: the worker stops (drains, leaves discovery, closes its engine),
    # then the metrics endpoint, then the connection drains.
    async with contextlib.AsyncExitStack() as stack:
        nc = await connect(
            config.mesh.nats_url,
            name=f"genmesh-worker-{worker_id}",
            # A decode worker reads its prefill stages' frames under a prefix of its own
            # NATS user's (`decode`: deploy/nats/permissions.conf).
            inbox_prefix="_INBOX_decode" if config.service.role == ROLE_DECODE else "_INBOX_worker",
            auth=config.auth,
        )
        stack.push_async_callback(drain_or_close, nc)
        if config.testkit_faults:
            engine = FaultyEngine(engine)
            await serve_fault_control(nc, namespace, worker_id, engine)
        service = Worker(nc, Subjects(namespace), engine, config.service)
        await stack.enter_async_context(
            serving_metrics(config.metrics, lambda: worker_registry(service))
        )
        yield await stack.enter_async_context(service)


async def serve_worker(config: WorkerProcessConfig, engine: Engine) -> None:
    worker_id = config.service.worker_id
    # The stop signals stay caught until the connection has drained.
    async with (
        tracing.running("worker", worker_id),
        stop_signals() as stop,
        running_worker(config, engine),
    ):
        tune_gc()
        await stop.wait()
        log.info("worker %s stopping", worker_id)

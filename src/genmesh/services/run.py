"""Run one service in the foreground until SIGINT/SIGTERM, then stop it cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web

from genmesh.client import MeshClient
from genmesh.formats.catalog import load_generate_formats
from genmesh.records.observer import RecordsConfig, RequestRecords
from genmesh.services.frontend.app import build_app
from genmesh.services.frontend.metrics import FrontendMetrics
from genmesh.services.frontend.state import FrontendState, MeshBackend
from genmesh.services.frontend.traces import TraceObserver
from genmesh.services.router.metrics import router_registry
from genmesh.services.router.service import Router
from genmesh.services.worker.engines.base import Engine
from genmesh.services.worker.metrics import worker_registry
from genmesh.services.worker.service import Worker, WorkerConfig
from genmesh.shared import tracing
from genmesh.shared.bus import NO_AUTH, NatsAuth, connect, drain_or_close
from genmesh.shared.discovery import WorkerDirectory
from genmesh.shared.ids import new_router_id
from genmesh.shared.metrics import serving_metrics
from genmesh.shared.subjects import Subjects

log = logging.getLogger(__name__)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.asynccontextmanager
async def stop_signals() -> AsyncIterator[asyncio.Event]:
    """An event set by SIGINT, SIGTERM or SIGHUP (a closed terminal). Enter it before
    announcing readiness, so that a supervisor's early SIGTERM still means a clean stop,
    not the default instant death."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    try:
        yield stop
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)


@dataclass(frozen=True, slots=True)
class FrontendOptions:
    nats_url: str
    namespace: str
    host: str
    port: int
    generate_format: str
    codec: str
    model: str
    body_limit_mb: float
    ack_timeout_s: float
    idle_timeout_s: float
    migration_limit: int = 3
    ping_after_s: float = 0.5
    request_timeout_s: float | None = None
    records: RecordsConfig | None = None  # request trace records; None = off
    auth: NatsAuth = NO_AUTH  # NATS credentials and TLS


@dataclass(slots=True)
class RunningFrontend:
    """A started frontend: its HTTP runner and what it holds open."""

    state: FrontendState
    runner: web.AppRunner
    port: int
    records: RequestRecords | None = None

    async def close(self) -> None:
        await self.runner.cleanup()
        if self.records is not None:  # every handler has finished: all records are out
            await self.records.close()
        await self.state.backend.close()


async def start_frontend(opts: FrontendOptions) -> RunningFrontend:
    """Connect, discover, and listen (port 0 picks a free port)."""
    formats = load_generate_formats(opts.generate_format)
    subjects = Subjects(opts.namespace)
    nc = await connect(
        opts.nats_url, name="genmesh-frontend", inbox_prefix="_INBOX_frontend", auth=opts.auth
    )
    directory = WorkerDirectory(nc, subjects)
    client = MeshClient(
        nc,
        opts.namespace,
        codec=opts.codec,
        ack_timeout_s=opts.ack_timeout_s,
        idle_timeout_s=opts.idle_timeout_s,
        migration_limit=opts.migration_limit,
        ping_after_s=opts.ping_after_s,
        directory=directory,  # a worker that leaves discovery is a migration trigger
    )
    try:
        await client.start()
        await directory.start()
    except BaseException:
        await directory.close()
        await nc.close()
        raise
    state = FrontendState(
        backend=MeshBackend(nc, client, directory, opts.namespace),
        namespace=opts.namespace,
        default_model=opts.model,
        started=time.time(),
        request_timeout_s=opts.request_timeout_s,
    )
    metrics = FrontendMetrics()  # served on GET /metrics of the frontend's own port
    state.observers.append(metrics)
    tracer = tracing.tracer()
    if tracer is not None:  # off, traces cost nothing: not even an observer
        state.observers.append(TraceObserver(tracer))
    app = build_app(
        state,
        formats,
        body_limit_bytes=int(opts.body_limit_mb * 1024 * 1024),
        metrics=metrics.registry,
    )
    # handler_cancellation: a client that disconnects cancels its handler, which cancels
    # the request in the mesh. Without it aiohttp lets the handler run to the end.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    running = RunningFrontend(state, runner, opts.port)
    try:
        if opts.records is not None and opts.records.enabled:
            records = RequestRecords.from_config(
                opts.records, nc=nc, subject=subjects.trace, namespace=opts.namespace
            )
            await records.start()
            running.records = records
            state.observers.append(records)
        site = web.TCPSite(runner, opts.host, opts.port)
        await site.start()
    except BaseException:
        await running.close()
        raise
    running.port = runner.addresses[0][1]
    routes = ", ".join(f"{r.method} {r.path}" for f in formats for r in f.routes)
    log.info("frontend listening on http://%s:%d (%s)", opts.host, running.port, routes)
    return running


async def serve_frontend(opts: FrontendOptions) -> None:
    async with tracing.running("frontend"), stop_signals() as stop:
        running = await start_frontend(opts)
        try:
            await stop.wait()
            log.info("frontend stopping")
        finally:
            await running.close()


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
        from genmesh.testkit.faulty import FaultyEngine, serve_fault_control

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


def configure_logging(level: str, label: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s {label} %(levelname)s %(name)s: %(message)s",
    )

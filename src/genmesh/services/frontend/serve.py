"""Run the HTTP frontend: connect to NATS, discover, listen; stop cleanly on a signal."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from aiohttp import web

from genmesh.client import MeshClient
from genmesh.formats.catalog import load_generate_formats
from genmesh.services.frontend.app import build_app
from genmesh.services.frontend.metrics import FrontendMetrics
from genmesh.services.frontend.records import RecordsConfig, RequestRecords
from genmesh.services.frontend.state import FrontendState, MeshBackend
from genmesh.services.frontend.traces import TraceObserver
from genmesh.shared import tracing
from genmesh.shared.bus import NO_AUTH, NatsAuth, connect
from genmesh.shared.discovery import WorkerDirectory
from genmesh.shared.lifecycle import stop_signals
from genmesh.shared.subjects import Subjects

log = logging.getLogger(__name__)


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

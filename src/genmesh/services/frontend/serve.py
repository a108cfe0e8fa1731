"""Run the HTTP frontend: connect to NATS, discover, listen; for a block
(`running_frontend`), or until a stop signal (`serve_frontend`)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from genmesh.client import MeshClient
from genmesh.formats.catalog import load_generate_formats
from genmesh.routing.admission import Admission
from genmesh.routing.choice import Chooser
from genmesh.routing.kv_feed import KvCollector, kv_subscriber
from genmesh.routing.metrics import AdmissionCollector, PdCollector
from genmesh.routing.policies import make_policy
from genmesh.services.frontend.app import build_app
from genmesh.services.frontend.config import FrontendConfig
from genmesh.services.frontend.connections import BoundedTCPSite, refusal
from genmesh.services.frontend.generate import dumps
from genmesh.services.frontend.metrics import PREFIX, FrontendMetrics
from genmesh.services.frontend.micro import frontend_micro
from genmesh.services.frontend.records import RequestRecords
from genmesh.services.frontend.state import FrontendState, MeshBackend
from genmesh.services.frontend.traces import TraceObserver
from genmesh.shared import tracing
from genmesh.shared.bus import connect
from genmesh.shared.discovery import WorkerDirectory
from genmesh.shared.lifecycle import stop_signals, tune_gc
from genmesh.shared.subjects import Subjects

log = logging.getLogger(__name__)


class MalformedRequestLog(logging.Filter):
    """aiohttp logs a request it cannot parse as an ERROR with a traceback, though it
    answered 400 and nothing failed: a port scanner, or the HTTP/2 preface of
    sglang-router's gRPC probe, which it sends each time it registers a worker. Such a
    record becomes one INFO line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            reason = str(exc.message).splitlines()[0] if exc.message else type(exc).__name__
            record.msg = f"{record.getMessage()}: malformed HTTP ({reason}); answered 400"
            record.args = ()
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def quiet_malformed_requests() -> None:
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, MalformedRequestLog) for f in server_log.filters):
        server_log.addFilter(MalformedRequestLog())


@dataclass(slots=True)
class RunningFrontend:
    """A started frontend: its HTTP runner and what it holds open, closed in the reverse
    order of opening (the HTTP server first, so every handler has finished before the
    records and the NATS connection close)."""

    state: FrontendState
    runner: web.AppRunner
    port: int
    records: RequestRecords | None
    _resources: contextlib.AsyncExitStack

    async def close(self) -> None:
        await self._resources.aclose()


async def start_frontend(config: FrontendConfig) -> RunningFrontend:
    """Connect, discover, and listen (port 0 picks a free port)."""
    formats = load_generate_formats(config.generate_format)
    quiet_malformed_requests()
    namespace = config.mesh.namespace
    subjects = Subjects(namespace)
    async with contextlib.AsyncExitStack() as resources:
        nc = await connect(
            config.mesh.nats_url,
            name="genmesh-frontend",
            inbox_prefix="_INBOX_frontend",
            auth=config.auth,
        )
        directory = WorkerDirectory(nc, subjects)
        router = None
        if config.routing == "frontend":
            chooser = Chooser(
                directory,
                make_policy(config.router_policy, config.kv),
                config.admission,
                config.pd,
            )
            router = Admission(chooser, config.admission, "the frontend")
        client = MeshClient(
            nc,
            namespace,
            codec=config.codec,
            ack_timeout_s=config.ack_timeout_s,
            idle_timeout_s=config.idle_timeout_s,
            migration_limit=config.migration_limit,
            ping_after_s=config.ping_after_s,
            reconnect_hold_s=config.reconnect_hold_s,
            directory=directory,  # a worker that leaves discovery is a migration trigger
            router=router,
            attempt_spans=False,  # the request's server span stands for its attempts
        )
        backend = MeshBackend(
            nc, client, directory, namespace, admin_timeout_s=config.admin_timeout_s
        )
        # Closes the directory, the client and the connection, in that order.
        resources.push_async_callback(backend.close)
        await client.start()
        await directory.start()
        kv = None if router is None else kv_subscriber(router.policy, nc, subjects, directory)
        if kv is not None:
            await kv.start()
            resources.push_async_callback(kv.close)  # before the connection closes
        state = FrontendState(
            backend=backend,
            namespace=namespace,
            default_model=config.model,
            started=time.time(),
            request_timeout_s=config.request_timeout_s or None,
        )
        metrics = FrontendMetrics()  # served on GET /metrics of the frontend's own port
        if kv is not None:
            metrics.registry.register(KvCollector(kv))
        if router is not None:
            metrics.registry.register(AdmissionCollector(router, PREFIX))
            metrics.registry.register(PdCollector(router.chooser))
        state.observers.append(metrics)
        tracer = tracing.tracer()
        if tracer is not None:  # off, traces cost nothing: not even an observer
            state.observers.append(TraceObserver(tracer))
        records = None
        if config.records.enabled:
            records = RequestRecords.from_config(
                config.records, nc=nc, subject=subjects.trace, namespace=namespace
            )
            await records.start()
            resources.push_async_callback(records.close)  # after every handler: all out
            state.observers.append(records)
        app = build_app(
            state,
            formats,
            body_limit_bytes=int(config.body_limit_mb * 1024 * 1024),
            body_timeout_s=config.http_body_timeout_s,
            metrics=metrics.registry,
            api_key=config.api_key,
            admin_api_key=config.admin_api_key,
        )
        # handler_cancellation: a client that disconnects cancels its handler, which cancels
        # the request in the mesh. Without it aiohttp lets the handler run to the end.
        # keepalive_timeout: aiohttp closes a connection that has not sent a request's
        # whole headers this long after it opened or its last answer (a slow loris too).
        runner = web.AppRunner(
            app,
            handler_cancellation=True,
            access_log=None,
            keepalive_timeout=config.http_idle_timeout_s,
        )
        await runner.setup()
        resources.push_async_callback(runner.cleanup)
        if router is not None:
            # Before the HTTP server stops: what waits for a worker is refused (retryable),
            # not cut off with its connection.
            resources.callback(router.close)
        too_many = formats[0].error_body(
            503, f"too many connections: this frontend keeps at most {config.max_connections}"
        )
        site = BoundedTCPSite(
            runner,
            config.host,
            config.port,
            limit=config.max_connections,
            answer=refusal(dumps(too_many).encode()),
            reuse_port=config.reuse_port,
        )
        await site.start()
        port = runner.addresses[0][1]
        url = f"http://{config.host}:{port}"
        micro = frontend_micro(nc, namespace, url, metrics)
        await micro.start()
        resources.push_async_callback(micro.stop)  # first: the frontend is going
        routes = ", ".join(f"{r.method} {r.path}" for f in formats for r in f.routes)
        log.info("frontend listening on %s (%s)", url, routes)
        if router is not None:
            log.info("frontend routes requests itself (policy %s)", router.policy.name)
        return RunningFrontend(state, runner, port, records, resources.pop_all())


@contextlib.asynccontextmanager
async def running_frontend(config: FrontendConfig) -> AsyncIterator[RunningFrontend]:
    """A frontend, started for the block."""
    running = await start_frontend(config)
    try:
        yield running
    finally:
        await running.close()


async def serve_frontend(config: FrontendConfig) -> None:
    async with (
        tracing.running("frontend"),
        stop_signals() as stop,
        running_frontend(config),
    ):
        tune_gc()
        await stop.wait()
        log.info("frontend stopping")

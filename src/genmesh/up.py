"""`genmesh up`: a whole mesh on one machine, each service its own OS process."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

import aiohttp

from genmesh.cli import command_argv
from genmesh.services.frontend.config import FrontendConfig
from genmesh.services.router.config import RouterConfig
from genmesh.services.worker.config import WorkerProcessConfig
from genmesh.shared.bus import (
    NO_AUTH,
    NatsAuth,
    NatsAuthError,
    NatsUnreachable,
    connect,
    nats_auth_group,
    redact,
)
from genmesh.shared.connection import MeshConnection
from genmesh.shared.ids import new_router_id, new_worker_id
from genmesh.shared.lifecycle import STOP_SIGNALS
from genmesh.shared.metrics import MetricsConfig
from genmesh.shared.natsserver import NatsServer, NatsServerError
from genmesh.shared.settings import group, option, positive_int, variables

READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class UpConfig:
    """`genmesh up`: the options of the services it starts, re-used from their own
    declarations, and its own: how many of each, engine URLs, the first metrics port."""

    mesh: MeshConnection = group(MeshConnection(nats_url=""))  # "": start an embedded one
    auth: NatsAuth = nats_auth_group()
    frontend: FrontendConfig = group(FrontendConfig(), only=("host", "port"))
    workers: int = option(2, help="number of worker processes")
    routers: int = option(1, parse=positive_int, help="number of router processes")
    router: RouterConfig = group(RouterConfig(), only=("policy",))
    worker: WorkerProcessConfig = group(
        WorkerProcessConfig(),
        only=("engine", "service.max_concurrency", "service.drain_timeout_s", "mock"),
    )
    engine_urls: tuple[str, ...] = option(
        (),
        flag="--engine-url",
        repeat=True,
        help="HTTP address of an SGLang/vLLM server; repeat for several, one worker each",
    )
    metrics_port: int = option(
        0,
        flag="--metrics-port",
        help="first Prometheus metrics port: routers, then workers, get one each from it; 0 = off",
    )
    metrics: MetricsConfig = group(MetricsConfig(), only=("host",))


@dataclass
class Child:
    role: str
    label: str
    process: asyncio.subprocess.Process

    @property
    def running(self) -> bool:
        return self.process.returncode is None


def _say(message: str) -> None:
    print(f"genmesh up: {message}", file=sys.stderr, flush=True)


async def _spawn(role: str, label: str, config: Any, env: dict[str, str]) -> Child:
    # A session of its own: a terminal's Ctrl-C (SIGINT to the whole foreground process
    # group) reaches only `genmesh up`, which stops the services in order, NATS last.
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "genmesh", *command_argv(config),
        stdin=asyncio.subprocess.DEVNULL, env=env, start_new_session=True,
    )  # fmt: skip
    return Child(role, label, process)


async def _probe_nats(url: str, auth: NatsAuth) -> None:
    nc = await connect(url, name="genmesh-up-probe", auth=auth)
    await nc.close()


async def _wait_ready(url: str, children: list[Child]) -> str | None:
    """None once the frontend's /health is 200; else why not (after READY_TIMEOUT_S)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    reason = "the frontend never answered"
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if any(c.role == "frontend" and not c.running for c in children):
                return "the frontend exited"
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with session.get(f"{url}/health") as resp:
                    if resp.status == 200:
                        return None
                    reason = await resp.text()
            await asyncio.sleep(0.1)
    return reason


async def _stop(children: list[Child], drain_timeout_s: float) -> None:
    # The frontend first, so no new request enters while the rest goes down.
    for role in ("frontend", "router", "worker"):
        group = [c for c in children if c.role == role and c.running]
        for child in group:
            with contextlib.suppress(ProcessLookupError):
                child.process.send_signal(signal.SIGTERM)
        for child in group:
            # Workers may drain first: give them that long, and a little more.
            allowed = STOP_TIMEOUT_S + (drain_timeout_s if role == "worker" else 0)
            try:
                await asyncio.wait_for(child.process.wait(), allowed)
            except TimeoutError:
                _say(f"{child.label} did not stop in {allowed:g}s; killing it")
                with contextlib.suppress(ProcessLookupError):
                    child.process.kill()
                await child.process.wait()


async def _watch(children: list[Child], stop: asyncio.Event) -> bool:
    """Report children that exit on their own until `stop`; True if the frontend died
    (without a frontend the mesh is over)."""
    waiters: dict[asyncio.Future[Any], Child] = {
        asyncio.ensure_future(c.process.wait()): c for c in children
    }
    stopped: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
    try:
        while True:
            done, _ = await asyncio.wait({*waiters, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if stopped in done:
                return False
            for fut in done:
                child = waiters.pop(fut)
                _say(f"{child.label} (pid {child.process.pid}) exited with code {fut.result()}")
                if child.role == "frontend":
                    return True
    finally:
        stopped.cancel()
        for fut in waiters:
            fut.cancel()


def _worker_configs(config: UpConfig, nats_url: str) -> list[WorkerProcessConfig]:
    """One config per worker: --workers mocks, or one worker per engine URL."""
    urls = config.engine_urls
    engine = config.worker.engine
    if engine == "mock":
        if urls:
            raise ValueError("--engine-url needs --engine sglang or --engine vllm")
        plans: list[str | None] = [None] * config.workers
    elif not urls:
        raise ValueError(f"--engine {engine} needs --engine-url (repeat it for several)")
    else:
        plans = list(urls)
    return [
        replace(
            config.worker,
            mesh=replace(config.mesh, nats_url=nats_url),
            service=replace(config.worker.service, worker_id=new_worker_id()),
            engine_url=url,
        )
        for url in plans
    ]


def child_environment(config: UpConfig) -> dict[str, str]:
    """Ours, less every variable `genmesh up` read itself (what it resolved travels on the
    children's command lines: an inherited GENMESH_METRICS_PORT or GENMESH_PORT must not
    reach them), plus the credentials, which travel only in the environment."""
    own = set(variables(UpConfig))
    return {k: v for k, v in os.environ.items() if k not in own} | config.auth.to_env()


async def _up(config: UpConfig) -> int:
    server: NatsServer | None = None
    auth = config.auth
    child_env = child_environment(config)
    if config.mesh.nats_url:
        url = config.mesh.nats_url
        try:
            await _probe_nats(url, auth)
        except (NatsUnreachable, NatsAuthError) as exc:
            _say(str(exc))
            return 2
    else:
        server = NatsServer()
        try:
            url = await asyncio.to_thread(server.start)
        except NatsServerError as exc:
            _say(str(exc))
            return 2
    try:
        workers = _worker_configs(config, url)
    except ValueError as exc:
        _say(str(exc))
        if server is not None:
            await asyncio.to_thread(server.stop)
        return 2
    mesh = replace(config.mesh, nats_url=url)
    metrics_ports = itertools.count(config.metrics_port)

    def metrics() -> MetricsConfig:
        # Explicit on every child, so that no two of them collide.
        port = next(metrics_ports) if config.metrics_port else 0
        return replace(config.metrics, port=port)

    children: list[Child] = []
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    try:
        for _ in range(config.routers):
            router = replace(
                config.router,
                mesh=mesh,
                auth=NO_AUTH,
                router_id=new_router_id(),
                metrics=metrics(),
            )
            children.append(await _spawn("router", f"router {router.router_id}", router, child_env))
        for worker in workers:
            worker = replace(worker, auth=NO_AUTH, metrics=metrics())
            label = f"worker {worker.service.worker_id}"
            children.append(await _spawn("worker", label, worker, child_env))
        frontend = replace(config.frontend, mesh=mesh, auth=NO_AUTH)
        children.append(await _spawn("frontend", "frontend", frontend, child_env))
        http_url = f"http://{frontend.host}:{frontend.port}"
        ready = asyncio.ensure_future(_wait_ready(http_url, children))
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if stop.is_set():
            ready.cancel()
            return 0
        not_ready = ready.result()
        if not_ready:
            _say(f"the mesh did not become ready in {READY_TIMEOUT_S:g}s ({not_ready}); stopping")
            return 1
        _print_summary(url, server, children, http_url, config)
        return 1 if await _watch(children, stop) else 0
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
        _say("stopping")
        await _stop(children, config.worker.service.drain_timeout_s)
        if server is not None:
            await asyncio.to_thread(server.stop)
        _say("stopped")


def _print_summary(
    nats_url: str,
    server: NatsServer | None,
    children: list[Child],
    http_url: str,
    config: UpConfig,
) -> None:
    origin = f"embedded, pid {server.pid}" if server else "external"
    lines = [
        f"genmesh is up (namespace {config.mesh.namespace!r})",
        f"  NATS      {redact(nats_url)}  ({origin})",
    ]
    for child in children:
        if child.role != "frontend":
            lines.append(f"  {child.role:<9} {child.label.split()[-1]:<10} pid {child.process.pid}")
    frontend = next(c for c in children if c.role == "frontend")
    lines += [
        f"  frontend  {http_url}  pid {frontend.process.pid}  (POST /generate, GET /metrics)",
        "",
        "Try:",
        f"  curl -s {http_url}/generate -d "
        '\'{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8}}\'',
        "Ctrl-C stops everything.",
    ]
    print("\n".join(lines), flush=True)


def run_up(config: UpConfig) -> int:
    return asyncio.run(_up(config))

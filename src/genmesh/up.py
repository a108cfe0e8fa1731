"""`genmesh up`: a whole mesh on one machine, each service its own OS process."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from genmesh.shared.bus import NatsAuth, NatsAuthError, NatsUnreachable, connect, redact
from genmesh.shared.ids import new_worker_id
from genmesh.shared.lifecycle import STOP_SIGNALS
from genmesh.shared.natsserver import NatsServer, NatsServerError

READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


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


async def _spawn(
    role: str, label: str, args: list[str], env: dict[str, str] | None = None
) -> Child:
    # A session of its own: a terminal's Ctrl-C (SIGINT to the whole foreground process
    # group) reaches only `genmesh up`, which stops the services in order, NATS last.
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "genmesh", role, *args,
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


def _worker_plans(args: argparse.Namespace) -> list[list[str]]:
    """The engine arguments of each worker: --workers mocks, or one worker per engine URL."""
    urls = args.engine_url or args.engine_url_env
    if args.engine == "mock":
        if urls:
            raise ValueError("--engine-url needs --engine sglang or --engine vllm")
        return [[] for _ in range(args.workers)]
    if not urls:
        raise ValueError(f"--engine {args.engine} needs --engine-url (repeat it for several)")
    return [["--engine-url", url] for url in urls]


async def _up(args: argparse.Namespace) -> int:
    try:
        plans = _worker_plans(args)
    except ValueError as exc:
        _say(str(exc))
        return 2
    server: NatsServer | None = None
    auth = NatsAuth.from_args(args)
    # Children get the credentials in their environment, never on their command line;
    # exactly ours (flags and variables resolved), none of the inherited variables.
    auth_vars = {"GENMESH_NATS_" + f.upper() for f in NatsAuth.__dataclass_fields__}
    child_env = {k: v for k, v in os.environ.items() if k not in auth_vars} | auth.to_env()
    if args.nats_url:
        url = args.nats_url
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

    common = ["--nats-url", url, "--namespace", args.namespace, "--log-level", args.log_level]
    worker_args = [
        "--engine", args.engine,
        "--drain-timeout", str(args.drain_timeout),
        "--max-concurrency", str(args.max_concurrency),
        "--mock-speedup", str(args.mock_speedup),
        "--mock-model", args.mock_model,
        "--mock-vocab-size", str(args.mock_vocab_size),
        "--mock-eos-token-id", str(args.mock_eos_token_id),
        "--mock-max-model-len", str(args.mock_max_model_len),
    ]  # fmt: skip
    # Explicit on every child, so an inherited GENMESH_METRICS_PORT cannot make them collide.
    metrics_ports = itertools.count(args.metrics_port)

    def metrics_args() -> list[str]:
        port = next(metrics_ports) if args.metrics_port else 0
        return ["--metrics-host", args.metrics_host, "--metrics-port", str(port)]

    children: list[Child] = []
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    try:
        for i in range(args.routers):
            children.append(
                await _spawn(
                    "router",
                    f"router {i + 1}",
                    [*common, "--router-policy", args.router_policy, *metrics_args()],
                    child_env,
                )
            )
        for plan in plans:
            wid = new_worker_id()
            children.append(
                await _spawn(
                    "worker",
                    f"worker {wid}",
                    [*common, "--worker-id", wid, *worker_args, *plan, *metrics_args()],
                    child_env,
                )
            )
        children.append(
            await _spawn(
                "frontend",
                "frontend",
                [*common, "--host", args.host, "--port", str(args.port)],
                child_env,
            )
        )
        http_url = f"http://{args.host}:{args.port}"
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
        _print_summary(url, server, children, http_url, args)
        return 1 if await _watch(children, stop) else 0
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
        _say("stopping")
        await _stop(children, args.drain_timeout)
        if server is not None:
            await asyncio.to_thread(server.stop)
        _say("stopped")


def _print_summary(
    nats_url: str,
    server: NatsServer | None,
    children: list[Child],
    http_url: str,
    args: argparse.Namespace,
) -> None:
    origin = f"embedded, pid {server.pid}" if server else "external"
    lines = [
        f"genmesh is up (namespace {args.namespace!r})",
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


def run_up(args: argparse.Namespace) -> int:
    return asyncio.run(_up(args))

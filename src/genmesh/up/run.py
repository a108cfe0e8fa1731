"""Running `genmesh up`: NATS, routers, workers and the frontend, as supervised processes."""

from __future__ import annotations

import asyncio
import errno
import itertools
import os
import sys
from dataclasses import replace

from genmesh.services.frontend.config import FrontendConfig
from genmesh.services.worker.config import WorkerProcessConfig
from genmesh.shared.bus import NatsUnreachable, connect, redact
from genmesh.shared.cards import ROLE_BOTH, ROLE_DECODE, ROLE_PREFILL
from genmesh.shared.connection import MeshConnection, MetricsConfig
from genmesh.shared.credentials import NatsAuth, NatsAuthError
from genmesh.shared.ids import new_router_id, new_worker_id
from genmesh.shared.lifecycle import STOP_SIGNALS
from genmesh.shared.loop import run
from genmesh.shared.natsserver import NatsServerError
from genmesh.shared.settings import to_env, variables
from genmesh.supervisor import ChildExited, NotReady, Supervisor, wait_http_ok_from
from genmesh.up.config import UpConfig

READY_TIMEOUT_S = 30.0
# Mock workers running whole requests when --workers is not given (none in a P/D mesh).
DEFAULT_WORKERS = 2
# The options that ask for workers of each role.
_URL_FLAGS = {ROLE_BOTH: "--engine-url", ROLE_PREFILL: "--prefill-url", ROLE_DECODE: "--decode-url"}
_COUNT_FLAGS = {ROLE_PREFILL: "--prefill-workers", ROLE_DECODE: "--decode-workers"}
WATCH_INTERVAL_S = 0.1


def _say(message: str) -> None:
    print(f"genmesh up: {message}", file=sys.stderr, flush=True)


async def _probe_nats(url: str, auth: NatsAuth) -> None:
    nc = await connect(url, name="genmesh-up-probe", auth=auth)
    await nc.close()


def worker_configs(config: UpConfig) -> list[WorkerProcessConfig]:
    """One config per worker: mocks by role (--workers, --prefill-workers,
    --decode-workers), or one worker per engine URL with the role its option says."""
    engine = config.worker.engine
    urls = {
        ROLE_BOTH: config.engine_urls,
        ROLE_PREFILL: config.prefill_urls,
        ROLE_DECODE: config.decode_urls,
    }
    counts = {
        ROLE_PREFILL: config.prefill_workers,
        ROLE_DECODE: config.decode_workers,
    }
    if engine == "mock":
        for role, flag in _URL_FLAGS.items():
            if urls[role]:
                raise ValueError(f"{flag} needs --engine sglang or --engine vllm")
        default_workers = 0 if any(counts.values()) else DEFAULT_WORKERS
        counts[ROLE_BOTH] = default_workers if config.workers is None else config.workers
        plans: list[tuple[str, str | None]] = [
            (role, None) for role, count in counts.items() for _ in range(count)
        ]
        if not plans:
            raise ValueError(
                "--workers 0 with no --prefill-workers or --decode-workers leaves the mesh "
                "without a worker, and its frontend never ready: give --workers 1 or more"
            )
    else:
        for role, flag in _COUNT_FLAGS.items():
            if counts[role]:
                raise ValueError(
                    f"{flag} runs mock workers; with --engine {engine} give "
                    f"{_URL_FLAGS[role]} (one per server)"
                )
        plans = [(role, url) for role, given in urls.items() for url in given]
        if not plans:
            raise ValueError(
                f"--engine {engine} needs --engine-url, or --prefill-url and --decode-url "
                "(repeat them for several)"
            )
    roles = [role for role, _ in plans]
    if ROLE_PREFILL in roles and ROLE_DECODE not in roles:
        raise ValueError("prefill workers serve decode workers only: add decode workers")
    return [
        replace(
            config.worker,
            service=replace(config.worker.service, worker_id=new_worker_id(), role=role),
            engine_url=url,
        )
        for role, url in plans
    ]


def per_frontend_path(path: str, index: int) -> str:
    """Frontend `index`'s own request-trace file: PATH-f<index> before the .jsonl/.jsonl.gz
    suffix (so a .jsonl.gz one's segments are PATH-f<index>.<n>.jsonl.gz)."""
    for suffix in (".jsonl.gz", ".gz", ".jsonl"):
        if path.endswith(suffix):
            return f"{path[: -len(suffix)]}-f{index}{suffix}"
    return f"{path}-f{index}"


def frontend_configs(config: UpConfig, mesh: MeshConnection) -> list[tuple[str, FrontendConfig]]:
    """(name, config) of each frontend. Several share the port (SO_REUSEPORT) and so must
    differ in what they write: each its own request-trace file. Their /metrics are each
    one frontend's (docs/performance.md, "More than one frontend")."""
    # Each frontend routes with the routers' policy and admission control (`--router-policy`
    # and the `--busy-*`/`--admission-*` options reach both).
    base = replace(
        config.frontend,
        mesh=mesh,
        auth=config.auth,
        router_policy=config.router.policy,
        kv=config.router.kv,
        admission=config.router.admission,
        pd=config.router.pd,
        api_key=None,
        admin_api_key=None,
    )
    if config.frontends == 1:
        return [("frontend", base)]
    out = []
    for index in range(1, config.frontends + 1):
        records = base.records
        if records.path:
            records = replace(records, path=per_frontend_path(records.path, index))
        out.append((f"frontend-{index}", replace(base, reuse_port=True, records=records)))
    return out


def child_environment() -> dict[str, str]:
    """Ours, less every variable `genmesh up` read itself: what it resolved travels on the
    children's command lines (an inherited GENMESH_METRICS_PORT or GENMESH_PORT must not
    reach them), and its credentials in their environment (`Supervisor.spawn_genmesh`)."""
    own = set(variables(UpConfig))
    return {k: v for k, v in os.environ.items() if k not in own}


async def _check_port_free(host: str, port: int) -> None:
    """ValueError if `host:port` cannot be listened on (another server has it), found by
    listening there as a frontend would, for a moment: before anything starts, rather
    than a frontend's failure once the rest of the mesh is up. A server that took the
    port since is caught by the readiness check (`wait_http_ok_from`: only our frontends'
    pids count)."""
    try:
        server = await asyncio.get_running_loop().create_server(
            asyncio.Protocol, host, port, reuse_address=True
        )
    except OSError as exc:
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        taken = exc.errno == errno.EADDRINUSE
        hint = ": another server has it; choose another --port" if taken else ""
        raise ValueError(f"cannot listen on {host}:{port} ({why}){hint}") from None
    server.close()
    await server.wait_closed()


async def _up(config: UpConfig, supervisor: Supervisor, stop: asyncio.Event) -> int:
    if config.routers == 0 and config.frontend.routing == "routers":
        _say("--routing routers needs a router: give --routers 1 or more")
        return 2
    try:
        workers = worker_configs(config)
        if config.frontend.port == 0:
            raise ValueError(
                "--port 0: up needs a fixed --port: it waits for its frontends there (and "
                "--frontends above 1 share it)"
            )
        await _check_port_free(config.frontend.host, config.frontend.port)
    except ValueError as exc:
        _say(str(exc))
        return 2
    if config.mesh.nats_url:
        url = config.mesh.nats_url
        try:
            await _probe_nats(url, config.auth)
        except (NatsUnreachable, NatsAuthError) as exc:
            _say(str(exc))
            return 2
    else:
        try:
            url = await asyncio.to_thread(supervisor.start_nats)
        except NatsServerError as exc:
            _say(str(exc))
            return 2
    mesh = replace(config.mesh, nats_url=url)
    metrics_ports = itertools.count(config.metrics_port)

    def metrics() -> MetricsConfig:
        # Explicit on every child, so that no two of them collide.
        port = next(metrics_ports) if config.metrics_port else 0
        return replace(config.metrics, port=port)

    # Credentials: `spawn_genmesh` moves each config's `auth` into the child's environment.
    for _ in range(config.routers):
        router = replace(
            config.router,
            mesh=mesh,
            auth=config.auth,
            router_id=new_router_id(),
            metrics=metrics(),
        )
        await asyncio.to_thread(supervisor.spawn_genmesh, router.router_id, router)
    for worker in workers:
        worker = replace(worker, mesh=mesh, auth=config.auth, metrics=metrics())
        await asyncio.to_thread(supervisor.spawn_genmesh, worker.service.worker_id, worker)
    frontends = frontend_configs(config, mesh)
    # The API keys are secrets: they reach the frontends in their environment, never argv.
    keys = to_env(replace(FrontendConfig(), api_key=config.frontend.api_key,
                          admin_api_key=config.frontend.admin_api_key))  # fmt: skip
    children = [
        await asyncio.to_thread(supervisor.spawn_genmesh, name, frontend, env=keys)
        for name, frontend in frontends
    ]
    http_url = f"http://{config.frontend.host}:{config.frontend.port}"
    ready = asyncio.ensure_future(
        wait_http_ok_from(f"{http_url}/health", children, timeout_s=READY_TIMEOUT_S)
    )
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if stop.is_set():
        ready.cancel()
        return 0
    try:
        ready.result()
    except ChildExited as exc:
        # Its own last words (the port taken since, a bad setting) are on our stderr.
        codes = ", ".join(f"{c.label} exited with code {c.returncode}" for c in exc.children)
        _say(f"the mesh did not become ready: {codes}; stopping")
        return 1
    except NotReady as exc:
        _say(f"the mesh did not become ready in {READY_TIMEOUT_S:g}s ({exc}); stopping")
        return 1
    _print_summary(config, url, supervisor, http_url)
    return 1 if await _watch(supervisor, stop) else 0


async def _watch(supervisor: Supervisor, stop: asyncio.Event) -> bool:
    """Report children that exit on their own until `stop`; True if the frontend died
    (without a frontend the mesh is over)."""
    while not stop.is_set():
        for child in supervisor.exited():
            _say(f"{child.label} (pid {child.pid}) exited with code {child.returncode}")
            if child.role == "frontend":
                return True
        try:
            async with asyncio.timeout(WATCH_INTERVAL_S):
                await stop.wait()
        except TimeoutError:
            pass
    return False


def _print_summary(config: UpConfig, nats_url: str, supervisor: Supervisor, http_url: str) -> None:
    nats = supervisor.nats
    origin = f"embedded, pid {nats.pid}" if nats else "external"
    lines = [
        f"genmesh is up (namespace {config.mesh.namespace!r})",
        f"  NATS      {redact(nats_url)}  ({origin})",
    ]
    for child in supervisor.children:
        if child.role != "frontend":
            line = f"  {child.role:<9} {child.name:<10} pid {child.pid}"
            if isinstance(child.config, WorkerProcessConfig):
                role = child.config.service.role
                line += f"  (role {role})" if role != ROLE_BOTH else ""
            lines.append(line)
    pids = ", ".join(str(c.pid) for c in supervisor.children if c.role == "frontend")
    lines += [
        f"  frontend  {http_url}  pid {pids}  (POST /generate, GET /metrics)",
        "",
        "Try:",
        f"  curl -s {http_url}/generate -d "
        '\'{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8}}\'',
        f"  genmesh status --nats-url {redact(nats_url)} --namespace {config.mesh.namespace}",
        f"  genmesh bench --url {http_url} --stream -n 1000 -c 16",
        "Ctrl-C stops everything.",
    ]
    print("\n".join(lines), flush=True)


async def _run(config: UpConfig) -> int:
    # Children start from our environment less what we read ourselves (see
    # `child_environment`), and write to our stdout/stderr.
    supervisor = Supervisor(env=child_environment(), report=_say)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    try:
        return await _up(config, supervisor, stop)
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
        if supervisor.children or supervisor.nats is not None:
            _say("stopping")
            await asyncio.to_thread(
                supervisor.stop, drain_timeout_s=config.worker.service.drain_timeout_s
            )
            _say("stopped")


def run_up(config: UpConfig) -> int:
    return run(_run(config), config.mesh.event_loop)

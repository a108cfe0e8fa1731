"""A mesh in this process: routers, mock workers and a frontend as tasks on a real NATS.

The services run exactly as `genmesh router|worker|frontend` run them (the same
`running_router`, `running_worker` and `running_frontend` the serve modules use), on an
event loop of their own in a thread: so that a module-scoped mesh outlives each test's
event loop, and tests talk to it over real sockets (HTTP, NATS), as to processes. What it
saves is a process start per service (about half a second each). Tests that kill or
signal services need processes: `tests/mesh.py`.

Each service's log records (its tasks carry its name in a context variable) are kept, so
`mesh.logs()` and `service.log()` work as they do for processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import nats
from nats.aio.msg import Msg

from genmesh.services.frontend.config import FrontendConfig
from genmesh.services.frontend.serve import running_frontend
from genmesh.services.router.config import RouterConfig
from genmesh.services.router.serve import running_router
from genmesh.services.worker.serve import running_worker
from genmesh.shared.bus import flush_in_order
from genmesh.shared.connection import MeshConnection
from genmesh.shared.ids import new_router_id, new_worker_id
from genmesh.shared.settings import parse
from genmesh.shared.subjects import Subjects
from genmesh.testkit.common import serving
from genmesh.testkit.config import TestkitConfig
from genmesh.testkit.sglang import build_app as sglang_app
from genmesh.testkit.vllm import build_app as vllm_app
from tests.mesh import FrontendView, Mesh, wait_until, worker_config

T = TypeVar("T")

# The service whose task is running: log records are filed under it.
_SERVICE: contextvars.ContextVar[str] = contextvars.ContextVar("genmesh_test_service")
START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 45.0  # a worker drains first


class _ServiceLogs(logging.Handler):
    """Formats and keeps every genmesh record a service of this process logs."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: dict[str, list[str]] = {}
        self.errors: dict[str, int] = {}
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        service = _SERVICE.get(None)
        if service is None:
            return
        self.lines.setdefault(service, []).append(self.format(record))
        if record.levelno >= logging.ERROR:
            self.errors[service] = self.errors.get(service, 0) + 1


_LOGS = _ServiceLogs()
_genmesh_logger = logging.getLogger("genmesh")
_genmesh_logger.addHandler(_LOGS)
if _genmesh_logger.level == logging.NOTSET or _genmesh_logger.level > logging.INFO:
    _genmesh_logger.setLevel(logging.INFO)  # as the processes log at (DEBUG: too chatty)


class _Loop:
    """An event loop running in a thread of its own."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = START_TIMEOUT_S) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@dataclass(eq=False)
class InProcessService:
    """One service of the mesh: running until `stop`."""

    role: str
    name: str
    key: str  # the name its log records are filed under
    _stop: asyncio.Event
    _done: asyncio.Future[None]
    value: Any = None  # the started service (Router, Worker, RunningFrontend)
    stopped: bool = False

    @property
    def alive(self) -> bool:
        """Running, and nothing it ran failed with an error (the in-process analogue of a
        process that has not died)."""
        return not self.stopped and not self._done.done() and not _LOGS.errors.get(self.key)

    def log(self) -> str:
        return "\n".join(_LOGS.lines.get(self.key, []))


@dataclass
class InProcessMesh(FrontendView):
    """The in-process counterpart of `tests.mesh.Mesh`, for tests that kill nothing."""

    nats_url: str
    namespace: str
    services: list[InProcessService] = field(default_factory=list)
    http_port: int = 0
    _loop: _Loop = field(init=False)

    def __post_init__(self) -> None:
        self._loop = _Loop(f"mesh {self.namespace}")

    @property
    def connection(self) -> MeshConnection:
        return MeshConnection(self.nats_url, self.namespace)

    @property
    def workers(self) -> list[InProcessService]:
        return [s for s in self.services if s.role == "worker" and s.alive]

    # ------------------------------------------------------------------ services

    def _start(
        self,
        role: str,
        name: str,
        running: Callable[[], contextlib.AbstractAsyncContextManager[Any]],
    ) -> InProcessService:
        """Run `running()` as a task of the mesh's loop until the service is stopped."""

        key = f"{self.namespace}/{name}"  # meshes of several modules share the process

        async def start() -> InProcessService:
            stop = asyncio.Event()
            started: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

            async def run() -> None:
                _SERVICE.set(key)  # this task's context: the service's tasks inherit it
                try:
                    async with running() as value:
                        started.set_result(value)
                        await stop.wait()
                except BaseException as exc:
                    if not started.done():
                        started.set_exception(exc)
                    raise

            done = asyncio.ensure_future(run())
            return InProcessService(role, name, key, stop, done, await started)

        service = self._loop.run(start())
        self.services.append(service)
        return service

    def add_router(
        self, policy: str = "round_robin", *, wait: bool = True, extra_args: tuple[str, ...] = ()
    ) -> InProcessService:
        """A router; started means announced (`Router.start`), so `wait` has nothing to do."""
        n = sum(s.role == "router" for s in self.services)
        config = RouterConfig(mesh=self.connection, router_id=new_router_id(), policy=policy)
        config = parse(RouterConfig, extra_args, environ={}, defaults=config)
        return self._start("router", f"router{n}", lambda: running_router(config))

    def add_worker(
        self,
        worker_id: str | None = None,
        *,
        wait: bool = True,
        extra_args: tuple[str, ...] = (),
        **options: Any,
    ) -> InProcessService:
        """A worker; `options` as `tests.mesh.worker_config` takes them."""
        wid = worker_id or new_worker_id()
        config = worker_config(self.connection, wid, extra_args, **options)

        def running() -> contextlib.AbstractAsyncContextManager[Any]:
            return running_worker(config, config.new_engine())

        service = self._start("worker", wid, running)
        if wait and self.http_port:
            self.wait_for_workers(lambda ids: wid in ids, what=f"worker {wid} to be known")
        return service

    def add_frontend(self, *extra: str, name: str = "frontend") -> InProcessService:
        """A frontend on a free port (`extra`: its command-line options); the mesh's HTTP
        address is the last one added."""
        config = FrontendConfig(mesh=self.connection, port=0)
        config = parse(FrontendConfig, extra, environ={}, defaults=config)
        service = self._start("frontend", name, lambda: running_frontend(config))
        self.http_port = service.value.port
        return service

    def spawn_engine_server(self, engine: str, *extra: str) -> tuple[InProcessService, str]:
        """A mock SGLang/vLLM server (the testkit's, as `genmesh testkit` runs it); it and
        its URL."""
        name = f"{engine}-server{sum(s.role == 'engine' for s in self.services)}"
        config = parse(TestkitConfig, [engine, *extra], environ={}, defaults=TestkitConfig(engine))
        app = (sglang_app if engine == "sglang" else vllm_app)(config.server)
        service = self._start("engine", name, lambda: serving(app, "127.0.0.1", 0))
        url: str = service.value
        return service, url

    def stop_service(self, service: InProcessService) -> None:
        """Stop one service as SIGTERM stops a process: cleanly, a worker draining."""

        async def stop() -> None:
            service._stop.set()
            with contextlib.suppress(Exception):
                await service._done

        service.stopped = True
        self._loop.run(stop(), timeout=STOP_TIMEOUT_S)

    def stop(self) -> None:
        """Stop everything, frontend first (as `genmesh up` does), then close the loop."""
        for role in ("frontend", "router", "worker", "engine"):
            for service in self.services:
                if service.role == role and not service.stopped:
                    self.stop_service(service)
        self._loop.close()

    # ------------------------------------------------------------------ what tests read

    def wait_for_routers(self) -> None:
        """Routers announce themselves while they start (`Router.start`): nothing to wait."""

    def logs(self) -> str:
        return "\n".join(f"===== {s.name} =====\n{s.log()[-6000:]}" for s in self.services)


def start_inproc_mesh(
    nats_url: str,
    *,
    namespace: str,
    workers: int = 2,
    routers: int = 1,
    worker_opts: dict[str, Any] | None = None,
    worker_args: list[tuple[str, ...]] | None = None,
    frontend_args: tuple[str, ...] = (),
) -> InProcessMesh:
    """A ready mesh: its routers, workers and frontend started, the workers known to it.
    `worker_args`: each worker's command-line options (then `workers` is their number)."""
    mesh = InProcessMesh(nats_url, namespace)
    opts = dict(worker_opts or {})
    common: tuple[str, ...] = opts.pop("extra_args", ())
    each = worker_args if worker_args is not None else [()] * workers
    try:
        for _ in range(routers):
            mesh.add_router()
        ids = [
            mesh.add_worker(wait=False, extra_args=(*common, *args), **opts).name for args in each
        ]
        mesh.add_frontend(*frontend_args)
        mesh.wait_for_workers(lambda known: set(ids) <= known, what=f"workers {ids}")
        wait_until(lambda: mesh._http_ok("/health"), what="the frontend to be ready")
    except BaseException:
        print(mesh.logs())
        mesh.stop()
        raise
    return mesh


# Either kind of mesh: what tests written for both take.
AnyMesh = Mesh | InProcessMesh


@contextlib.asynccontextmanager
async def worker_requests(nats_url: str, namespace: str) -> AsyncIterator[list[bytes]]:
    """Every request message sent to a worker of `namespace` while the block runs, as the
    worker receives it (raw bytes, whatever the codec): what the mesh lets reach workers."""
    seen: list[bytes] = []

    async def on_request(msg: Msg) -> None:
        seen.append(msg.data)

    nc = await nats.connect(nats_url, name="genmesh-test-watch")
    try:
        await nc.subscribe(Subjects(namespace).worker_generate("*"), cb=on_request)
        await flush_in_order(nc)
        yield seen
        await flush_in_order(nc)
    finally:
        await nc.close()

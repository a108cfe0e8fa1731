"""Real meshes for tests: genmesh services as OS processes on a real nats-server, run by
the package's supervisor (`genmesh.supervisor`) with command lines derived from the
services' configs.

Synchronous on purpose, so a mesh can outlive one test's event loop (module-scoped
fixtures). Each process logs to its own file; `Mesh.logs()` shows them when a test fails.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from genmesh.services.frontend.config import FrontendConfig
from genmesh.services.router.config import RouterConfig
from genmesh.services.worker.config import WorkerConfig, WorkerProcessConfig
from genmesh.shared.connection import MeshConnection
from genmesh.shared.credentials import NatsAuth
from genmesh.shared.ids import new_router_id, new_worker_id
from genmesh.shared.settings import from_env, parse
from genmesh.supervisor import (
    Child,
    Supervisor,
    clean_environment,
    free_port,
    run_blocking,
    wait_discovered,
    wait_http_ok,
)
from genmesh.testkit.config import TestkitConfig

# A service of a test's mesh: a supervised child (kill, terminate, log, alive, pid).
Service = Child

__all__ = [
    "FrontendView",
    "Mesh",
    "Service",
    "free_port",
    "frontend_options",
    "start_mesh",
    "wait_until",
    "worker_config",
]


def wait_until(
    predicate: Any, timeout: float = 10.0, interval: float = 0.05, what: str = ""
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what or predicate}")


class FrontendView:
    """What a test reads of a mesh through its frontend's HTTP port (either kind of mesh)."""

    http_port: int

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def _http_ok(self, path: str) -> bool:
        try:
            with urllib.request.urlopen(self.http_url + path, timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def server_info(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.http_url + "/get_server_info", timeout=5) as resp:
            info: dict[str, Any] = json.load(resp)
            return info

    def worker_ids(self) -> set[str]:
        """Workers the frontend's discovery currently knows."""
        return {w["id"] for w in self.server_info()["genmesh"]["workers"]}

    def wait_for_workers(self, predicate: Any, timeout: float = 15.0, what: str = "") -> None:
        wait_until(lambda: predicate(self.worker_ids()), timeout=timeout, what=what)


@dataclass
class Mesh(FrontendView):
    nats_url: str
    workdir: Path
    namespace: str = "test"
    http_port: int = 0
    # Variables for every genmesh process of the mesh (e.g. OTEL_*), under per-call `env`.
    env: dict[str, str] = field(default_factory=dict)
    # Per role ("frontend", "router", "worker"), variables over `env`: NATS credentials
    # (GENMESH_NATS_USER, GENMESH_NATS_PASSWORD, ...), so each role logs in as itself.
    role_env: dict[str, dict[str, str]] = field(default_factory=dict)
    # Tests read what the services log at debug; a benchmark runs them as `genmesh up`
    # does, at info (a debug line per request is ~5% of a frontend's CPU).
    log_level: str = "debug"
    # Neither the runner's GENMESH_ settings nor its OTEL_ (tracing) ones leak in.
    supervisor: Supervisor = field(init=False)

    def __post_init__(self) -> None:
        self.supervisor = Supervisor(logdir=self.workdir, env=clean_environment())

    @property
    def services(self) -> list[Service]:
        return self.supervisor.children

    @property
    def connection(self) -> MeshConnection:
        return MeshConnection(self.nats_url, self.namespace, log_level=self.log_level)

    def _env(self, role: str, env: dict[str, str] | None = None) -> dict[str, str]:
        return self.env | self.role_env.get(role, {}) | (env or {})

    def add_router(
        self, policy: str = "round_robin", *, wait: bool = True, extra_args: tuple[str, ...] = ()
    ) -> Service:
        n = sum(s.role == "router" for s in self.services)
        config = RouterConfig(mesh=self.connection, router_id=new_router_id(), policy=policy)
        config = parse(RouterConfig, extra_args, environ={}, defaults=config)
        service = self.supervisor.spawn_genmesh(f"router{n}", config, env=self._env("router"))
        if wait:
            self.wait_for_router(service)
        return service

    def wait_for_routers(self) -> None:
        self._wait_for_routers([s for s in self.services if s.role == "router" and not s.stopping])

    def wait_for_router(self, service: Service) -> None:
        """A router is subscribed once it has announced its presence in discovery."""
        self._wait_for_routers([service])

    def _wait_for_routers(self, routers: list[Service]) -> None:
        ids = [s.config.router_id for s in routers]
        if not ids:
            return
        run_blocking(
            wait_discovered(
                self.nats_url,
                self.namespace,
                routers=ids,
                auth=self._probe_auth(),
                watch=routers,
            )
        )

    def _probe_auth(self) -> NatsAuth:
        """The discovery probe logs in as a role that may watch discovery."""
        role = self.role_env.get("frontend") or self.role_env.get("router") or {}
        return from_env(NatsAuth, self.env | role)

    def add_worker(
        self,
        worker_id: str | None = None,
        *,
        wait: bool = True,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        **options: Any,
    ) -> Service:
        """A worker process; `options` as `worker_config` takes them, `env` over the
        worker role's variables (a decode worker's own NATS user)."""
        wid = worker_id or new_worker_id()
        config = worker_config(self.connection, wid, extra_args, **options)
        child = self.supervisor.spawn_genmesh(wid, config, env=self._env("worker", env))
        if wait and self.http_port:  # known to the frontend, which is what tests talk to
            self.wait_for_workers(lambda ids: wid in ids, what=f"worker {wid} to be known")
        elif wait:  # no frontend yet: announced in discovery
            run_blocking(
                wait_discovered(
                    self.nats_url,
                    self.namespace,
                    workers=[wid],
                    auth=self._probe_auth(),
                    watch=[child],
                )
            )
        return child

    def add_frontend(
        self, *extra: str, env: dict[str, str] | None = None, name: str = "frontend"
    ) -> Service:
        config = FrontendConfig(mesh=self.connection, port=free_port())
        config = parse(FrontendConfig, extra, environ={}, defaults=config)
        self.http_port = config.port
        service = self.supervisor.spawn_genmesh(name, config, env=self._env("frontend", env))
        run_blocking(
            wait_http_ok(self.http_url + "/get_server_info", watch=[service], what="the frontend")
        )
        return service

    @property
    def workers(self) -> list[Service]:
        return [s for s in self.services if s.role == "worker" and s.alive]

    def spawn_engine_server(self, engine: str, *extra: str) -> tuple[Service, str]:
        """A mock SGLang/vLLM server process (`genmesh testkit`); returns it and its URL."""
        name = f"{engine}-server{sum(s.role == 'engine' for s in self.services)}"
        config = TestkitConfig(engine=engine, port=free_port())
        config = parse(TestkitConfig, [engine, *extra], environ={}, defaults=config)
        service = self.supervisor.spawn_genmesh(name, config)
        url = f"http://127.0.0.1:{config.port}"
        run_blocking(
            wait_http_ok(url + "/health", watch=[service], what=f"the mock {engine} server")
        )
        return service, url

    def logs(self) -> str:
        return self.supervisor.logs()

    def stop(self) -> None:
        self.supervisor.stop(timeout_s=15.0)


def start_mesh(
    nats_url: str,
    workdir: Path,
    *,
    namespace: str,
    workers: int = 2,
    routers: int = 1,
    worker_opts: dict[str, Any] | None = None,
    frontend_args: tuple[str, ...] = (),
    role_env: dict[str, dict[str, str]] | None = None,
) -> Mesh:
    mesh = Mesh(nats_url, workdir, namespace, role_env=dict(role_env or {}))
    try:
        for _ in range(routers):
            mesh.add_router(wait=False)
        ids = [mesh.add_worker(wait=False, **(worker_opts or {})).name for _ in range(workers)]
        mesh.add_frontend(*frontend_args)
        mesh.wait_for_workers(lambda known: set(ids) <= known, what=f"workers {ids}")
        mesh.wait_for_routers()
    except BaseException:
        print(mesh.logs())
        mesh.stop()
        raise
    return mesh


def worker_config(
    connection: MeshConnection,
    worker_id: str,
    extra_args: tuple[str, ...] = (),
    *,
    speedup: float = 0.0,
    vocab_size: int | None = None,
    eos_token_id: int | None = None,
    max_concurrency: int | None = None,
    heartbeat: float | None = None,
    engine: str = "mock",
    engine_url: str | None = None,
    testkit_faults: bool = False,
    drain_timeout: float | None = None,
) -> WorkerProcessConfig:
    """A test worker's config: an instant mock engine unless `speedup` says otherwise;
    `extra_args`, command-line options, over the rest."""
    service = WorkerConfig(worker_id)
    if max_concurrency is not None:
        service = replace(service, max_concurrency=max_concurrency)
    if heartbeat is not None:
        service = replace(service, heartbeat_interval_s=heartbeat)
    if drain_timeout is not None:
        service = replace(service, drain_timeout_s=drain_timeout)
    mock = replace(WorkerProcessConfig().mock, speedup=speedup)
    if vocab_size is not None:
        mock = replace(mock, vocab_size=vocab_size)
    if eos_token_id is not None:
        mock = replace(mock, eos_token_id=eos_token_id)
    config = WorkerProcessConfig(
        mesh=connection,
        service=service,
        engine=engine,
        engine_url=engine_url,
        mock=mock,
        testkit_faults=testkit_faults,
    )
    return parse(WorkerProcessConfig, extra_args, environ={}, defaults=config)


def frontend_options(nats_url: str, namespace: str, **overrides: Any) -> FrontendConfig:
    """The config of an in-process frontend (`start_frontend`) on a free port."""
    mesh = MeshConnection(nats_url=nats_url, namespace=namespace)
    defaults: dict[str, Any] = {"port": 0, "model": "m", "body_limit_mb": 1}
    return FrontendConfig(mesh=mesh, **(defaults | overrides))

"""Real meshes for tests: genmesh services as OS processes on a real nats-server.

Synchronous on purpose, so a mesh can outlive one test's event loop (module-scoped
fixtures). Each process logs to its own file; `Mesh.logs()` shows them when a test fails.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from genmesh.services.frontend.config import FrontendConfig
from genmesh.shared.connection import MeshConnection
from genmesh.shared.ids import new_worker_id


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(
    predicate: Any, timeout: float = 10.0, interval: float = 0.05, what: str = ""
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what or predicate}")


@dataclass
class Service:
    role: str
    name: str
    args: list[str]
    log_path: Path
    process: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL: no goodbye, no cleanup, like a crash."""
        if self.alive:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def terminate(self, timeout: float = 15.0) -> int:
        if self.alive:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@dataclass
class Mesh:
    nats_url: str
    workdir: Path
    namespace: str = "test"
    services: list[Service] = field(default_factory=list)
    http_port: int = 0
    # Variables for every genmesh process of the mesh (e.g. OTEL_*), under per-call `env`.
    env: dict[str, str] = field(default_factory=dict)
    # Per role ("frontend", "router", "worker"), variables over `env`: NATS credentials
    # (GENMESH_NATS_USER, GENMESH_NATS_PASSWORD, ...), so each role logs in as itself.
    role_env: dict[str, dict[str, str]] = field(default_factory=dict)

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def _spawn(
        self, role: str, name: str, args: list[str], env: dict[str, str] | None = None
    ) -> Service:
        log_path = self.workdir / f"{name}.log"
        full = [
            sys.executable, "-m", "genmesh", role,
            "--nats-url", self.nats_url, "--namespace", self.namespace,
            "--log-level", "debug", *args,
        ]  # fmt: skip
        # Neither the runner's GENMESH_ settings nor its OTEL_ (tracing) ones leak in.
        environment = {
            k: v for k, v in os.environ.items() if not k.startswith(("GENMESH_", "OTEL_"))
        }
        environment.update(self.env)
        environment.update(self.role_env.get(role, {}))
        environment.update(env or {})
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                full,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=environment,
            )
        service = Service(role, name, full, log_path, process)
        self.services.append(service)
        return service

    def add_router(
        self, policy: str = "round_robin", *, wait: bool = True, extra_args: tuple[str, ...] = ()
    ) -> Service:
        n = sum(s.role == "router" for s in self.services)
        service = self._spawn("router", f"router{n}", ["--router-policy", policy, *extra_args])
        if wait:
            self.wait_for_router(service)
        return service

    def wait_for_routers(self) -> None:
        for service in self.services:
            if service.role == "router":
                self.wait_for_router(service)

    @staticmethod
    def wait_for_router(service: Service) -> None:
        """A router is subscribed once it logs its subject."""
        wait_until(
            lambda: ".router.generate (policy" in service.log() or not service.alive,
            timeout=20,
            what=f"{service.name} to subscribe",
        )
        if not service.alive:
            raise RuntimeError(f"{service.name} died:\n{service.log()}")

    def add_worker(
        self,
        worker_id: str | None = None,
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
        wait: bool = True,
        extra_args: tuple[str, ...] = (),
    ) -> Service:
        wid = worker_id or new_worker_id()
        args = ["--worker-id", wid, "--mock-speedup", str(speedup), "--engine", engine]
        if engine_url is not None:
            args += ["--engine-url", engine_url]
        if testkit_faults:
            args.append("--testkit-faults")
        if drain_timeout is not None:
            args += ["--drain-timeout", str(drain_timeout)]
        if vocab_size is not None:
            args += ["--mock-vocab-size", str(vocab_size)]
        if eos_token_id is not None:
            args += ["--mock-eos-token-id", str(eos_token_id)]
        if max_concurrency is not None:
            args += ["--max-concurrency", str(max_concurrency)]
        if heartbeat is not None:
            args += ["--heartbeat-interval", str(heartbeat)]
        service = self._spawn("worker", wid, [*args, *extra_args])
        if wait and self.http_port:
            self.wait_for_workers(lambda ids: wid in ids, what=f"worker {wid} to be known")
        return service

    def add_frontend(self, *extra: str, env: dict[str, str] | None = None) -> Service:
        self.http_port = free_port()
        service = self._spawn(
            "frontend", "frontend", ["--port", str(self.http_port), *extra], env=env
        )
        wait_until(
            lambda: self._http_ok("/get_server_info") or not service.alive,
            timeout=20,
            what="the frontend to listen",
        )
        if not service.alive:
            raise RuntimeError(f"frontend died:\n{service.log()}")
        return service

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

    @property
    def workers(self) -> list[Service]:
        return [s for s in self.services if s.role == "worker" and s.alive]

    def spawn_engine_server(self, engine: str, *extra: str) -> tuple[Service, str]:
        """A mock SGLang/vLLM server process (`genmesh testkit`); returns it and its URL."""
        port = free_port()
        name = f"{engine}-server{sum(s.role == 'engine' for s in self.services)}"
        log_path = self.workdir / f"{name}.log"
        args = [sys.executable, "-m", "genmesh", "testkit", engine, "--port", str(port), *extra]
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        service = Service("engine", name, args, log_path, process)
        self.services.append(service)
        url = f"http://127.0.0.1:{port}"
        wait_until(
            lambda: self._url_ok(url + "/health") or not service.alive,
            timeout=20,
            what=f"the mock {engine} server",
        )
        if not service.alive:
            raise RuntimeError(f"mock {engine} server died:\n{service.log()}")
        return service, url

    @staticmethod
    def _url_ok(url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def logs(self) -> str:
        return "\n".join(f"===== {s.name} =====\n{s.log()[-6000:]}" for s in self.services)

    def stop(self) -> None:
        for role in ("frontend", "router", "worker", "engine"):
            for service in self.services:
                if service.role == role:
                    service.terminate()


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


def frontend_options(nats_url: str, namespace: str, **overrides: Any) -> FrontendConfig:
    """The config of an in-process frontend (`start_frontend`) on a free port."""
    mesh = MeshConnection(nats_url=nats_url, namespace=namespace)
    defaults: dict[str, Any] = {"port": 0, "model": "m", "body_limit_mb": 1}
    return FrontendConfig(mesh=mesh, **(defaults | overrides))

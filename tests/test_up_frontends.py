"""`genmesh up --frontends 2`: two frontend processes share the port (SO_REUSEPORT), both
serve, each writes its own request-trace file, and Ctrl-C stops both."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from genmesh.supervisor import NotReady, Supervisor, run_blocking, wait_http_ok_from
from tests.mesh import free_port
from tests.test_cli import GENMESH, ForeignServer, clean_env, up_summary

pytestmark = pytest.mark.process

REQUESTS = 40


def generate(port: int) -> list[int]:
    # urllib opens a fresh connection per request: the kernel picks a frontend for each.
    body = b'{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}'
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/generate",
        data=body,
        headers={"Content-Type": "application/json", "Connection": "close"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return list(json.loads(resp.read())["output_ids"])


def test_two_frontends_share_the_port_and_both_serve(tmp_path: Path) -> None:
    port = free_port()
    trace = tmp_path / "trace.jsonl"
    log = (tmp_path / "up.log").open("w+")
    proc = subprocess.Popen(
        [*GENMESH, "up", "--port", str(port), "--workers", "1", "--frontends", "2",
         "--request-trace", str(trace)],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=clean_env(GENMESH_MOCK_SPEEDUP="0"),
    )  # fmt: skip
    try:
        text = up_summary(proc, log)
        frontend_line = next(
            line for line in text.splitlines() if line.strip().startswith("frontend")
        )
        pids = [int(p) for p in re.findall(r"\d+", frontend_line.split("pid", 1)[1])]
        assert len(set(pids)) == 2, frontend_line

        for _ in range(REQUESTS):
            assert len(generate(port)) == 4

        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        for pid in pids:  # both frontends are gone (and reaped), not only `up`
            assert not Path(f"/proc/{pid}").exists()
        # Each frontend wrote its own file (closed, so flushed, at the stop), and the
        # kernel gave each some of the connections.
        files = [tmp_path / "trace-f1.jsonl", tmp_path / "trace-f2.jsonl"]
        counts = [len(f.read_text().splitlines()) for f in files]
        assert not trace.exists()
        assert sum(counts) == REQUESTS, counts
        assert min(counts) > 0, counts
        assert "frontend[" in Path(log.name).read_text()  # log lines say which frontend
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_several_frontends_need_a_fixed_port() -> None:
    result = subprocess.run(
        [*GENMESH, "up", "--port", "0", "--frontends", "2"],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=30,
    )
    assert result.returncode == 2
    assert "needs a fixed --port" in result.stderr


_OWN_FRONTEND = """
import http.server, os, socket, sys

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("X-Genmesh-Pid", str(os.getpid()))
        self.end_headers()

    def log_message(self, *args):
        pass

class Server(http.server.HTTPServer):
    def server_bind(self):
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        super().server_bind()

Server(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


@pytest.mark.parametrize("answers", [False, True], ids=["silent-child", "child-answers"])
def test_readiness_counts_only_its_own_frontends_answers(tmp_path: Path, answers: bool) -> None:
    """Another server on the port (SO_REUSEPORT: the kernel hands it some of the probes)
    answers /health 200; only the child's own pid in X-Genmesh-Pid makes it ready."""
    port = free_port()
    foreign = ForeignServer(port, reuse_port=True)
    threading.Thread(target=foreign.serve_forever, daemon=True).start()
    supervisor = Supervisor(logdir=tmp_path)
    script = ["-c", _OWN_FRONTEND, str(port)] if answers else ["-c", "import time; time.sleep(60)"]
    child = supervisor.spawn("frontend", "frontend", [sys.executable, *script])
    try:
        timeout_s = 20 if answers else 2
        ready = wait_http_ok_from(f"http://127.0.0.1:{port}/health", [child], timeout_s=timeout_s)
        if answers:
            run_blocking(ready)
        else:
            with pytest.raises(NotReady, match=rf"pid {child.pid} not ready in 2s"):
                run_blocking(ready)
    finally:
        supervisor.stop()
        foreign.shutdown()
        foreign.server_close()

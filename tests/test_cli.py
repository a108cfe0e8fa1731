"""The `genmesh` command: `up` end to end, fail-fast errors, `request`, every `--help`."""

from __future__ import annotations

import http.server
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import IO, Any

import pytest

from tests.inproc import AnyMesh, InProcessMesh
from tests.mesh import free_port, wait_until
from tests.test_mesh_behaviour import card

pytestmark = pytest.mark.process

GENMESH = [sys.executable, "-m", "genmesh"]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GENMESH_")}
    env.update(extra)
    return env


def up_summary(proc: subprocess.Popen[str], log: IO[str]) -> str:
    """What `genmesh up` printed until "Ctrl-C stops everything" (30 s at most); the test
    fails, showing the log, unless the mesh came up."""
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        lines.append(proc.stdout.readline())
        if "Ctrl-C stops everything" in lines[-1]:
            break
    text = "".join(lines)
    assert "genmesh is up" in text, text + Path(log.name).read_text()
    return text


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


@pytest.mark.parametrize(
    "command", [[], ["up"], ["frontend"], ["router"], ["worker"], ["nats"], ["request"]]
)
def test_every_command_has_help(command: list[str]) -> None:
    out = subprocess.run([*GENMESH, *command, "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "usage: genmesh" in out.stdout
    if command:
        assert "[env GENMESH_" in out.stdout  # every option names its variable


@pytest.mark.chaos
@pytest.mark.parametrize("terminal", [False, True], ids=["up-only", "whole-group"])
def test_up_runs_the_mesh_and_stops_everything_on_ctrl_c(tmp_path: Path, terminal: bool) -> None:
    """SIGINT to `genmesh up` alone, and as a terminal's Ctrl-C sends it: to the whole
    foreground process group. Either way the services stop in order, NATS last, with no
    traceback and nothing killed for being slow."""
    port = free_port()
    log = (tmp_path / "up.log").open("w+")
    proc = subprocess.Popen(
        [*GENMESH, "up", "--port", str(port), "--workers", "2", "--routers", "2"],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=clean_env(GENMESH_MOCK_SPEEDUP="0"),
        start_new_session=terminal,  # its own group, as a shell gives a foreground job
    )
    try:
        text = up_summary(proc, log)
        assert "NATS      nats://127.0.0.1:" in text
        assert "(embedded" in text
        assert f"http://127.0.0.1:{port}" in text
        pids = [int(p) for p in re.findall(r"pid (\d+)", text)]
        assert len(pids) == 1 + 2 + 2 + 1  # nats, 2 routers, 2 workers, frontend

        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/generate",
            data=json.dumps(
                {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}}
            ).encode(),
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert len(json.load(resp)["output_ids"]) == 3

        if not terminal:  # the `genmesh status` line it suggests, as printed, sees the mesh
            (status,) = [line.split() for line in text.splitlines() if "genmesh status" in line]
            out = subprocess.run(
                [*GENMESH, *status[1:], "--json"],
                capture_output=True,
                text=True,
                timeout=30,
                env=clean_env(),
            )
            assert out.returncode == 0, out.stderr
            seen = json.loads(out.stdout)
            assert [len(seen[kind]) for kind in ("routers", "workers", "frontends")] == [2, 2, 1]
            assert {
                row["health"] for kind in ("routers", "workers", "frontends") for row in seen[kind]
            } == {"up"}

        if terminal:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        wait_until(lambda: not any(pid_alive(p) for p in pids), timeout=10, what="children to exit")
        stderr = Path(log.name).read_text()
        assert "Traceback" not in stderr, stderr
        assert "did not stop" not in stderr, stderr
        assert stderr.rstrip().endswith("genmesh up: stopped"), stderr[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_up_with_unreachable_nats_fails_fast() -> None:
    started = time.monotonic()
    out = subprocess.run(
        [*GENMESH, "up", "--nats-url", "nats://127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env(),
    )
    assert out.returncode == 2
    assert "cannot reach NATS at nats://127.0.0.1:1" in out.stderr
    assert time.monotonic() - started < 10


def test_up_without_routers_needs_a_frontend_that_routes() -> None:
    """`--routers 0` is an HTTP-only mesh; a frontend routing through routers needs one."""
    out = subprocess.run(
        [*GENMESH, "up", "--routers", "0", "--routing", "routers"],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env(),
    )
    assert out.returncode == 2
    assert "--routing routers needs a router" in out.stderr


@pytest.mark.parametrize("role", ["frontend", "router", "worker"])
def test_services_fail_fast_without_nats(role: str) -> None:
    out = subprocess.run(
        [*GENMESH, role, "--nats-url", "nats://127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env(),
    )
    assert out.returncode == 2
    assert "cannot reach NATS" in out.stderr
    assert "Traceback" not in out.stderr


def test_env_vars_configure_commands(nats_url: str) -> None:
    out = subprocess.run(
        [*GENMESH, "frontend", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env(GENMESH_PORT="9123", GENMESH_NATS_URL=nats_url),
    )
    assert "default: 9123" in out.stdout
    bad = subprocess.run(
        [*GENMESH, "frontend"],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env(GENMESH_PORT="not-a-port"),
    )
    assert bad.returncode == 2
    assert "GENMESH_PORT='not-a-port'" in bad.stderr


def test_unknown_generate_format_fails_start_up(nats_url: str) -> None:
    out = subprocess.run(
        [*GENMESH, "frontend", "--nats-url", nats_url, "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env(GENMESH_GENERATE_FORMAT="nope"),
    )
    assert out.returncode == 2
    assert "unknown generate format 'nope'; installed formats: sglang" in out.stderr
    assert "Traceback" not in out.stderr


def test_frontend_port_in_use_is_a_clear_error(mesh: AnyMesh) -> None:
    out = subprocess.run(
        [*GENMESH, "frontend", "--nats-url", mesh.nats_url, "--port", str(mesh.http_port)],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env(),
    )
    assert out.returncode == 2
    assert "in use" in out.stderr
    assert "Traceback" not in out.stderr


def test_request_prints_frames(mesh: AnyMesh) -> None:
    out = subprocess.run(
        [
            *GENMESH, "request", "--nats-url", mesh.nats_url, "--namespace", mesh.namespace,
            "--input-ids", "1,2,3", "--max-tokens", "2", "--logprobs", "--codec", "json",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env(),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    frames = [json.loads(line) for line in out.stdout.splitlines()]
    assert [f["t"] for f in frames] == ["ack", "out", "end"]
    assert frames[-1]["usage"]["completion_tokens"] == 2


def test_request_exits_1_on_err(mesh: AnyMesh) -> None:
    out = subprocess.run(
        [
            *GENMESH, "request", "--nats-url", mesh.nats_url, "--namespace", mesh.namespace,
            "--input-ids", "1", "--worker", "nobody",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env(),
    )  # fmt: skip
    assert out.returncode == 1
    assert json.loads(out.stdout.splitlines()[-1])["code"] == "no_worker"


def test_nats_command_serves(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [*GENMESH, "nats", "--nats-port", str(port)],
        stdout=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert f"nats://127.0.0.1:{port}" in line
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_kv_events_settings_the_engines_would_refuse_stop_the_command() -> None:
    cases = [
        (["testkit", "sglang", "--kv-events-config", '{"publisher": "kafka"}'],
         "genmesh: Unknown event publisher 'kafka'"),
        (["worker", "--engine-kv-events", "tcp://h:5557"],
         "genmesh: --engine-kv-events is for an SGLang/vLLM server; the mock engine reports "
         "its own cache"),
        (["worker", "--engine", "sglang", "--engine-url", "http://h:1",
          "--engine-kv-events", "tcp://*:5557"],
         "genmesh: --engine-kv-events tcp://*:5557: connect to the engine's host, not to * "
         "(that is where it binds)"),
    ]  # fmt: skip
    for argv, reason in cases:
        out = subprocess.run(
            [*GENMESH, *argv], capture_output=True, text=True, timeout=30, env=clean_env()
        )
        assert out.returncode == 2, out.stderr
        assert reason in out.stderr
        assert "Traceback" not in out.stderr


def test_testkit_publishes_kv_events_from_its_process() -> None:
    port = free_port()
    config = '{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}'
    proc = subprocess.Popen(
        [*GENMESH, "testkit", "sglang", "--port", str(port), "--block-size", "4",
         "--kv-events-config", config],
        env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _get(base + "/health") is not None, timeout=20, what="the testkit")
        body = json.dumps({"input_ids": list(range(9)), "sampling_params": {"max_new_tokens": 1}})
        urllib.request.urlopen(base + "/generate", body.encode(), timeout=10).read()
        state = json.loads(_get(base + "/testkit/kv_events") or "{}")
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert state["published"] == 1  # the prompt's two full pages, in one step's batch
    assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", state["endpoint"])
    assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", state["replay_endpoint"])


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return str(r.read().decode())
    except OSError:
        return None


# ------------------------------------------------ options checked before anything starts


class ForeignServer(http.server.HTTPServer):
    """Another program's server, answering 200 to everything (its /health too)."""

    def __init__(self, port: int, *, reuse_port: bool) -> None:
        self.reuse_port = reuse_port
        super().__init__(("127.0.0.1", port), _Ok)

    def server_bind(self) -> None:
        if self.reuse_port:  # as a server that shares its port with its own copies does
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        super().server_bind()


class _Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.mark.parametrize("reuse_port", [False, True], ids=["plain", "so_reuseport"])
def test_up_on_a_port_another_server_has_stops_before_starting_anything(
    reuse_port: bool,
) -> None:
    """Its frontend could not listen (or, with SO_REUSEPORT on both sides, would share the
    port with the other server): refused at once, with nothing started."""
    port = free_port()
    foreign = ForeignServer(port, reuse_port=reuse_port)
    threading.Thread(target=foreign.serve_forever, daemon=True).start()
    frontends = "2" if reuse_port else "1"
    try:
        started = time.monotonic()
        out = subprocess.run(
            [*GENMESH, "up", "--port", str(port), "--frontends", frontends],
            capture_output=True,
            text=True,
            timeout=60,
            env=clean_env(GENMESH_MOCK_SPEEDUP="0"),
        )
        elapsed = time.monotonic() - started
    finally:
        foreign.shutdown()
        foreign.server_close()
    assert out.returncode == 2, out.stderr
    assert out.stderr == (
        f"genmesh up: cannot listen on 127.0.0.1:{port} (Address already in use): another "
        "server has it; choose another --port\n"
    )
    assert out.stdout == ""  # no "genmesh is up"
    assert elapsed < 10


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["up", "--workers", "0"],
         "genmesh up: --workers 0 with no --prefill-workers or --decode-workers leaves the "
         "mesh without a worker, and its frontend never ready: give --workers 1 or more"),
        (["up", "--port", "0"],
         "genmesh up: --port 0: up needs a fixed --port: it waits for its frontends there "
         "(and --frontends above 1 share it)"),
        (["up", "--namespace", "a.b"],
         "genmesh up: error: argument --namespace: 'a.b' must be 1-64 characters of "
         "A-Z a-z 0-9 _ - (see genmesh up --help)"),
        (["request", "--namespace", "a.b", "--input-ids", "1"],
         "genmesh request: error: argument --namespace: 'a.b' must be 1-64 characters of "
         "A-Z a-z 0-9 _ - (see genmesh request --help)"),
        (["request", "--timeout", "-5", "--input-ids", "1"],
         "genmesh request: error: argument --timeout: '-5' must be a number above 0 "
         "(see genmesh request --help)"),
    ],
)  # fmt: skip
def test_bad_options_are_one_line_before_anything_starts(argv: list[str], error: str) -> None:
    """Each used to start (up: NATS, routers, workers; request: a NATS connection) and fail
    30 s later, or with a traceback, or after retrying four times."""
    started = time.monotonic()
    out = subprocess.run(
        [*GENMESH, *argv, "--nats-url", "nats://127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert out.returncode == 2
    assert out.stderr == error + "\n"
    assert time.monotonic() - started < 10


def test_request_stopped_by_sigterm_cancels_at_the_worker(empty_mesh: InProcessMesh) -> None:
    empty_mesh.add_router()
    empty_mesh.add_frontend()
    worker = empty_mesh.add_worker(speedup=0.05)
    proc = subprocess.Popen(
        [
            *GENMESH, "request", "--nats-url", empty_mesh.nats_url,
            "--namespace", empty_mesh.namespace, "--input-ids", "1,2",
            "--max-tokens", "20000", "--ignore-eos",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        kinds = [json.loads(proc.stdout.readline())["t"] for _ in range(2)]
        assert kinds == ["ack", "out"]
        assert card(empty_mesh, worker.name)["inflight"] == 1
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err

    def cancelled() -> bool:
        now = card(empty_mesh, worker.name)
        return bool(now["stats"]["cancelled"] == 1 and now["inflight"] == 0)

    wait_until(cancelled, timeout=5, what="the worker to stop the request")


@pytest.mark.parametrize(
    ("sampling", "argv", "tokens"),
    [({}, [], 16), ({}, ["--max-tokens", "3"], 3), ({"max_tokens": 2}, ["--max-tokens", "3"], 2)],
    ids=["default", "flag", "envelope-wins"],
)
def test_request_envelope_without_a_budget_gets_max_tokens(
    mesh: AnyMesh, tmp_path: Path, sampling: dict[str, int], argv: list[str], tokens: int
) -> None:
    """Without one, the mock writes its whole context: 32k lines."""
    envelope = tmp_path / "envelope.json"
    envelope.write_text(
        json.dumps({"token_ids": [1, 2, 3], "sampling": {"ignore_eos": True, **sampling}})
    )
    out = subprocess.run(
        [
            *GENMESH, "request", "--nats-url", mesh.nats_url, "--namespace", mesh.namespace,
            "--envelope", str(envelope), "--codec", "json", *argv,
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean_env(),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    frames = [json.loads(line) for line in out.stdout.splitlines()]
    assert frames[-1]["t"] == "end"
    assert frames[-1]["usage"]["completion_tokens"] == tokens

"""Disconnect -> engine abort latency through the whole mesh, with a real HTTP engine.

    .venv/bin/python benchmarks/bench_cancel.py [--trials 200] [--chunks 3]
        [--token-delay-ms 20] [--json FILE] [--keep-logs]

Starts a nats-server, a mock SGLang server (`genmesh testkit sglang`), a worker with
`--engine sglang` in front of it, a router and a frontend, each its own process. Each trial
opens an SSE `/generate` request on a new connection, reads `--chunks` events, closes the
connection, and measures how long until the engine's `/abort_request` call for it arrived:
the mock server stamps each abort call with its arrival time (`abort_calls` in
`GET /testkit/state`), and the benchmark stamps the close with the same clock (`time.time()`
on one machine). The path measured: the frontend notices the disconnect, cancels its
handler, publishes a cancel on NATS; the worker cancels the request's task; the SGLang
adapter posts `/abort_request`. Prints p50/p90/p99. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from genmesh.shared.natsserver import NatsServer

NAMESPACE = "bench-cancel"
READY_TIMEOUT_S = 30.0
TRIAL_TIMEOUT_S = 5.0
POLL_S = 0.05


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it if the benchmark dies without cleaning up."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


class Processes:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.nats: NatsServer | None = None

    def start_nats(self) -> str:
        self.nats = NatsServer()
        return self.nats.start()

    def spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GENMESH_")}
        with (self.workdir / f"{name}.log").open("wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "genmesh", *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        self.procs.append((name, process))
        return process

    def check_alive(self) -> None:
        for name, process in self.procs:
            if process.poll() is not None:
                log = (self.workdir / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with {process.returncode}:\n{log}")

    def stop_all(self) -> None:
        for _, process in reversed(self.procs):  # frontend first, the engine last
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        if self.nats is not None:
            self.nats.stop()


async def wait_ok(session: aiohttp.ClientSession, url: str, procs: Processes) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        procs.check_alive()
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status == 200:
                    return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not answer 200 within {READY_TIMEOUT_S:g}s")


async def engine_state(session: aiohttp.ClientSession, engine_url: str) -> dict[str, Any]:
    async with session.get(engine_url + "/testkit/state") as r:
        state: dict[str, Any] = await r.json()
        return state


async def trial(
    session: aiohttp.ClientSession,
    frontend_url: str,
    engine_url: str,
    index: int,
    chunks: int,
) -> tuple[float, float]:
    """One disconnect; (seconds from the close to the abort's arrival, time to first chunk)."""
    calls_before = len((await engine_state(session, engine_url))["abort_calls"])
    body = {
        "input_ids": [index % 1000 + 1, 2, 3],
        "sampling_params": {"max_new_tokens": 30_000, "ignore_eos": True},
        "stream": True,
    }
    started = time.monotonic()
    resp = await session.post(frontend_url + "/generate", json=body)
    if resp.status != 200:
        raise RuntimeError(f"trial {index}: HTTP {resp.status}: {await resp.text()}")
    first = 0.0
    for n in range(chunks):
        event = await resp.content.readuntil(b"\n\n")
        if not event.startswith(b"data: {"):
            raise RuntimeError(f"trial {index}: unexpected event {event[:200]!r}")
        if n == 0:
            first = time.monotonic() - started
    closed = time.time()
    resp.close()  # drops the connection: the client is gone
    deadline = time.monotonic() + TRIAL_TIMEOUT_S
    # The time is stamped by the engine; polling slowly keeps it out of the way meanwhile.
    await asyncio.sleep(POLL_S)
    while time.monotonic() < deadline:
        state = await engine_state(session, engine_url)
        calls = state["abort_calls"]
        if len(calls) > calls_before and not state["running"]:
            if len(calls) != calls_before + 1:
                raise RuntimeError(f"trial {index}: {len(calls) - calls_before} abort calls")
            return float(calls[-1]["at"]) - closed, first
        await asyncio.sleep(POLL_S)
    raise RuntimeError(f"trial {index}: no /abort_request within {TRIAL_TIMEOUT_S:g}s")


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(p / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


async def run(args: argparse.Namespace, procs: Processes) -> dict[str, Any]:
    nats_url = procs.start_nats()
    engine_port, http_port = free_port(), free_port()
    engine_url = f"http://127.0.0.1:{engine_port}"
    frontend_url = f"http://127.0.0.1:{http_port}"
    procs.spawn(
        "sglang",
        "testkit", "sglang", "--port", str(engine_port),
        "--token-delay-ms", str(args.token_delay_ms),
    )  # fmt: skip
    common = ["--nats-url", nats_url, "--namespace", NAMESPACE, "--log-level", "warning"]
    async with aiohttp.ClientSession() as session:
        await wait_ok(session, engine_url + "/health", procs)
        procs.spawn("worker", "worker", *common, "--engine", "sglang", "--engine-url", engine_url)
        procs.spawn("router", "router", *common)
        procs.spawn("frontend", "frontend", *common, "--port", str(http_port))
        await wait_ok(session, frontend_url + "/health", procs)

        latencies: list[float] = []
        firsts: list[float] = []
        for i in range(args.warmup + args.trials):
            latency, first = await trial(session, frontend_url, engine_url, i, args.chunks)
            if i >= args.warmup:
                latencies.append(latency)
                firsts.append(first)
            if (i + 1) % 50 == 0:
                print(f"  {i + 1} trials", file=sys.stderr)
        state = await engine_state(session, engine_url)
        procs.check_alive()
    ms = [x * 1000 for x in latencies]
    return {
        "config": vars(args),
        "environment": {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
        },
        "trials": len(ms),
        "abort_ms": {
            "p50": percentile(ms, 50),
            "p90": percentile(ms, 90),
            "p99": percentile(ms, 99),
            "min": min(ms),
            "max": max(ms),
            "mean": statistics.fmean(ms),
        },
        "first_chunk_ms_p50": percentile([x * 1000 for x in firsts], 50),
        "engine": {
            "received": state["received"],
            "completed": state["completed"],
            "abort_calls": len(state["abort_calls"]),
            "running": len(state["running"]),
        },
        "samples_ms": ms,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=200, help="measured disconnects")
    parser.add_argument("--warmup", type=int, default=10, help="unmeasured disconnects first")
    parser.add_argument("--chunks", type=int, default=3, help="SSE events read before closing")
    parser.add_argument(
        "--token-delay-ms", type=float, default=20.0, help="the mock SGLang server's delay"
    )
    parser.add_argument("--json", default=None, help="also save the results (with samples)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the services' logs")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="genmesh-bench-cancel-"))
    procs = Processes(workdir)
    failed = True
    try:
        result = asyncio.run(run(args, procs))
        failed = False
    finally:
        procs.stop_all()
        if failed or args.keep_logs:
            print(f"logs: {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    a = result["abort_ms"]
    print(
        f"disconnect -> engine /abort_request, {result['trials']} trials "
        f"(SGLang mock, {args.token_delay_ms:g} ms/token, closed after {args.chunks} chunks)"
    )
    print(f"{'p50':>8} {'p90':>8} {'p99':>8} {'min':>8} {'max':>8} {'mean':>8}  (ms)")
    print(" ".join(f"{a[k]:8.2f}" for k in ("p50", "p90", "p99", "min", "max", "mean")))
    e = result["engine"]
    print(
        f"engine: {e['received']} requests received, {e['abort_calls']} abort calls, "
        f"{e['completed']} completed, {e['running']} still running"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

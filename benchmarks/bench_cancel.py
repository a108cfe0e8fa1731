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
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench_generate import mesh_connection, start_mesh
from genmesh.services.worker.config import WorkerProcessConfig
from genmesh.supervisor import Supervisor, clean_environment, free_port, wait_http_ok
from genmesh.testkit.config import MockServerConfig, TestkitConfig

TRIAL_TIMEOUT_S = 5.0
POLL_S = 0.05


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


async def run(args: argparse.Namespace, procs: Supervisor) -> dict[str, Any]:
    nats_url = procs.start_nats()
    engine_port, http_port = free_port(), free_port()
    engine_url = f"http://127.0.0.1:{engine_port}"
    frontend_url = f"http://127.0.0.1:{http_port}"
    server = MockServerConfig(token_delay_ms=args.token_delay_ms)
    procs.spawn_genmesh("sglang", TestkitConfig(engine="sglang", port=engine_port, server=server))
    async with aiohttp.ClientSession() as session:
        await wait_http_ok(engine_url + "/health", watch=procs.children, what="the SGLang mock")
        worker = WorkerProcessConfig(
            mesh=mesh_connection(nats_url), engine="sglang", engine_url=engine_url
        )
        start_mesh(procs, nats_url, http_port, worker)
        await wait_http_ok(frontend_url + "/health", watch=procs.children, what="the frontend")

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
    procs = Supervisor(logdir=workdir, env=clean_environment(prefixes=("GENMESH_",)))
    failed = True
    try:
        result = asyncio.run(run(args, procs))
        failed = False
    finally:
        procs.stop()
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

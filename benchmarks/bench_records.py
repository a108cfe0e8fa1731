"""What request trace records cost the frontend, and a large record-count check.

    .venv/bin/python benchmarks/bench_records.py [--requests 4000] [--repeats 3]
        [--concurrency 16] [--count-check 10000] [--json FILE]

Part 1, CPU per request, records on against off, in one run: one nats-server, one router,
one instant mock worker, and four frontends side by side (each its own process, same
mesh): `off` (no records), `devnull` (records serialised and written to /dev/null: no
compression), `file` (`--request-trace X.jsonl.gz`, records without payload) and `payload`
(the same with `--request-trace-payload`). A closed loop of `--concurrency`
clients sends `--requests` SGLang requests (32-token prompt, 16 tokens, half SSE, half
unary) to each frontend in turn, `--repeats` times in a rotating order; the figure is the
frontend process's CPU (user + system, all threads, from /proc/<pid>/stat) per request,
median over the repeats, read one second after each run so the sink's batch is written.

Part 2, the count check (`--count-check N`, 0 skips it): a mesh of three mock workers (one
takes injected `drop` faults, so requests that land on it migrate mid-stream), a frontend
writing payload records to rolling `.jsonl.gz` segments, and N requests of every kind
(unary, SSE, batch with n = 2, vLLM, a client that disconnects mid-stream, an invalid
request). Then the frontend gets SIGTERM, and `genmesh trace check --expect N` runs on the
segments; the migrations it counts must equal the faults the worker consumed, and the
cancellations the disconnects. Last, `genmesh trace replay` sends every recorded request
again to a new frontend of the same mesh (`--no-replay` skips it): every generation that
finished must come back with the same output hash.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import nats

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.mesh import Mesh, Service

from genmesh.shared.natsserver import NatsServer
from genmesh.shared.subjects import Subjects
from genmesh.supervisor import run_blocking, wait_http_ok

CLK_TCK = os.sysconf("SC_CLK_TCK")
PROMPT = [(7 * i + 1) % 50_000 for i in range(32)]


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    fields = data[data.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def add_frontend(mesh: Mesh, name: str, env: dict[str, str]) -> tuple[Service, str]:
    service = mesh.add_frontend("--log-level", "info", env=env, name=name)
    url = mesh.http_url
    run_blocking(wait_http_ok(url + "/health", timeout_s=30, watch=[service], what=name))
    return service, url


# --------------------------------------------------------------------------- part 1


async def load(url: str, requests: int, concurrency: int) -> int:
    """A closed loop; returns the number of failed requests."""
    bodies = [
        json.dumps(
            {
                "input_ids": PROMPT,
                "sampling_params": {"max_new_tokens": 16, "ignore_eos": True},
                "stream": stream,
            }
        ).encode()
        for stream in (False, True)
    ]
    headers = {"Content-Type": "application/json"}
    counter = iter(range(requests))
    failed = 0

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal failed
        for n in counter:
            async with session.post(url + "/generate", data=bodies[n % 2], headers=headers) as r:
                await r.read()
                failed += r.status != 200

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return failed


async def cpu_benchmark(args: argparse.Namespace, nats_url: str, workdir: Path) -> dict[str, Any]:
    mesh = Mesh(nats_url, workdir / "cpu", "benchrec", log_level="info")
    mesh.workdir.mkdir()
    try:
        mesh.add_router()
        mesh.add_worker(speedup=0.0, max_concurrency=1024)
        targets: dict[str, tuple[Service, str]] = {
            "off": add_frontend(mesh, "frontend-off", {}),
            "devnull": add_frontend(
                mesh, "frontend-devnull", {"GENMESH_REQUEST_TRACE": "/dev/null"}
            ),
            "file": add_frontend(
                mesh, "frontend-file", {"GENMESH_REQUEST_TRACE": str(workdir / "f.jsonl.gz")}
            ),
            "payload": add_frontend(
                mesh,
                "frontend-payload",
                {
                    "GENMESH_REQUEST_TRACE": str(workdir / "p.jsonl.gz"),
                    "GENMESH_REQUEST_TRACE_PAYLOAD": "1",
                },
            ),
        }
        for name, (_, url) in targets.items():
            await load(url, args.warmup, args.concurrency)
            say(f"warmed up {name}")
        per_request: dict[str, list[float]] = {name: [] for name in targets}
        names = list(targets)
        for repeat in range(args.repeats):
            order = names[repeat % len(names) :] + names[: repeat % len(names)]
            for name in order:
                service, url = targets[name]
                before = cpu_s(service.pid)
                started = time.perf_counter()
                failed = await load(url, args.requests, args.concurrency)
                wall = time.perf_counter() - started
                await asyncio.sleep(1.0)  # the sink's last batch lands in this run
                used = cpu_s(service.pid) - before
                per_request[name].append(used / args.requests * 1000)
                say(
                    f"repeat {repeat + 1} {name:8} {args.requests / wall:7.0f} req/s  "
                    f"frontend {used / args.requests * 1000:.3f} ms CPU/request  failed {failed}"
                )
        medians = {name: statistics.median(v) for name, v in per_request.items()}
        for service, _ in targets.values():
            service.terminate()
        return {"runs_ms_per_request": per_request, "median_ms_per_request": medians}
    finally:
        mesh.stop()


# --------------------------------------------------------------------------- part 2


async def one(session: aiohttp.ClientSession, url: str, kind: str, n: int) -> bool:
    prompt = [1000 + n % 5000, 7, *range(100, 100 + n % 48)]
    params = {"max_new_tokens": 8 + n % 9, "ignore_eos": True}
    if kind == "cancel":
        body: Any = {
            "input_ids": prompt,
            "sampling_params": {**params, "max_new_tokens": 64},
            "stream": True,
        }
        async with session.post(url + "/generate", json=body) as resp:
            if resp.status != 200:
                return False
            for _ in range(4):  # past the two tokens a faulty worker sends before it drops
                await resp.content.readuntil(b"\n\n")
        return True  # leaving the block closes the connection mid-stream
    path = "/generate"
    if kind == "invalid":
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": -1}}
    elif kind == "batch":
        body = {"input_ids": [prompt, prompt[:5]], "sampling_params": {**params, "n": 2}}
    elif kind == "vllm":
        path = "/inference/v1/generate"
        body = {"token_ids": prompt, "sampling_params": {"max_tokens": 10}, "stream": n % 2 == 0}
    else:
        body = {"input_ids": prompt, "sampling_params": params, "stream": kind == "sse"}
    async with session.post(url + path, json=body) as resp:
        await resp.read()
        return resp.status == (400 if kind == "invalid" else 200)


KINDS = ["unary"] * 8 + ["sse"] * 6 + ["cancel"] * 2 + ["batch", "vllm", "invalid"]


def count_check(args: argparse.Namespace, nats_url: str, workdir: Path) -> dict[str, Any]:
    mesh = Mesh(nats_url, workdir / "count", "benchcount")
    mesh.workdir.mkdir()
    path = workdir / "count-trace.jsonl.gz"
    total = args.count_check
    try:
        mesh.add_router()
        workers = [
            mesh.add_worker(
                speedup=args.count_speedup, testkit_faults=True, max_concurrency=1024, wait=False
            ).name
            for _ in range(3)
        ]
        frontend, url = add_frontend(
            mesh,
            "frontend",
            {
                "GENMESH_REQUEST_TRACE": str(path),
                "GENMESH_REQUEST_TRACE_PAYLOAD": "1",
                "GENMESH_REQUEST_TRACE_ROLL_LINES": "2500",
            },
        )
        mesh.wait_for_workers(lambda ids: set(workers) <= ids, what="workers")
        kinds = [KINDS[n % len(KINDS)] for n in range(total)]
        drops = total // 10
        started = time.perf_counter()
        failed, consumed = asyncio.run(
            drive_count(args, nats_url, mesh.namespace, url, workers[0], kinds, drops)
        )
        wall = time.perf_counter() - started
        stop_started = time.perf_counter()
        code = frontend.terminate(timeout=60)
        stop_s = time.perf_counter() - stop_started
        check = subprocess.run(
            [sys.executable, "-m", "genmesh", "trace", "check", str(path), "--expect", str(total)],
            capture_output=True,
            text=True,
        )
        check_json = subprocess.run(
            [sys.executable, "-m", "genmesh", "trace", "check", str(path), "--json"],
            capture_output=True,
            text=True,
        )
        summary = json.loads(check_json.stdout)
        replayed: dict[str, Any] = {}
        if args.replay:
            say(f"replaying the {total} records against a new frontend")
            _, url = add_frontend(mesh, "frontend-replay", {})
            started = time.perf_counter()
            replay = subprocess.run(
                [
                    sys.executable, "-m", "genmesh", "trace", "replay", str(path),
                    "--url", url, "--concurrency", str(args.concurrency), "--json",
                ],
                stdout=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            replayed = json.loads(replay.stdout)
            replayed["exit"] = replay.returncode
            replayed["wall_s"] = round(time.perf_counter() - started, 1)
            for key in ("mismatches", "errors"):
                replayed[key] = replayed[key][:10]
        segments = sorted(workdir.glob("count-trace.*.jsonl.gz"))
        return {
            "requests": total,
            "failed_client_side": failed,
            "wall_s": round(wall, 1),
            "frontend_exit": code,
            "frontend_stop_s": round(stop_s, 2),
            "disconnects_sent": kinds.count("cancel"),
            "invalid_sent": kinds.count("invalid"),
            "faults_consumed": consumed,
            "segments": len(segments),
            "segment_bytes": sum(s.stat().st_size for s in segments),
            "check_exit": check.returncode,
            "check_output": check.stdout.strip(),
            "summary": {k: v for k, v in summary.items() if k != "problems"},
            "problems": summary["problems"][:10],
            "migrations_match_faults": summary["migrations"] == consumed,
            "cancellations_match_disconnects": summary["by_error_type"].get("cancelled")
            == kinds.count("cancel"),
            "replay": replayed,
        }
    finally:
        mesh.stop()


async def drive_count(
    args: argparse.Namespace,
    nats_url: str,
    namespace: str,
    url: str,
    faulty: str,
    kinds: list[str],
    drops: int,
) -> tuple[int, int]:
    """Queue `drops` faults on `faulty`, send every request; (failed, faults consumed)."""
    nc = await nats.connect(nats_url)
    fault = {"kind": "drop", "after_tokens": 2, "count": drops}
    await nc.request(Subjects(namespace).testkit(faulty), json.dumps(fault).encode(), 5)
    total = len(kinds)
    counter = iter(range(total))
    failed = done = 0

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal failed, done
        for n in counter:
            try:
                ok = await one(session, url, kinds[n], n)
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            failed += not ok
            done += 1
            if done % 1000 == 0:
                say(f"  {done}/{total} requests, {failed} failed")

    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client(session) for _ in range(args.concurrency)))
    reply = await nc.request(Subjects(namespace).testkit(faulty), b"{}", 5)
    pending = json.loads(reply.data)["faults_pending"]
    await nc.close()
    return failed, drops - (pending[0]["count"] if pending else 0)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=4000, help="requests per measured run")
    p.add_argument("--warmup", type=int, default=300, help="warm-up requests per frontend")
    p.add_argument("--repeats", type=int, default=3, help="measured runs per frontend")
    p.add_argument("--concurrency", type=int, default=16, help="clients in flight")
    p.add_argument("--count-check", type=int, default=10_000, help="part 2 requests; 0 skips")
    p.add_argument(
        "--count-speedup", type=float, default=2.0, help="part 2 mock speed-up (cancels need it)"
    )
    p.add_argument("--skip-cpu", action="store_true", help="part 2 only")
    p.add_argument(
        "--no-replay", dest="replay", action="store_false", help="part 2 without the replay"
    )
    p.add_argument("--json", default=None, help="save the results here")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    server = NatsServer()
    nats_url = server.start()
    workdir = Path(tempfile.mkdtemp(prefix="bench-records-"))
    say(f"logs and records in {workdir}")
    results: dict[str, Any] = {"config": vars(args), "cpu_count": os.cpu_count()}
    try:
        if not args.skip_cpu:
            results["cpu"] = asyncio.run(cpu_benchmark(args, nats_url, workdir))
            m = results["cpu"]["median_ms_per_request"]
            say(
                "frontend CPU per request: "
                + ", ".join(f"{name} {ms:.3f} ms (+{ms - m['off']:.3f})" for name, ms in m.items())
            )
        if args.count_check:
            say(f"count check: {args.count_check} requests")
            results["count_check"] = count_check(args, nats_url, workdir)
    finally:
        server.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(args)
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    count = results.get("count_check")
    ok = count is None or (count["check_exit"] == 0 and count["replay"].get("exit", 0) == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

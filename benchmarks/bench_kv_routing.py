"""KV-cache-aware routing end to end: the shared-prefix workload of issue 13's anchor
against `genmesh up` with each policy.

    .venv/bin/python benchmarks/bench_kv_routing.py [--policies kv,round_robin,least_loaded]
        [--workload ../shared/peers/kv_workload.py] [--json FILE] [-- kv_workload options]

For each policy it starts `genmesh up` (4 mock workers with a paged prefix cache of 512
blocks of 16 tokens at speed-up 1, no router: the frontend routes, as Dynamo's frontend
does), warms nothing itself, and runs the anchor's load generator, `kv_workload.py
--model ""` (G=32 groups of 1,024-token prefixes + 32-token suffixes, 32 new tokens, c=16,
1,500 requests after 300 of warm-up; the same requests Dynamo got from `kv_anchor.sh`),
with the frontend's pid for its CPU. Everything after `--` goes to kv_workload.py
(`-- --dist zipf`, `-- -n 300 --warmup 60`). `--up-args` replaces the mock's cache options
(`--up-args="--mock-kv-blocks 1024"` for the 1,024-block row).

Prints one row per policy: req/s, TTFT p50/p90/p99 (ms), the prompt-token cache hit
ratio (the responses' `meta_info.cached_tokens` over their prompt tokens), the frontend's
CPU ms per request, routing CPU per request: the frontend's CPU above round robin's
(its policy costs nothing), so the index, the event stream and the choice together (on a
busy box this difference is within the noise: bench_kv_index.py times the parts), and
the KV event messages the workers published per request (warm-up included), each of
which every process routing with `kv` decodes and applies. The bench starts the NATS
server itself (to count those) and hands its URL to `up`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import nats
from nats.aio.msg import Msg

from bench_generate import loadavg, run_benchmark, say
from genmesh.shared.lifecycle import PID_HEADER
from genmesh.shared.settings import parse
from genmesh.shared.subjects import Subjects
from genmesh.supervisor import Supervisor, clean_environment, free_port, wait_http_ok
from genmesh.up.config import UpConfig

HERE = Path(__file__).resolve().parent
WORKLOAD = HERE.parent.parent / "shared" / "peers" / "kv_workload.py"
CACHE_ARGS = "--mock-kv-blocks 512 --mock-block-size 16"
READY_TIMEOUT_S = 60.0


async def frontend_pid(url: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(url + "/health") as reply:
        return int(reply.headers[PID_HEADER])


async def first_request(url: str) -> None:
    """One request through, so every worker is known and serving before the clock runs."""
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    async with aiohttp.ClientSession() as session:
        for _ in range(100):
            async with session.post(url + "/generate", json=body) as reply:
                if reply.status == 200:
                    return
            await asyncio.sleep(0.1)
    raise RuntimeError("the mesh answers no /generate")


async def drive(command: list[str], nats_url: str, subjects: Subjects) -> int:
    """Run the load generator; how many KV event messages the workers published meanwhile
    (each one every process routing with `kv` decodes and applies)."""
    nc = await nats.connect(nats_url)
    count = 0

    async def counted(msg: Msg) -> None:
        nonlocal count
        count += 1

    try:
        await nc.subscribe(subjects.kv_events_all, cb=counted)
        await nc.flush()
        load = await asyncio.create_subprocess_exec(*command, stdout=subprocess.DEVNULL)
        await load.wait()
        await nc.flush()
    finally:
        await nc.close()
    return count


def run_policy(
    args: argparse.Namespace, policy: str, workdir: Path, live: list[Supervisor]
) -> dict[str, Any]:
    port = free_port()
    up = parse(
        UpConfig,
        [
            "--workers", str(args.workers), "--routers", "0", "--router-policy", policy,
            "--mock-speedup", str(args.speedup), "--port", str(port),
            *shlex.split(args.up_args),
        ],
        environ={},
    )  # fmt: skip
    logdir = workdir / policy
    logdir.mkdir()
    procs = Supervisor(logdir=logdir, env=clean_environment(prefixes=("GENMESH_",)))
    live.append(procs)
    try:
        nats_url = procs.start_nats()
        up = replace(up, mesh=replace(up.mesh, nats_url=nats_url))
        child = procs.spawn_genmesh("up", up)
        url = f"http://127.0.0.1:{port}"
        asyncio.run(wait_http_ok(url + "/health", timeout_s=READY_TIMEOUT_S, watch=[child]))
        asyncio.run(first_request(url))
        pid = asyncio.run(frontend_pid(url))
        out = workdir / f"{policy}.json"
        command = [
            sys.executable, str(args.workload), "--url", url, "--model", "",
            "--frontend-pid", str(pid), "--label", policy, "--json-out", str(out),
            *args.workload_args,
        ]  # fmt: skip
        say(f"{policy}: {shlex.join(command[1:])}")
        messages = asyncio.run(drive(command, nats_url, Subjects(up.mesh.namespace)))
        result: dict[str, Any] = json.loads(out.read_text().splitlines()[-1])
        result["kv_messages"] = messages
        return result
    finally:
        procs.stop()
        live.remove(procs)


def render(rows: list[dict[str, Any]]) -> str:
    base = next((r for r in rows if r["label"] == "round_robin"), None)
    lines = [
        f"{'policy':<13} {'req/s':>6} {'TTFT p50':>8} {'p90':>7} {'p99':>7} {'hit':>6} "
        f"{'fe ms/req':>9} {'routing':>7} {'kv msg/req':>10} {'errors':>6}"
    ]
    for r in rows:
        hit = r.get("resp_cache_hit_ratio")
        cpu = r.get("frontend_cpu_ms_per_req")
        routing = (
            f"{cpu - base['frontend_cpu_ms_per_req']:7.3f}"
            if base is not None and cpu is not None and r is not base
            else f"{'-':>7}"
        )
        lines.append(
            f"{r['label']:<13} {r['rps']:>6.1f} {r['ttft_ms']['p50']:>8.1f} "
            f"{r['ttft_ms']['p90']:>7.1f} {r['ttft_ms']['p99']:>7.1f} "
            f"{(f'{hit:.3f}' if hit is not None else '-'):>6} "
            f"{(f'{cpu:.3f}' if cpu is not None else '-'):>9} {routing} "
            f"{r['kv_messages'] / (r['n'] + r['warmup']):>10.2f} {r['errors']:>6}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else argv
    workload_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, workload_args = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default="kv,round_robin,least_loaded")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--speedup", type=float, default=1.0, help="the mock's --mock-speedup")
    p.add_argument("--up-args", default=CACHE_ARGS, help="the mock's cache options for `up`")
    p.add_argument("--workload", type=Path, default=WORKLOAD, help="path to kv_workload.py")
    p.add_argument("--json", help="save every policy's kv_workload result")
    p.add_argument("--keep-logs", action="store_true")
    args = p.parse_args(argv)
    args.workload_args = workload_args
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="genmesh-kv-routing-"))
    live: list[Supervisor] = []

    def body() -> dict[str, Any]:
        started = time.monotonic()
        start_load = loadavg()
        rows = [run_policy(args, p, workdir, live) for p in args.policies.split(",")]
        print()
        print(
            f"genmesh kv routing: {args.workers} mock workers ({args.up_args}, speed-up "
            f"{args.speedup:g}), frontend routing, kv_workload.py --model '' "
            f"{shlex.join(args.workload_args)}; loadavg {' '.join(start_load)} -> "
            f"{' '.join(loadavg())}"
        )
        print(
            "TTFT in ms; hit = prompt tokens served from cache / prompt tokens; fe ms/req = "
            "frontend CPU per request; routing = fe ms/req above round_robin's"
        )
        print()
        print(render(rows), flush=True)
        print(f"\n(took {time.monotonic() - started:.0f} s)")
        return {"config": {k: str(v) for k, v in vars(args).items()}, "rows": rows}

    def stop() -> None:
        for procs in live:
            procs.stop()

    return run_benchmark(body, stop, workdir, args.keep_logs, args.json)


if __name__ == "__main__":
    sys.exit(main())

"""How the mesh scales on this box: req/s and CPU per request with 1-2 frontends, 1-4
workers, 1-2 routers, and the ceiling of one frontend process.

    .venv/bin/python benchmarks/bench_scaling.py [--frontends 1,2] [--workers 1,2,4]
        [--routers 1,2] [--routing auto] [--requests 2000] [--concurrency 32]
        [--output-tokens 16] [--mode sse] [--repeats 1] [--json FILE]

For every combination it starts a fresh mesh with genmesh's supervisor (a nats-server,
the routers, instant mock workers, the frontends: several share one port with SO_REUSEPORT,
as `genmesh up --frontends` runs them), waits until it serves, warms it up, and runs
bench_generate's closed loop against it. It prints one row per combination: req/s,
latency, the server CPU per request by process (frontends summed, workers summed), the load
generator's own CPU (it runs here and competes for the same cores), how busy the box and
each frontend were, and the frontend ceiling: 1000 / the frontend CPU ms per request, the
req/s at which one frontend process would fill its core. Ctrl-C stops everything.

Routing: when the frontend has a `--routing` option (frontend: it picks the worker itself;
routers: through the router processes), `auto` measures each router count with
`--routing routers` and adds rows with `--routing frontend` (routers then idle); without the
option every row goes through the routers, as frontends always did.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from bench_generate import (
    NAMESPACE,
    REQUEST_TIMEOUT_S,
    Target,
    _csv_ints,
    environment,
    instant_worker,
    loadavg,
    mesh_connection,
    run_benchmark,
    run_load,
    say,
    wait_generate_ok,
)
from genmesh.services.frontend.config import FrontendConfig
from genmesh.services.router.config import RouterConfig
from genmesh.supervisor import Supervisor, clean_environment, free_port, wait_discovered

READY_TIMEOUT_S = 30.0
PROCS = ("frontend", "router", "worker", "nats")


@dataclass(frozen=True)
class Shape:
    frontends: int
    workers: int
    routers: int
    routing: str  # "routers", "frontend", or "" (the frontend has no --routing option)

    @property
    def label(self) -> str:
        return f"fe={self.frontends} w={self.workers} r={self.routers} {self.routing or '-'}"


def frontend_routing_modes() -> set[str]:
    """The frontend's --routing choices, read from `genmesh frontend --help` (empty when
    this genmesh has no such option: then every request goes through a router)."""
    out = subprocess.run(
        [sys.executable, "-m", "genmesh", "frontend", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    if "--routing" not in out:
        return set()
    return {mode for mode in ("frontend", "routers") if mode in out.split("--routing", 1)[1]}


def shapes(args: argparse.Namespace, supported: set[str]) -> list[Shape]:
    if args.routing == "auto":
        modes = ["routers", "frontend"] if supported else [""]
    else:
        modes = [m.strip() for m in args.routing.split(",") if m.strip()]
        unknown = set(modes) - supported
        if unknown:
            raise SystemExit(f"this genmesh's frontend has no --routing {', '.join(unknown)}")
    out = []
    for mode in modes:
        # Frontend routing leaves the routers idle: one router count says it all.
        routers = [min(args.routers)] if mode == "frontend" else args.routers
        for f in args.frontends:
            for w in args.workers:
                for r in routers:
                    out.append(Shape(f, w, r, mode))
    return out


def start(procs: Supervisor, shape: Shape, port: int) -> tuple[str, list[str], list[str]]:
    """nats, routers, workers, frontends of `shape`; (nats URL, worker ids, router ids)."""
    nats_url = procs.start_nats()
    mesh = mesh_connection(nats_url)
    routers = [RouterConfig(mesh=mesh) for _ in range(shape.routers)]
    for index, router in enumerate(routers, 1):
        procs.spawn_genmesh(f"router-{index}", router)
    workers = [instant_worker(nats_url) for _ in range(shape.workers)]
    for index, worker in enumerate(workers, 1):
        procs.spawn_genmesh(f"worker-{index}", worker)
    frontend = FrontendConfig(
        mesh=mesh, host="127.0.0.1", port=port, reuse_port=shape.frontends > 1
    )
    # Through the environment, which a frontend without the option ignores.
    env = {"GENMESH_ROUTING": shape.routing} if shape.routing else {}
    for index in range(1, shape.frontends + 1):
        procs.spawn_genmesh(f"frontend-{index}", frontend, env=env)
    return (
        nats_url,
        [w.service.worker_id for w in workers],
        [r.router_id for r in routers],
    )


async def measure(args: argparse.Namespace, shape: Shape, procs: Supervisor) -> dict[str, Any]:
    port = free_port()
    nats_url, worker_ids, router_ids = await asyncio.to_thread(start, procs, shape, port)
    await wait_discovered(
        nats_url,
        NAMESPACE,
        workers=worker_ids,
        routers=router_ids,
        timeout_s=READY_TIMEOUT_S,
        watch=procs.children,
    )
    assert procs.nats is not None
    assert procs.nats.pid is not None
    pids = {role: [c.pid for c in procs.children if c.role == role] for role in PROCS[:3]} | {
        "nats": [procs.nats.pid]
    }
    target = Target("mesh", f"http://127.0.0.1:{port}", pids)
    load = {
        "mode": args.mode,
        "concurrency": args.concurrency,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "procs": procs,
    }
    # Fresh connections, so that each frontend answers a readiness request (8 per frontend:
    # the kernel picks one by a hash of the connection's address).
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as probe:
        for _ in range(8 * shape.frontends):
            await wait_generate_ok(replace(target, session=probe), procs)
    target.session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=args.concurrency, keepalive_timeout=120),
        timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
    )
    try:
        await run_load(target, requests=args.warmup, measure=False, **load)
        runs = []
        for _ in range(args.repeats):
            run = await run_load(target, requests=args.requests, **load)
            summary = run.summary()
            frontend_ms = run.cpu_ms["frontend"]
            busy_ms = sum(run.cpu_ms.values()) + run.client_cpu_ms
            summary["frontend_core_pct"] = (
                100.0 * frontend_ms / 1000.0 / run.wall_s / shape.frontends
            )
            summary["box_cpu_pct"] = 100.0 * busy_ms / 1000.0 / run.wall_s / (os.cpu_count() or 1)
            per_req = frontend_ms / run.requests
            summary["frontend_ceiling_req_s"] = 1000.0 / per_req if per_req else float("nan")
            runs.append(summary)
            say(
                f"{shape.label:<28} {summary['req_s']:7.0f} req/s  "
                f"cpu {summary['cpu_ms_per_req']:.3f} ms/req  errors {summary['errors']}"
            )
    finally:
        await target.session.close()
    return {"shape": shape.__dict__, "median": median_of(runs), "repeats": runs}


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {
        k: statistics.median(r[k] for r in runs)
        for k, v in runs[0].items()
        if isinstance(v, int | float)
    }
    out["errors"] = sum(r["errors"] for r in runs)
    out["cpu_ms_per_req_by_proc"] = {
        p: statistics.median(r["cpu_ms_per_req_by_proc"][p] for r in runs)
        for p in runs[0]["cpu_ms_per_req_by_proc"]
    }
    return out


COLUMNS = (
    # header, width, format
    ("fe", 2, "d"),
    ("wk", 2, "d"),
    ("rt", 2, "d"),
    ("routing", 8, "s"),
    ("req/s", 7, ".0f"),
    ("p50", 6, ".2f"),
    ("p99", 6, ".2f"),
    ("err", 3, "d"),
    ("cpu/req", 7, ".3f"),
    ("fe", 6, ".3f"),
    ("router", 6, ".3f"),
    ("worker", 6, ".3f"),
    ("nats", 6, ".3f"),
    ("client", 6, ".3f"),
    ("box%", 5, ".0f"),
    ("fe%", 5, ".0f"),
    ("fe-ceil", 7, ".0f"),
)


def render(rows: list[dict[str, Any]]) -> str:
    header = "  ".join(f"{h:<{w}}" if f == "s" else f"{h:>{w}}" for h, w, f in COLUMNS)
    lines = [header.rstrip(), "-" * len(header)]
    for row in rows:
        s, m = row["shape"], row["median"]
        by = m["cpu_ms_per_req_by_proc"]
        values = (
            s["frontends"], s["workers"], s["routers"], s["routing"] or "-", m["req_s"],
            m["lat_p50_ms"], m["lat_p99_ms"], int(m["errors"]), m["cpu_ms_per_req"],
            by["frontend"], by["router"], by["worker"], by["nats"], m["client_cpu_ms_per_req"],
            m["box_cpu_pct"], m["frontend_core_pct"], m["frontend_ceiling_req_s"],
        )  # fmt: skip
        cells = [
            f"{v:<{w}}" if f == "s" else f"{v:>{w}{f}}"
            for (_, w, f), v in zip(COLUMNS, values, strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="genmesh scaling: frontends x workers x routers on this box",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--frontends", type=_csv_ints, default=[1, 2], help="e.g. 1,2")
    p.add_argument("--workers", type=_csv_ints, default=[1, 2, 4], help="e.g. 1,2,3,4")
    p.add_argument("--routers", type=_csv_ints, default=[1, 2], help="e.g. 1,2")
    p.add_argument(
        "--routing",
        default="auto",
        help="auto, or a comma list of the frontend's --routing modes (routers,frontend)",
    )
    p.add_argument("--requests", type=int, default=2000, help="requests per measured run")
    p.add_argument("--concurrency", type=int, default=32, help="closed-loop clients")
    p.add_argument("--mode", choices=("sse", "unary"), default="sse")
    p.add_argument("--output-tokens", type=int, default=16, help="max_new_tokens per request")
    p.add_argument("--prompt-tokens", type=int, default=6, help="input_ids per request")
    p.add_argument("--repeats", type=int, default=1, help="measured runs per combination")
    p.add_argument("--warmup", type=int, default=200, help="warm-up requests per combination")
    p.add_argument("--json", metavar="FILE", help="also save every result as JSON")
    p.add_argument("--keep-logs", action="store_true", help="keep the service logs")
    args = p.parse_args(argv)
    if min(args.requests, args.repeats, args.concurrency, args.output_tokens) < 1:
        p.error("--requests, --repeats, --concurrency and --output-tokens must be at least 1")
    return args


async def bench(args: argparse.Namespace, workdir: Path, live: list[Supervisor]) -> list[Any]:
    supported = frontend_routing_modes()
    plan = shapes(args, supported)
    say(f"{len(plan)} combinations; frontend --routing: {', '.join(sorted(supported)) or 'none'}")
    rows = []
    for shape in plan:
        logdir = workdir / shape.label.replace(" ", "_").replace("=", "")
        logdir.mkdir()
        procs = Supervisor(logdir=logdir, env=clean_environment(prefixes=("GENMESH_",)))
        live.append(procs)
        try:
            rows.append(await measure(args, shape, procs))
        finally:
            await asyncio.to_thread(procs.stop)
            live.remove(procs)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="genmesh-scaling-"))
    live: list[Supervisor] = []  # the mesh being measured, for the cleanup below

    def body() -> dict[str, Any]:
        env = environment()
        started = time.monotonic()
        rows = asyncio.run(bench(args, workdir, live))
        env["loadavg_at_end"] = loadavg()
        print()
        print(
            f"genmesh scaling: /generate {args.mode}, {args.requests} requests per run at "
            f"c={args.concurrency}, prompt {args.prompt_tokens} / output {args.output_tokens} "
            f"tokens, instant mock workers, median of {args.repeats}; {env['cpus']} CPUs, "
            f"loadavg {' '.join(env['loadavg_at_start'])} -> {' '.join(env['loadavg_at_end'])}"
        )
        print(
            "fe/wk/rt = frontends/workers/routers; latencies in ms; cpu = server CPU ms per "
            "request, then by process (all frontends, all routers, all workers, nats); "
            "client = the load generator's CPU ms per request (same box); box% = all of it "
            "over every core; fe% = how busy each frontend's core was; fe-ceil = 1000 / the "
            "frontend ms per request: the req/s at which one frontend fills its core"
        )
        print()
        print(render(rows), flush=True)
        elapsed = time.monotonic() - started
        print(f"\n(took {elapsed:.0f} s)")
        return {"config": vars(args), "env": env, "rows": rows, "elapsed_s": elapsed}

    def stop() -> None:
        for procs in live:
            procs.stop()

    return run_benchmark(body, stop, workdir, args.keep_logs, args.json)


if __name__ == "__main__":
    sys.exit(main())

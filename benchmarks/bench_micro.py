"""What answering `$SRV` (NATS micro, docs/protocol.md §16) costs a request: the mesh
before it against the mesh with it, in one run.

    .venv/bin/python benchmarks/bench_micro.py [--baseline REV] [--requests N]
        [--concurrency C] [--rounds R] [--output-tokens T] [--json]

Two meshes on one nats-server, each a router and an instant mock worker (`--mock-speedup
0`) as processes: `before` runs the sources of `--baseline` (a git revision, default
386aeaf, the commit `$SRV` was built on; extracted with `git archive` and put first on the
children's PYTHONPATH), `after` the sources of this checkout. A NATS-level client
(`MeshClient`, in this process) sends each mesh N requests through its router, C at a time,
T tokens each; the meshes take turns (the order flips every round). Per round and mesh:
the CPU (user + system, from /proc) its router and worker spent, per request, and the
wall-clock rate. Then `$SRV.STATS` is asked of the `after` mesh while it serves, to show
the answers cost nothing to requests either.

Also timed in this process: the counting one message costs an endpoint
(`MicroEndpoint.received` + `handled`), the only work `$SRV` adds per request.

Prints the medians over R rounds, and the median of the rounds' differences (after minus
before, each round's two meshes measured back to back).
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
import timeit
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats

from genmesh.client import MeshClient, request
from genmesh.engines.mock import MockConfig
from genmesh.services.router.config import RouterConfig
from genmesh.services.worker.config import WorkerConfig, WorkerProcessConfig
from genmesh.shared.connection import MeshConnection
from genmesh.shared.micro import MicroEndpoint
from genmesh.supervisor import Child, Supervisor, wait_discovered

ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
BASELINE = "386aeaf"  # main before $SRV


@dataclass
class Mesh:
    name: str
    namespace: str
    children: list[Child]
    cpu_us: list[float] = field(default_factory=list)  # per request, router + worker
    rate: list[float] = field(default_factory=list)  # requests per second


def cpu_ticks(pid: int) -> int:
    """utime + stime of `pid`, in clock ticks (fields 14 and 15 of /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def baseline_sources(rev: str, into: Path) -> Path:
    """`rev`'s `src/` under `into` (git archive: no worktree, nothing else touched)."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "src"], check=True, capture_output=True
    )
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into / "src"


def start(procs: Supervisor, url: str, name: str, pythonpath: str) -> Mesh:
    namespace = f"bench-{name}"
    mesh = MeshConnection(url, namespace, log_level="warning")
    env = {"PYTHONPATH": pythonpath}
    router = procs.spawn_genmesh(
        f"{name}-router", RouterConfig(mesh=mesh, router_id=f"r-{name}"), env=env
    )
    worker = WorkerProcessConfig(
        mesh=mesh, service=WorkerConfig(worker_id=f"w-{name}"), mock=MockConfig(speedup=0.0)
    )
    return Mesh(name, namespace, [router, procs.spawn_genmesh(f"{name}-worker", worker, env=env)])


async def drive(url: str, mesh: Mesh, requests: int, concurrency: int, tokens: int) -> None:
    """`requests` requests through `mesh`'s router, `concurrency` at a time; each must end
    with its `tokens` tokens."""
    async with await MeshClient.connect(url, mesh.namespace) as client:
        left = iter(range(requests))

        async def one_client() -> None:
            for i in left:
                envelope = request([1, 2, i % 1000], max_tokens=tokens, ignore_eos=True)
                frames = [f async for f in client.generate(envelope)]
                got = sum(len(f.get("tokens", ())) for f in frames)
                if frames[-1]["t"] != "end" or got != tokens:
                    raise RuntimeError(f"{mesh.name}: request {i} ended {frames[-1]}")

        await asyncio.gather(*(one_client() for _ in range(concurrency)))


async def measure(url: str, mesh: Mesh, args: argparse.Namespace) -> None:
    before = sum(cpu_ticks(c.pid) for c in mesh.children)
    started = time.perf_counter()
    await drive(url, mesh, args.requests, args.concurrency, args.output_tokens)
    wall = time.perf_counter() - started
    ticks = sum(cpu_ticks(c.pid) for c in mesh.children) - before
    mesh.cpu_us.append(ticks / CLK_TCK / args.requests * 1e6)
    mesh.rate.append(args.requests / wall)


async def stats_answers(url: str, namespace: str) -> int:
    """How many `$SRV.STATS.genmesh` answers of `namespace` come within 0.3 s."""
    nc = await nats.connect(url)
    try:
        inbox = nc.new_inbox()
        answers: list[dict[str, Any]] = []

        async def on_reply(msg: Any) -> None:
            answers.append(json.loads(msg.data))

        sub = await nc.subscribe(inbox, cb=on_reply)
        await nc.publish("$SRV.STATS.genmesh", b"", reply=inbox)
        await asyncio.sleep(0.3)
        await sub.unsubscribe()
    finally:
        await nc.close()
    return sum(a["metadata"].get("namespace") == namespace for a in answers)


def counting_ns(number: int = 200_000, repeats: int = 7) -> float:
    """The median cost of counting one message on a `MicroEndpoint`, in ns."""
    endpoint = MicroEndpoint("generate", "bench")

    def count() -> None:
        endpoint.handled(endpoint.received())

    runs = timeit.repeat(count, number=number, repeat=repeats)
    return statistics.median(runs) / number * 1e9


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-micro-") as tmp:
        old_src = baseline_sources(args.baseline, Path(tmp))
        procs = Supervisor(logdir=Path(tmp))
        try:
            url = procs.start_nats()
            meshes = [
                start(procs, url, "before", str(old_src)),
                start(procs, url, "after", str(ROOT / "src")),
            ]
            for mesh in meshes:
                await wait_discovered(
                    url,
                    mesh.namespace,
                    workers=[f"w-{mesh.name}"],
                    routers=[f"r-{mesh.name}"],
                    watch=mesh.children,
                )
            after = meshes[1]
            if await stats_answers(url, after.namespace) != 2:
                raise RuntimeError("the `after` mesh does not answer $SRV.STATS")
            if await stats_answers(url, meshes[0].namespace) != 0:
                raise RuntimeError(f"{args.baseline} answers $SRV already: not a baseline")
            for mesh in meshes:  # warm-up
                await drive(url, mesh, args.requests // 10, args.concurrency, args.output_tokens)
            for round_ in range(args.rounds):
                for mesh in meshes if round_ % 2 == 0 else meshes[::-1]:
                    await measure(url, mesh, args)
                    procs.check_alive()
                print(
                    f"round {round_ + 1}: "
                    + ", ".join(
                        f"{m.name} {m.cpu_us[-1]:.0f} us CPU/req {m.rate[-1]:.0f} req/s"
                        for m in meshes
                    ),
                    file=sys.stderr,
                )
        except BaseException:
            print(procs.logs(), file=sys.stderr)
            raise
        finally:
            await asyncio.to_thread(procs.stop)
    result: dict[str, Any] = {
        "config": vars(args),
        "counting_ns_per_message": counting_ns(),
    }
    for mesh in meshes:
        result[mesh.name] = {
            "cpu_us_per_request": statistics.median(mesh.cpu_us),
            "req_per_s": statistics.median(mesh.rate),
            "rounds": {"cpu_us_per_request": mesh.cpu_us, "req_per_s": mesh.rate},
        }
    # Paired by round (both meshes measured back to back): steadier than the difference
    # of the medians when the machine's load drifts during the run.
    before, after = meshes
    result["after_minus_before"] = {
        "cpu_us_per_request": statistics.median(
            a - b for a, b in zip(after.cpu_us, before.cpu_us, strict=True)
        ),
        "req_per_s_ratio": statistics.median(
            a / b for a, b in zip(after.rate, before.rate, strict=True)
        ),
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=BASELINE, help="git revision without $SRV")
    parser.add_argument("--requests", type=int, default=2000, help="requests per round and mesh")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    if args.json:
        print(json.dumps(result, indent=2))
        return
    before, after = result["before"], result["after"]
    print(
        f"router + worker, {args.requests} requests x {args.rounds} rounds, concurrency "
        f"{args.concurrency}, {args.output_tokens} tokens (medians)"
    )
    print(f"{'':8} {'CPU us/request':>15} {'req/s':>8}")
    for name, r in (("before", before), ("after", after)):
        print(f"{name:8} {r['cpu_us_per_request']:15.1f} {r['req_per_s']:8.0f}")
    paired = result["after_minus_before"]
    print(
        f"{'after-before, paired by round':8} {paired['cpu_us_per_request']:+.1f} us CPU/request, "
        f"{paired['req_per_s_ratio'] - 1:+.1%} req/s"
    )
    print(f"counting one message on an endpoint: {result['counting_ns_per_message']:.0f} ns")


if __name__ == "__main__":
    main()

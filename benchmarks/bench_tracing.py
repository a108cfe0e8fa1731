"""What OpenTelemetry tracing costs the mesh: CPU per request with tracing on against off.

    .venv/bin/python benchmarks/bench_tracing.py [--requests 2000] [--repeats 7]
        [--concurrency 8] [--rate R] [--bsp-delay-ms 5000] [--base-python PYTHON]
        [--one-at-a-time]

Two meshes side by side, in one run: `off` (no OTEL_* variables: the API's no-op tracer)
and `on` (OTEL_TRACES_EXPORTER=otlp to an OTLP/HTTP receiver in this process that counts
the spans of every batch and drops it), each its own nats-server, 1 router, 1 instant mock
worker and 1 frontend. Each of `--repeats` runs loads every mesh at once, each with its
own closed loop of `--concurrency` clients (SGLang requests: 32-token prompt, 16 tokens,
half SSE, half unary), until one mesh has answered `--requests`: the meshes share the
machine in the same seconds, so what else runs on it weighs on all of them alike (run one
after the other, on a shared machine, the pairs differed by up to ±0.6 ms). With
`--rate R`, each mesh gets at most R requests a second: the meshes then answer the same
load (a closed loop gives the slower mesh fewer requests, and a process woken for fewer
requests at a time spends more per request, which inflates the difference).

What is counted (user + system CPU from /proc, 10 ms ticks), per answered request and per
process (frontend, router, worker, the mesh's nats-server): each process's event-loop
thread over the run, and its other threads (the span export thread) from the start of the
run until the receiver has every span of it. Spans are exported as the SDK does by default
(a batch every 5 s, or as soon as 512 spans wait), so up to a batch of them goes out after
the run: counting them is what makes every span's export count once. `--bsp-delay-ms 200`
exports five times a second, which costs more (each export is an HTTP request). The
figure is the median over the runs of the difference within each run (on minus off), with
its range, and by process; the receiver and the load generator run in this process and
are not counted.

`--one-at-a-time` loads the meshes in turn instead (the order flipped every run), each
alone on the machine while it runs, as `compare_dynamo.sh` measures a mesh's CPU per
request: two meshes at once on two cores run each process colder (the untraced mesh
costs ~0.9 ms a request at c=32 where alone it costs ~0.6), and tracing's share with
it; in turn, the pairs are taken seconds apart and scatter more, so run more repeats.

`--base-python` adds the same two meshes run by another interpreter (another checkout's
virtualenv, say the main branch's), in the same runs: a change measured A/B on the same
machine load with the same load generator, as the median of the differences within each
run between the two trees' traced (and untraced) meshes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.mesh import Mesh, free_port

from genmesh.shared.natsserver import NatsServer
from genmesh.testkit.common import serving

CLK_TCK = os.sysconf("SC_CLK_TCK")
PROMPT = [(7 * i + 1) % 50_000 for i in range(32)]
SPANS_PER_REQUEST = 2  # frontend and worker (the frontend routes: the router makes none)
ROLES = ("frontend", "router", "worker", "nats")


def _ticks(stat: str) -> int:
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def cpu_split(pid: int) -> tuple[float, float]:
    """CPU seconds of `pid`'s main (event-loop) thread and of its other threads (the
    process's own line counts every thread it had, the ones that ended included)."""
    main = _ticks(Path(f"/proc/{pid}/task/{pid}/stat").read_text())
    total = _ticks(Path(f"/proc/{pid}/stat").read_text())
    return main / CLK_TCK, (total - main) / CLK_TCK


async def load(
    url: str, requests: int, concurrency: int, done: asyncio.Event, rate: float = 0
) -> int:
    """Requests to `url` until `requests` are answered, or `done` is set (another mesh of
    the run got there first; then the requests in flight finish); sets `done`. At most
    `rate` a second, if given. The count of answered requests."""
    issued = answered = 0
    loop = asyncio.get_running_loop()
    started = loop.time()

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal issued, answered
        while issued < requests and not done.is_set():
            issued += 1
            if rate:
                await asyncio.sleep(started + issued / rate - loop.time())
            body = {
                "input_ids": PROMPT,
                "sampling_params": {"max_new_tokens": 16, "ignore_eos": True},
                "stream": issued % 2 == 0,
            }
            async with session.post(url + "/generate", json=body) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{url}: HTTP {r.status}: {await r.text()}")
            answered += 1
        done.set()

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return answered


def start_mesh(
    nats_url: str, workdir: Path, name: str, env: dict[str, str], python: str | None = None
) -> Mesh:
    mesh = Mesh(
        nats_url, workdir / name, f"trace{name.replace('-', '')}", env=env, log_level="info"
    )
    (workdir / name).mkdir()
    # The supervisor starts `sys.executable -m genmesh`: another interpreter runs another
    # checkout's genmesh (the A/B baseline). Only while this mesh starts.
    executable = sys.executable
    if python is not None:
        sys.executable = python
    try:
        mesh.add_router()
        mesh.add_frontend()
        mesh.add_worker()
    finally:
        sys.executable = executable
    return mesh


def spread(values: list[float]) -> str:
    """A median with its range, in µs."""
    return (
        f"{statistics.median(values) * 1e3:+.0f} us "
        f"({min(values) * 1e3:+.0f} .. {max(values) * 1e3:+.0f})"
    )


async def main(args: argparse.Namespace) -> None:
    received: dict[str, int] = {}  # spans, by mesh

    async def sink(request: web.Request) -> web.Response:
        batch = ExportTraceServiceRequest.FromString(await request.read())
        name = request.match_info["mesh"]
        received[name] = received.get(name, 0) + sum(
            len(scope.spans) for resource in batch.resource_spans for scope in resource.scope_spans
        )
        return web.Response(content_type="application/x-protobuf")

    receiver = web.Application()
    receiver.router.add_post("/{mesh}/v1/traces", sink)
    workdir = Path(tempfile.mkdtemp(prefix="bench-tracing-"))
    servers: dict[str, NatsServer] = {}  # each mesh its own: its CPU is the mesh's
    meshes: dict[str, Mesh] = {}
    sent: dict[str, int] = {}  # answered requests, by mesh

    async def settle(name: str) -> None:
        """Until the receiver has every span of the mesh's requests (traced meshes)."""
        if not name.endswith("on"):
            return
        deadline = time.monotonic() + args.bsp_delay_ms / 1e3 + 5
        while received.get(name, 0) < SPANS_PER_REQUEST * sent[name]:
            if time.monotonic() > deadline:
                print(
                    f"  {name}: {received.get(name, 0)} spans of "
                    f"{SPANS_PER_REQUEST * sent[name]} arrived",
                    file=sys.stderr,
                )
                return
            await asyncio.sleep(0.05)

    async with serving(receiver, port=free_port()) as endpoint:
        try:
            pythons = {"": None}
            if args.base_python:
                pythons["base-"] = args.base_python
            for prefix, python in pythons.items():
                for state in ("off", "on"):
                    name = prefix + state
                    env = {}
                    if state == "on":  # each traced mesh to its own path: spans by mesh
                        env = {
                            "OTEL_TRACES_EXPORTER": "otlp",
                            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint + f"/{name}/v1/traces",
                            "OTEL_BSP_SCHEDULE_DELAY": str(args.bsp_delay_ms),
                        }
                    servers[name] = NatsServer()
                    nats_url = servers[name].start()
                    meshes[name] = start_mesh(nats_url, workdir, name, env, python)
            # CPU ms per request, by mesh, by process, one list entry per run.
            shares: dict[str, dict[str, list[float]]] = {
                name: {role: [] for role in ROLES} for name in meshes
            }
            exports: dict[str, list[float]] = {name: [] for name in meshes}  # other threads
            marks: dict[str, dict[str, float]] = {}  # their CPU s at the last checkpoint
            notes: dict[str, str] = {}  # the last run's, printed once it is counted

            def pids(name: str) -> dict[str, int]:
                found = {s.role: s.pid for s in meshes[name].services}
                found["nats"] = servers[name].pid or 0
                return found

            def cpu(names: list[str]) -> dict[str, dict[str, tuple[float, float]]]:
                """Each process's CPU seconds (event loop, other threads), by mesh."""
                return {n: {r: cpu_split(pid) for r, pid in pids(n).items()} for n in names}

            async def checkpoint(name: str, answered: int) -> None:
                """Once every span of the mesh's last run has arrived, count what its
                processes' other threads (the export) spent since that run started."""
                await settle(name)
                now = {role: cpu_split(pid)[1] for role, pid in pids(name).items()}
                if name in notes:
                    for role in ROLES[:-1]:  # nats-server's are counted with its main
                        share = (now[role] - marks[name][role]) / answered * 1e3
                        shares[name][role][-1] += share
                        exports[name][-1] += share
                    total = sum(values[-1] for values in shares[name].values())
                    print(
                        f"  {name:<9} {notes.pop(name)}: {total:.3f} ms CPU/request "
                        f"(threads off the loop {exports[name][-1]:.3f})",
                        file=sys.stderr,
                    )
                marks[name] = now

            warm = asyncio.Event()  # (each mesh does all 200)
            for name, mesh in meshes.items():
                sent[name] = await load(mesh.http_url, 200, args.concurrency, warm)
                warm.clear()
            answered: dict[str, int] = {}
            for run in range(args.repeats):
                for name in meshes:
                    await checkpoint(name, answered.get(name, 1))
                order = list(meshes) if run % 2 == 0 else list(reversed(meshes))

                before: dict[str, dict[str, tuple[float, float]]] = {}
                after: dict[str, dict[str, tuple[float, float]]] = {}
                walls: dict[str, float] = {}
                if args.one_at_a_time:  # each mesh alone on the machine, in turn
                    counts = []
                    for n in order:
                        before |= cpu([n])
                        started = time.perf_counter()
                        counts.append(
                            await load(
                                meshes[n].http_url,
                                args.requests,
                                args.concurrency,
                                asyncio.Event(),
                                args.rate,
                            )
                        )
                        walls[n] = time.perf_counter() - started
                        after |= cpu([n])
                else:
                    # Every mesh at once, each with its own clients: they share the machine
                    # in the same seconds, so what others do on it weighs on all alike.
                    before = cpu(order)
                    done = asyncio.Event()
                    started = time.perf_counter()
                    loads = (
                        load(meshes[n].http_url, args.requests, args.concurrency, done, args.rate)
                        for n in order
                    )
                    counts = await asyncio.gather(*loads)
                    walls = dict.fromkeys(order, time.perf_counter() - started)
                    after = cpu(order)
                for name, count in zip(order, counts, strict=True):
                    answered[name] = count
                    sent[name] += count
                    for role in ROLES:  # the event loop's (nats-server's: all) in the run
                        spent = after[name][role][0] - before[name][role][0]
                        if role == "nats":
                            spent += after[name][role][1] - before[name][role][1]
                        shares[name][role].append(spent / count * 1e3)
                    exports[name].append(0.0)
                    notes[name] = f"run {run + 1}, {count / walls[name]:.0f} req/s"
            for name in meshes:
                await checkpoint(name, answered[name])
        finally:
            for mesh in meshes.values():
                mesh.stop()
            for server in servers.values():
                server.stop()

    def totals(name: str) -> list[float]:
        return [sum(values) for values in zip(*shares[name].values(), strict=True)]

    def diffs(a: list[float], b: list[float]) -> list[float]:
        return [y - x for x, y in zip(a, b, strict=True)]

    how = "one mesh at a time" if args.one_at_a_time else "all meshes at once"
    print(
        f"tracing: {args.requests} requests/run (16 tokens, half SSE), concurrency "
        f"{args.concurrency} per mesh{f', {args.rate:.0f} req/s each' if args.rate else ''}, "
        f"{args.repeats} runs of {how}; CPU ms per "
        "request, medians; mesh = frontend + router + worker + its nats-server"
    )
    for prefix in pythons:
        tree = sys.executable if not prefix else pythons[prefix]
        print(f"  {tree}")
        for state in ("off", "on"):
            name = prefix + state
            split = ", ".join(
                f"{role} {statistics.median(values):.3f}" for role, values in shares[name].items()
            )
            print(
                f"    tracing {state:<3} {statistics.median(totals(name)):.3f} ms ({split}; "
                f"threads off the loop {statistics.median(exports[name]):.3f})"
            )
        off, on = prefix + "off", prefix + "on"
        print(
            f"    added by tracing (on - off in each run): {spread(diffs(totals(off), totals(on)))}"
        )
        by_role = ", ".join(
            f"{role} {statistics.median(diffs(shares[off][role], shares[on][role])) * 1e3:+.0f}"
            for role in ROLES
        )
        print(f"      by process (us): {by_role}")
    if args.base_python:
        print(
            "  this tree - base, within a run: tracing on "
            f"{spread(diffs(totals('base-on'), totals('on')))}, tracing off "
            f"{spread(diffs(totals('base-off'), totals('off')))}"
        )
    print(f"  spans received: {sum(received.values())} (by mesh: {received})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7, help="runs (of every mesh)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--bsp-delay-ms",
        type=int,
        default=5000,
        help="OTEL_BSP_SCHEDULE_DELAY of the traced meshes (the SDK's default: 5000)",
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=0,
        help="requests a second to each mesh (default: as fast as it answers)",
    )
    parser.add_argument("--base-python", help="also run meshes with this interpreter (A/B)")
    parser.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="load one mesh at a time, alternating, each alone on the machine (as "
        "compare_dynamo.sh measures a mesh's CPU per request); default: all at once",
    )
    asyncio.run(main(parser.parse_args()))

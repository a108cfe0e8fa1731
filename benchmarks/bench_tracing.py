"""What OpenTelemetry tracing costs the mesh: CPU per request with tracing on against off.

    .venv/bin/python benchmarks/bench_tracing.py [--requests 3000] [--repeats 3]
        [--concurrency 8] [--bsp-delay-ms 5000] [--base-python /work/wt-base/.venv/bin/python]

Two meshes side by side on one nats-server, in one run: `off` (no OTEL_* variables: the
API's no-op tracer) and `on` (OTEL_TRACES_EXPORTER=otlp to an OTLP/HTTP receiver in this
process that accepts and drops every batch), each 1 router, 1 instant mock worker and 1
frontend. A closed loop of `--concurrency` clients sends `--requests` SGLang requests
(32-token prompt, 16 tokens, half SSE, half unary) to each mesh in turn, `--repeats` times,
alternating. Spans are exported as the SDK does by default (a batch every 5 s, or as soon
as 512 spans wait); `--bsp-delay-ms 200` exports five times a second, which costs more
(each export is an HTTP request). The figure is the CPU (user + system, from
/proc/<pid>/stat) of the mesh's three processes per request, median over the repeats, and
each process's share. The receiver and the load generator run in this process and are not
counted.

`--base-python` adds the same two meshes run by another interpreter (another checkout's
virtualenv, say the main branch's), so a change is measured A/B in the same run, on the
same machine load, with the same load generator.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.mesh import Mesh, free_port

from genmesh.shared.natsserver import NatsServer
from genmesh.testkit.common import serving

CLK_TCK = os.sysconf("SC_CLK_TCK")
PROMPT = [(7 * i + 1) % 50_000 for i in range(32)]


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


async def load(url: str, requests: int, concurrency: int) -> int:
    errors = 0
    remaining = requests

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal remaining, errors
        while remaining > 0:
            remaining -= 1
            body = {
                "input_ids": PROMPT,
                "sampling_params": {"max_new_tokens": 16, "ignore_eos": True},
                "stream": remaining % 2 == 0,
            }
            async with session.post(url + "/generate", json=body) as r:
                await r.read()
                errors += r.status != 200

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return errors


def start_mesh(
    nats_url: str, workdir: Path, name: str, env: dict[str, str], python: str | None = None
) -> Mesh:
    mesh = Mesh(nats_url, workdir / name, f"trace{name.replace('-', '')}", env=env)
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


async def main(args: argparse.Namespace) -> None:
    received = 0

    async def sink(request: web.Request) -> web.Response:
        nonlocal received
        await request.read()
        received += 1
        return web.Response(content_type="application/x-protobuf")

    receiver = web.Application()
    receiver.router.add_post("/v1/traces", sink)
    server = NatsServer()
    nats_url = server.start()
    workdir = Path(tempfile.mkdtemp(prefix="bench-tracing-"))
    meshes: dict[str, Mesh] = {}
    async with serving(receiver, port=free_port()) as receiver_url:
        try:
            on_env = {
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_ENDPOINT": receiver_url,
                "OTEL_BSP_SCHEDULE_DELAY": str(args.bsp_delay_ms),
            }
            pythons = {"": None}
            if args.base_python:
                pythons["base-"] = args.base_python
            for prefix, python in pythons.items():
                meshes[prefix + "off"] = start_mesh(nats_url, workdir, prefix + "off", {}, python)
                meshes[prefix + "on"] = start_mesh(nats_url, workdir, prefix + "on", on_env, python)
            for mesh in meshes.values():
                await load(mesh.http_url, 200, args.concurrency)  # warm-up
            results: dict[str, list[float]] = {name: [] for name in meshes}
            shares: dict[str, dict[str, list[float]]] = {name: {} for name in meshes}
            for repeat in range(args.repeats):
                order = list(meshes) if repeat % 2 == 0 else list(reversed(meshes))
                for name in order:
                    mesh = meshes[name]
                    roles = {s.role: s.pid for s in mesh.services}
                    before = {role: cpu_s(pid) for role, pid in roles.items()}
                    started = time.perf_counter()
                    errors = await load(mesh.http_url, args.requests, args.concurrency)
                    wall = time.perf_counter() - started
                    await asyncio.sleep(0.5)  # let the span batches go out
                    for role, pid in roles.items():
                        share = (cpu_s(pid) - before[role]) / args.requests * 1e3
                        shares[name].setdefault(role, []).append(share)
                    per = sum(shares[name][role][-1] for role in roles)
                    results[name].append(per)
                    print(
                        f"  {name:<9} run {repeat + 1}: {per:.3f} ms CPU/request, "
                        f"{args.requests / wall:.0f} req/s, {errors} errors",
                        file=sys.stderr,
                    )
        finally:
            for mesh in meshes.values():
                mesh.stop()
            server.stop()
    print(
        f"tracing: {args.requests} requests/run (16 tokens, half SSE), concurrency "
        f"{args.concurrency}, median of {args.repeats}; mesh CPU = frontend + router + worker"
    )
    for prefix in pythons:
        off, on = (statistics.median(results[prefix + k]) for k in ("off", "on"))
        tree = sys.executable if not prefix else pythons[prefix]
        print(f"  {tree}")
        for k in ("off", "on"):
            split = ", ".join(
                f"{role} {statistics.median(v):.3f}" for role, v in shares[prefix + k].items()
            )
            print(f"    tracing {k:<3} {statistics.median(results[prefix + k]):.3f} ms ({split})")
        print(f"    added by tracing: +{(on - off) * 1e3:.0f} us/request ({on / off:.2f}x)")
    print(f"  span batches received: {received}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument(
        "--bsp-delay-ms",
        type=int,
        default=5000,
        help="OTEL_BSP_SCHEDULE_DELAY of the traced meshes (the SDK's default: 5000)",
    )
    parser.add_argument("--base-python", help="also run meshes with this interpreter (A/B)")
    asyncio.run(main(parser.parse_args()))

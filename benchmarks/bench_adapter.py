"""What the `sglang` engine adapter adds, per request, over a plain client of the engine.

    .venv/bin/python benchmarks/bench_adapter.py [--requests 2000] [--concurrency 1,16]

One mock SGLang server (`genmesh testkit sglang`, its own process) serves both sides,
alternating, in the same run:

- **direct**: a minimal aiohttp client that streams `POST /generate` and parses each SSE
  event with orjson, the least any client must do;
- **adapter**: genmesh's `SglangEngine.generate()`, as a worker runs it (dispatch ids,
  cursor, logprob and finish mapping, abort bookkeeping), consuming EngineOutputs.

Both run in this process; the figure is this process's CPU time (user + system) per
request, median of `--repeats`, and adapter - direct is what the adapter adds. The
server's CPU is the same for both and is reported for scale.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import orjson

from genmesh.client import request
from genmesh.engines.http import HttpEngineConfig
from genmesh.engines.sglang import SglangEngine
from genmesh.shared.ids import new_request_id

PROMPT = list(range(1, 33))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_of(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_direct(session: aiohttp.ClientSession, url: str, tokens: int) -> int:
    body = {
        "input_ids": PROMPT,
        "rid": new_request_id(),
        "stream": True,
        "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True},
    }
    got = 0
    async with session.post(f"{url}/generate", json=body) as response:
        async for line in response.content:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                got = len(orjson.loads(line[6:])["output_ids"])  # cumulative by default
    return got


async def run_adapter(engine: SglangEngine, url: str, tokens: int) -> int:
    env = request(PROMPT, max_tokens=tokens, ignore_eos=True)
    env.id = new_request_id()
    return sum([len(out.tokens) async for out in engine.generate(env)])


async def closed_loop(n: int, concurrency: int, one: Callable[[], Awaitable[int]]) -> None:
    remaining = n

    async def client() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await one()

    await asyncio.gather(*(client() for _ in range(concurrency)))


async def measure(args: argparse.Namespace, url: str, server_pid: int) -> None:
    engine = SglangEngine(HttpEngineConfig(url))
    await engine.start()
    assert await engine.healthy()
    connector = aiohttp.TCPConnector(limit=0)
    rows = []
    async with aiohttp.ClientSession(connector=connector) as session:
        sides: dict[str, Callable[[], Awaitable[int]]] = {
            "direct": lambda: run_direct(session, url, args.output_tokens),
            "adapter": lambda: run_adapter(engine, url, args.output_tokens),
        }
        assert await sides["direct"]() == args.output_tokens
        assert await sides["adapter"]() == args.output_tokens
        for concurrency in args.concurrency:
            results: dict[str, list[tuple[float, float, float]]] = {k: [] for k in sides}
            for repeat in range(args.repeats):
                order = list(sides) if repeat % 2 == 0 else list(reversed(sides))
                for name in order:
                    await closed_loop(200, concurrency, sides[name])  # warm-up
                    own, server = time.process_time(), cpu_of(server_pid)
                    started = time.perf_counter()
                    await closed_loop(args.requests, concurrency, sides[name])
                    wall = time.perf_counter() - started
                    results[name].append(
                        (
                            (time.process_time() - own) / args.requests * 1e3,
                            (cpu_of(server_pid) - server) / args.requests * 1e3,
                            args.requests / wall,
                        )
                    )
            med = {
                k: [statistics.median(x[i] for x in v) for i in range(3)]
                for k, v in results.items()
            }
            rows.append((concurrency, med))
    await engine.close()
    print(
        f"sglang adapter vs direct client: {args.requests} requests/run, prompt {len(PROMPT)}, "
        f"{args.output_tokens} output tokens (SSE, cumulative), median of {args.repeats}"
    )
    print(f"{'conc':>4}  {'side':<8}{'client cpu ms/req':>18}{'server cpu ms/req':>18}{'req/s':>8}")
    for concurrency, med in rows:
        for name in ("direct", "adapter"):
            cpu, server, rate = med[name]
            print(f"{concurrency:>4}  {name:<8}{cpu:>18.3f}{server:>18.3f}{rate:>8.0f}")
        added = med["adapter"][0] - med["direct"][0]
        ratio = med["adapter"][0] / med["direct"][0]
        print(
            f"{'':>4}  {'added':<8}{added:>18.3f}{'':>18}{'':>8}   ({ratio:.2f}x the direct client)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument(
        "--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16]
    )
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "genmesh", "testkit", "sglang", "--port", str(port)],
        stdout=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        asyncio.run(measure(args, url, server.pid))
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    main()

"""What a disaggregated request costs an engine adapter, against an aggregated one.

    .venv/bin/python benchmarks/bench_pd_adapter.py [--engine vllm|sglang] [--requests 500]
        [--concurrency 1,16]

Three mock servers of the engine (`genmesh testkit vllm|sglang`), each its own process: an
aggregated one, and a prefill/decode pair (`--disaggregation-mode prefill|decode`, the
decode taking the prefill's KV handle over HTTP). In the same run, alternately:

- **aggregated**: the adapter's `generate()` on the aggregated server;
- **p/d**: its `prefill()` on the prefill server and `decode()` on the decode server, as the
  two workers of a pair run them (the halves' CPU together): vLLM's one after the other,
  the decode given the prefill's handoff; SGLang's at once, paired by a ticket's room.

The figures are this process's CPU ms per request (the adapter's work, both halves), the
servers' CPU ms per request (for scale: the pair's includes the mock's KV hand-over) and the
mean wall ms per request, each the median of `--repeats`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import replace

from bench_adapter import closed_loop, cpu_of, free_port
from genmesh.client import request
from genmesh.engines.http import HttpEngineConfig
from genmesh.engines.sglang import SglangEngine
from genmesh.engines.vllm import VllmEngine
from genmesh.shared.envelope import Disagg, Envelope, prefill_stage_id
from genmesh.shared.ids import new_request_id

PROMPT = list(range(1, 129))  # 128 tokens: 8 full KV blocks handed over


def start_server(engine: str, *args: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    argv = [sys.executable, "-m", "genmesh", "testkit", engine, "--port", str(port), *args]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL), f"http://127.0.0.1:{port}"


def wait_healthy(url: str) -> None:
    deadline = time.monotonic() + 20
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def adapter(engine: str, url: str) -> VllmEngine | SglangEngine:
    # (An SGLang prefill server's bootstrap port: as its /server_info reports it.)
    return (VllmEngine if engine == "vllm" else SglangEngine)(HttpEngineConfig(url))


async def vllm_pair(prefill: VllmEngine, decode: VllmEngine, env: Envelope) -> int:
    pre = [out async for out in prefill.prefill(env, {})]
    handoff = pre[-1].handoff
    assert handoff, "the prefill handed nothing over"
    outs = [out async for out in decode.decode(env, {}, handoff)]
    return sum(len(out.tokens) for out in outs)


async def sglang_pair(prefill: SglangEngine, decode: SglangEngine, env: Envelope) -> int:
    ticket = decode.pd_ticket(env, {"kind": prefill.pd_kind, **prefill.pd_card()})
    stage = replace(env, id=prefill_stage_id(env.id), disagg=Disagg(parent=env.id, ticket=ticket))

    async def prefilled() -> None:
        async for _ in prefill.prefill(stage, ticket):
            pass

    async def decoded() -> int:
        return sum([len(out.tokens) async for out in decode.decode(env, ticket, None)])

    _, tokens = await asyncio.gather(prefilled(), decoded())
    return tokens


async def measure(args: argparse.Namespace, servers: dict[str, tuple[int, str]]) -> None:
    engines = {name: adapter(args.engine, url) for name, (_, url) in servers.items()}
    for engine in engines.values():
        await engine.start()
        assert await engine.healthy()

    async def aggregated() -> int:
        env = request(PROMPT, max_tokens=args.output_tokens, ignore_eos=True)
        env.id = new_request_id()
        return sum([len(out.tokens) async for out in engines["agg"].generate(env)])

    async def disaggregated() -> int:
        env = request(PROMPT, max_tokens=args.output_tokens, ignore_eos=True)
        env.id = new_request_id()
        pair = vllm_pair if args.engine == "vllm" else sglang_pair
        return await pair(engines["prefill"], engines["decode"], env)  # type: ignore[arg-type]

    sides: dict[str, Callable[[], Awaitable[int]]] = {
        "aggregated": aggregated,
        "p/d": disaggregated,
    }
    pids = {"aggregated": [servers["agg"][0]], "p/d": [servers["prefill"][0], servers["decode"][0]]}
    for one in sides.values():
        assert await one() == args.output_tokens
    rows = []
    for concurrency in args.concurrency:
        results: dict[str, list[tuple[float, float, float]]] = {k: [] for k in sides}
        for repeat in range(args.repeats):
            for name in list(sides) if repeat % 2 == 0 else list(reversed(sides)):
                await closed_loop(50, concurrency, sides[name])  # warm-up
                own = time.process_time()
                server = sum(cpu_of(pid) for pid in pids[name])
                started = time.perf_counter()
                await closed_loop(args.requests, concurrency, sides[name])
                wall = time.perf_counter() - started
                results[name].append(
                    (
                        (time.process_time() - own) / args.requests * 1e3,
                        (sum(cpu_of(pid) for pid in pids[name]) - server) / args.requests * 1e3,
                        wall / args.requests * 1e3 * concurrency,
                    )
                )
        med = {
            k: [statistics.median(x[i] for x in v) for i in range(3)] for k, v in results.items()
        }
        rows.append((concurrency, med))
    for engine in engines.values():
        await engine.close()
    print(
        f"{args.engine} adapter, p/d vs aggregated: {args.requests} requests/run, "
        f"prompt {len(PROMPT)}, "
        f"{args.output_tokens} output tokens, median of {args.repeats}"
    )
    print(f"{'conc':>4}  {'side':<11}{'adapter cpu ms/req':>19}{'servers cpu ms/req':>19}"
          f"{'wall ms/req':>12}")  # fmt: skip
    for concurrency, med in rows:
        for name in sides:
            cpu, server, wall = med[name]
            print(f"{concurrency:>4}  {name:<11}{cpu:>19.3f}{server:>19.3f}{wall:>12.2f}")
        added = med["p/d"][0] - med["aggregated"][0]
        print(f"{'':>4}  {'added':<11}{added:>19.3f}   (adapter cpu of p/d - aggregated)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("vllm", "sglang"), default="vllm")
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument(
        "--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16]
    )
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    procs = {
        "agg": start_server(args.engine),
        "prefill": start_server(args.engine, "--disaggregation-mode", "prefill"),
        "decode": start_server(args.engine, "--disaggregation-mode", "decode"),
    }
    try:
        for _, url in procs.values():
            wait_healthy(url)
        asyncio.run(measure(args, {k: (p.pid, url) for k, (p, url) in procs.items()}))
    finally:
        for proc, _ in procs.values():
            proc.terminate()
        for proc, _ in procs.values():
            proc.wait(10)


if __name__ == "__main__":
    main()

"""What the mock's P/D costs over its `generate`, per request, on one real nats-server.

    .venv/bin/python benchmarks/bench_mock_pd.py [--requests 2000] [--prompts 32,1024]
        [--output-tokens 16] [--repeats 5]

Two instant mocks (`--mock-speedup 0`, transfer bandwidth 0: no simulated time at all) in
this process, each on its own NATS connection to a nats-server of its own, as a prefill and
a decode worker attach them. For each prompt length, alternating in the same run:

- **generate**: `MockEngine.generate` on one engine, the aggregated request;
- **pd**: `prefill` on one engine (the prompt's pass, a KV handle kept), then `decode` on the
  other (the handle pulled over NATS, answered by the first engine's subscription, then the
  same decode loop).

Requests run one after another (the pull's round trip is in the wall time). Printed: CPU
time of this process (user + system, so both engines and both NATS clients; not the
nats-server's) and wall time per request, the median of `--repeats`, and pd - generate.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import time

import nats

from genmesh.client import request
from genmesh.engines.mock import MockConfig, MockEngine
from genmesh.shared.envelope import Disagg, Envelope, prefill_stage_id
from genmesh.shared.natsserver import NatsServer
from genmesh.shared.subjects import Subjects

CONFIG = MockConfig(vocab_size=151_936, transfer_gbps=0.0)


async def run_generate(engine: MockEngine, envs: list[Envelope]) -> None:
    for env in envs:
        async for _ in engine.generate(env):
            pass


async def run_pd(prefill: MockEngine, decode: MockEngine, envs: list[Envelope]) -> None:
    for env in envs:
        stage = dataclasses.replace(env, id=prefill_stage_id(env.id), disagg=Disagg(env.id))
        handoff = None
        async for out in prefill.prefill(stage, {}):
            handoff = out.handoff
        async for _ in decode.decode(env, {}, handoff):
            pass


async def measure(run: object, *args: object) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one run."""
    cpu, wall = time.process_time(), time.perf_counter()
    await run(*args)  # type: ignore[operator]
    return time.process_time() - cpu, time.perf_counter() - wall


async def main(args: argparse.Namespace) -> None:
    server = NatsServer()
    server.start()
    try:
        subjects = Subjects("benchpd")
        prefill, decode, alone = MockEngine(CONFIG), MockEngine(CONFIG), MockEngine(CONFIG)
        connections = [await nats.connect(server.url) for _ in range(2)]
        await prefill.pd_attach(connections[0], subjects, "wp")
        await decode.pd_attach(connections[1], subjects, "wd")
        print(
            f"{args.requests} requests per run, {args.output_tokens} output tokens, "
            f"median of {args.repeats} runs; µs per request"
        )
        print(f"{'prompt':>7} {'mode':>9} {'cpu':>8} {'wall':>8}")
        for length in args.prompts:
            envs = [
                request(
                    [(i * 7919 + j) % 151_000 for j in range(length)],
                    max_tokens=args.output_tokens,
                    ignore_eos=True,
                )
                for i in range(args.requests)
            ]
            figures: dict[str, list[tuple[float, float]]] = {"generate": [], "pd": []}
            await run_pd(prefill, decode, envs[:50])  # warm-up
            for _ in range(args.repeats):
                figures["generate"].append(await measure(run_generate, alone, envs))
                figures["pd"].append(await measure(run_pd, prefill, decode, envs))
            medians = {
                mode: tuple(
                    statistics.median(r[k] for r in runs) * 1e6 / args.requests for k in (0, 1)
                )
                for mode, runs in figures.items()
            }
            for mode, (cpu, wall) in medians.items():
                print(f"{length:>7} {mode:>9} {cpu:>8.1f} {wall:>8.1f}")
            extra = [medians["pd"][k] - medians["generate"][k] for k in (0, 1)]
            print(f"{length:>7} {'pd - gen':>9} {extra[0]:>8.1f} {extra[1]:>8.1f}")
            assert prefill.pd_card()["handles"] == 0, "a handle was left behind"
        for engine in (prefill, decode):
            await engine.close()
        for nc in connections:
            await nc.close()
    finally:
        server.stop()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument(
        "--prompts", type=lambda s: [int(x) for x in s.split(",")], default=[32, 1024]
    )
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse_args()))

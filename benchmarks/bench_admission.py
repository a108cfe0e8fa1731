"""What admission control costs the routing core per request when a worker is free.

    .venv/bin/python benchmarks/bench_admission.py [--repeats R] [--number N] [--json]

One directory of 4 workers (capacity 256, KV blocks announced), one envelope of a
1,024-token prompt, and per request the routing core's whole part: the decision, then
the worker's next report (what was sent is seen: `sent_since_report` back to 0) and the
request's end. Cases, interleaved in one run so that they share the machine's state:

- `chooser (main)`: `Chooser.choose` called directly, synchronously, as
  `Attempt._route` did before admission control;
- `admission off`: `Admission` with the default options (no queue, no thresholds),
  awaited as `Attempt._route` does now (`choose`, then `wait` if it must);
- `admission on`: the same with `--admission-queue 256 --busy-kv-usage 0.9
  --busy-queued 4` (every worker below them: the common path of a loaded but not busy
  mesh).

Prints the median over R runs of N requests, in microseconds per request, and the
difference to the first case.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Callable
from typing import Any, cast

from genmesh.client import request
from genmesh.routing.admission import Admission
from genmesh.routing.busy import AdmissionConfig
from genmesh.routing.choice import Chooser, Decision
from genmesh.routing.policies import RoundRobin
from genmesh.shared.discovery import WorkerDirectory
from genmesh.shared.envelope import Envelope
from genmesh.shared.subjects import Subjects

ON = AdmissionConfig(busy_kv_usage=0.9, busy_queued=4, queue_size=256)


def directory() -> WorkerDirectory:
    found = WorkerDirectory(cast(Any, None), Subjects("bench"))  # never started: no NATS
    for i in range(4):
        found._update(
            {
                "id": f"w{i}",
                "subject": f"genmesh.bench.worker.w{i}.generate",
                "model": "m",
                "inflight": 8,
                "queued": 1,
                "capacity": 256,
                "kv_blocks_used": 1_000,
                "kv_blocks_total": 4_096,
                "engine_info": {"model": "m", "block_size": 16},
            }
        )
    return found


def reported(decision: Decision) -> None:
    """The worker's next card, as far as routing reads it: what was sent is seen."""
    decision.worker.sent_since_report = 0
    decision.worker.kv_blocks_sent = 0


async def run_chooser(number: int, envelope: Envelope) -> float:
    chooser = Chooser(directory(), RoundRobin())
    start = time.perf_counter_ns()
    for _ in range(number):
        decision = chooser.choose(envelope)
        reported(decision)
        chooser.ended(decision)
    return (time.perf_counter_ns() - start) / number / 1000.0


async def _route(admission: Admission, envelope: Envelope) -> Decision:
    """`Attempt._route`'s part: a decision now, or after a wait."""
    decision = admission.choose(envelope)
    if decision is None:
        decision = await admission.wait(envelope)
    return decision


def admission_case(config: AdmissionConfig) -> Callable[[int, Envelope], Any]:
    async def run(number: int, envelope: Envelope) -> float:
        admission = Admission(Chooser(directory(), RoundRobin(), config), config, "bench")
        start = time.perf_counter_ns()
        for _ in range(number):
            decision = await _route(admission, envelope)
            reported(decision)
            admission.ended(decision)
        return (time.perf_counter_ns() - start) / number / 1000.0

    return run


CASES: dict[str, Callable[[int, Envelope], Any]] = {
    "chooser (main)": run_chooser,
    "admission off": admission_case(AdmissionConfig()),
    "admission on": admission_case(ON),
}


async def main_async(repeats: int, number: int) -> dict[str, float]:
    envelope = request(list(range(1, 1025)))
    runs: dict[str, list[float]] = {name: [] for name in CASES}
    for case in CASES.values():  # warm-up
        await case(number // 10 or 1, envelope)
    for _ in range(repeats):
        for name, case in CASES.items():
            runs[name].append(await case(number, envelope))
    return {name: statistics.median(values) for name, values in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--number", type=int, default=20_000)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    figures = asyncio.run(main_async(args.repeats, args.number))
    if args.json:
        print(json.dumps(figures))
        return
    base = figures["chooser (main)"]
    print(f"routing core per request, median of {args.repeats} x {args.number}, 4 workers:")
    for name, us in figures.items():
        print(f"  {name:<16} {us:7.3f} us   ({us - base:+.3f} us)")


if __name__ == "__main__":
    main()

"""What picking a prefill/decode pair costs the routing core per request.

    .venv/bin/python benchmarks/bench_pd_routing.py [--repeats R] [--number N] [--json]

One envelope of a 1,024-token prompt and per request the routing core's whole part: the
decision, then the workers' next reports (what was sent is seen) and the request's end.
Cases, interleaved in one run so that they share the machine's state:

- `aggregated`: 4 workers of role both (what every mesh without P/D runs);
- `pair`: 2 decode and 2 prefill workers: a decode worker, then its prefill worker;
- `local`: the same workers with `--pd-local-prefill-tokens 2048`: the decode worker
  alone (the threshold read, no prefill choice);
- `aggregated kv`, `pair kv`: the same two with the `kv` policy (events on, nothing
  cached: the whole walk and the costs, twice for a pair).

Prints the median over R runs of N requests, in microseconds per request, and the
difference to the aggregated case of the same policy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, cast

from genmesh.client import request
from genmesh.routing.choice import Chooser, Decision
from genmesh.routing.pairing import PdConfig
from genmesh.routing.policies import make_policy
from genmesh.shared.discovery import WorkerDirectory
from genmesh.shared.envelope import Envelope
from genmesh.shared.subjects import Subjects

BOTH = ("both",) * 4
PD = ("decode", "decode", "prefill", "prefill")


def directory(roles: tuple[str, ...]) -> WorkerDirectory:
    found = WorkerDirectory(cast(Any, None), Subjects("bench"))  # never started: no NATS
    for i, role in enumerate(roles):
        card: dict[str, Any] = {
            "id": f"w{i}",
            "subject": f"genmesh.bench.worker.w{i}.generate",
            "model": "m",
            "inflight": 8,
            "capacity": 256,
            "kv_events": True,
            "engine_info": {"model": "m", "block_size": 16},
            "role": role,
        }
        if role != "both":
            card["disagg"] = {"kind": "mock", "local_prefill": True}
        found._update(card)
    return found


def reported(decision: Decision) -> None:
    """The workers' next cards, as far as routing reads them: what was sent is seen."""
    decision.worker.sent_since_report = 0
    if decision.prefill is not None:
        decision.prefill.sent_since_report = 0


def case(roles: tuple[str, ...], policy: str, threshold: int = 0) -> Callable[..., float]:
    def run(number: int, envelope: Envelope) -> float:
        chooser = Chooser(
            directory(roles), make_policy(policy), None, PdConfig(local_prefill_tokens=threshold)
        )
        start = time.perf_counter_ns()
        for _ in range(number):
            # A request of its own, as in a mesh (the kv policy hashes each envelope once).
            decision = chooser.choose(replace(envelope))
            reported(decision)
            chooser.ended(decision)
        return (time.perf_counter_ns() - start) / number / 1000.0

    return run


CASES: dict[str, Callable[..., float]] = {
    "aggregated": case(BOTH, "round_robin"),
    "pair": case(PD, "round_robin"),
    "local": case(PD, "round_robin", threshold=2048),
    "aggregated kv": case(BOTH, "kv"),
    "pair kv": case(PD, "kv"),
}


def measure(repeats: int, number: int) -> dict[str, float]:
    envelope = request(list(range(1, 1025)))
    runs: dict[str, list[float]] = {name: [] for name in CASES}
    for run in CASES.values():  # warm-up
        run(number // 10 or 1, envelope)
    for _ in range(repeats):
        for name, run in CASES.items():
            runs[name].append(run(number, envelope))
    return {name: statistics.median(values) for name, values in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--number", type=int, default=20_000)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    figures = measure(args.repeats, args.number)
    if args.json:
        print(json.dumps(figures))
        return
    print(f"routing core per request, median of {args.repeats} x {args.number}, 4 workers:")
    for name, us in figures.items():
        base = figures["aggregated kv" if name.endswith("kv") else "aggregated"]
        print(f"  {name:<14} {us:7.3f} us   ({us - base:+.3f} us)")


if __name__ == "__main__":
    main()

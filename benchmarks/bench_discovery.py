"""What a directory spends on one worker card (`WorkerDirectory._update`).

    .venv/bin/python benchmarks/bench_discovery.py [--repeats R] [--number N] [--json]

Every router and frontend handles a card per worker per heartbeat and per load change
(every ~50 ms under load), so this is discovery's hot path. Cases, interleaved in one run:

- `mock card`: a mock worker's whole card as it announces it (protocol.md §9.1's example);
- `decode card`: the same as a decode worker's (`role`, `disagg`: the P/D checks);
- `refused card`: a card with a NaN `heartbeat_s`, which the directory ignores (its log
  line throttled: one per 10 s).

Only `_update` is timed, which every version of genmesh has: run it against another
checkout's sources with `PYTHONPATH=<checkout>/src` to compare (protocol.md's rules and
`shared/cards.py` are what differ).

Prints the median over R runs of N cards, in microseconds of CPU per card.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from typing import Any, cast

from genmesh.shared.discovery import WorkerDirectory
from genmesh.shared.subjects import Subjects

MOCK_CARD: dict[str, Any] = {
    "model": "genmesh-mock",
    "formats": ["*"],
    "vocab_size": 151936,
    "eos_token_id": 151645,
    "max_model_len": 32768,
    "engine_info": {
        "model": "genmesh-mock",
        "context_length": 32768,
        "max_total_num_tokens": 1048576,
        "block_size": 16,
        "engine_version": "genmesh-mock-0.1.0",
        "vocab_size": 151936,
        "max_logprobs": 20,
    },
    "speedup": 0.002,
    "moe": {"layers": 4, "top_k": 2, "experts": 16},
    "v": 1,
    "id": "wslow",
    "subject": "genmesh.bench.worker.wslow.generate",
    "engine": "mock",
    "inflight": 3,
    "running": 2,
    "queued": 1,
    "capacity": 256,
    "heartbeat_s": 1.0,
    "started": 1795969670.6315217,
    "host": "vm",
    "pid": 12993,
    "stats": {"admitted": 1, "completed": 0, "cancelled": 1, "failed": 0, "rejected": 1},
    "kv_blocks_used": 10,
    "kv_blocks_total": 65536,
    "role": "both",
}
CASES: dict[str, dict[str, Any]] = {
    "mock card": MOCK_CARD,
    "decode card": {
        **MOCK_CARD,
        "role": "decode",
        "disagg": {"kind": "mock", "local_prefill": True, "handles": 0},
    },
    "refused card": {**MOCK_CARD, "id": "wbad", "heartbeat_s": float("nan")},
}


def run(card: dict[str, Any], number: int) -> float:
    directory = WorkerDirectory(cast(Any, None), Subjects("bench"))  # never started: no NATS
    update = directory._update
    update(card)  # joined: what follows are the reports of a known worker
    # CPU time, not wall time: the work is all CPU, and on a shared machine the wall clock
    # also counts the time other processes held the core.
    start = time.process_time_ns()
    for _ in range(number):
        update(card)
    return (time.process_time_ns() - start) / number / 1000.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--number", type=int, default=50_000)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    logging.getLogger("genmesh").setLevel(logging.WARNING)  # the refusals' lines: not timed
    runs: dict[str, list[float]] = {name: [] for name in CASES}
    for card in CASES.values():  # warm-up
        run(card, args.number // 10 or 1)
    for _ in range(args.repeats):
        for name, card in CASES.items():
            runs[name].append(run(card, args.number))
    figures = {name: statistics.median(values) for name, values in runs.items()}
    if args.json:
        print(json.dumps(figures))
        return
    print(f"directory per card, median of {args.repeats} x {args.number}:")
    for name, us in figures.items():
        print(f"  {name:<13} {us:6.3f} us")


if __name__ == "__main__":
    main()

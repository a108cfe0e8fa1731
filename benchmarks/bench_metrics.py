"""What the frontend's Prometheus metrics cost per request (the observer path alone).

    .venv/bin/python benchmarks/bench_metrics.py [--tokens 256] [--repeats 15]

Feeds one request's observer calls (arrival, dispatch of one 100-token prompt, an `ack`,
`--tokens` one-token `out` frames and an `end`, finish) through `Observation`, as the
generate handler does, with no observer and with `FrontendMetrics`; the difference is what
metrics add. Best of `--repeats` runs, so other load on the machine inflates it least.
Also times one scrape of `/metrics` (rendering the registry). See docs/observability.md,
"Metrics".
"""

from __future__ import annotations

import argparse
import time
import timeit
from typing import Any

from genmesh.services.frontend.metrics import FrontendMetrics
from genmesh.services.frontend.observers import Observation, Observer, RequestInfo
from genmesh.shared.envelope import Envelope
from genmesh.shared.metrics import metrics_response


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    item = Envelope(id="r", token_ids=list(range(100)))
    ack: dict[str, Any] = {"t": "ack", "id": "r", "seq": 0, "worker": "w"}
    outs = [{"t": "out", "id": "r", "seq": i + 1, "tokens": [i]} for i in range(args.tokens - 1)]
    end = {"t": "end", "id": "r", "seq": args.tokens, "tokens": [9], "usage": {}}

    def request(observers: list[Observer], frames: bool = True) -> None:
        info = RequestInfo("sglang", "POST", "/generate", time.monotonic(), time.time())
        obs = Observation(observers, info)
        info.items = [item]
        obs.dispatched()
        if frames:
            obs.frame(0, ack)
            for frame in outs:
                obs.frame(0, frame)
            obs.frame(0, end)
        obs.finished(200, None)

    def best(call: Any, number: int) -> float:
        return min(timeit.repeat(call, number=number, repeat=args.repeats)) / number

    metrics = FrontendMetrics()
    bare = best(lambda: request([]), 200)
    measured = best(lambda: request([metrics]), 200)
    fixed = best(lambda: request([metrics], frames=False), 2000) - best(
        lambda: request([], frames=False), 2000
    )
    scrape = best(lambda: metrics_response(metrics.registry), 50)
    print(f"{args.tokens}-token request, observer calls without metrics: {bare * 1e6:7.1f} us")
    print(f"{args.tokens}-token request, with metrics:                    {measured * 1e6:7.1f} us")
    print(f"metrics add per request (no frames):                 {fixed * 1e6:7.2f} us")
    per_frame = (measured - bare - fixed) / (args.tokens + 1)
    print(f"metrics add per frame (1 token):                     {per_frame * 1e9:7.0f} ns")
    print(f"one /metrics render:                                 {scrape * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()

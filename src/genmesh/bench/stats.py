"""The figures of a measured phase.

Percentiles interpolate linearly between the two nearest ranks (numpy's default, and
`../shared/peers/loadgen.py`'s), so the two tools' p50/p99 mean the same thing. Latencies
count successful requests only; throughput is what succeeded over the phase's wall time
(first send to last answer, or to the stop). A stopped phase's requests cut off in flight
are neither completed nor errors: they are counted apart.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from genmesh.bench.runner import Phase

PERCENTILES = (50, 90, 99)


def percentile(ordered: Sequence[float], p: float) -> float:
    """The p-th percentile of sorted values, interpolated; NaN without values."""
    if not ordered:
        return float("nan")
    rank = (len(ordered) - 1) * p / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True, slots=True)
class Distribution:
    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        ordered = sorted(values)
        if not ordered:
            nan = float("nan")
            return cls(0, nan, nan, nan, nan, nan)
        p50, p90, p99 = (percentile(ordered, p) for p in PERCENTILES)
        return cls(len(ordered), sum(ordered) / len(ordered), p50, p90, p99, ordered[-1])

    def scaled(self, factor: float) -> dict[str, float | int]:
        """As JSON, values times `factor` (1000: seconds as milliseconds)."""
        return {
            "count": self.count,
            **{
                name: round(value * factor, 4)
                for name, value in (
                    ("mean", self.mean),
                    ("p50", self.p50),
                    ("p90", self.p90),
                    ("p99", self.p99),
                    ("max", self.max),
                )
            },
        }


@dataclass(frozen=True, slots=True)
class Summary:
    requests: int
    completed: int
    errors: dict[str, int]
    seconds: float
    output_tokens: int
    short: int  # completed with fewer output tokens than asked
    ttft: Distribution
    itl: Distribution
    e2e: Distribution
    tokens: Distribution  # output tokens per completed request
    client_cpu_seconds: float
    stopped: bool
    cut_off: int

    @property
    def request_rate(self) -> float:
        return self.completed / self.seconds if self.seconds > 0 else 0.0

    @property
    def token_rate(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def client_cpu_ms_per_request(self) -> float:
        return 1000.0 * self.client_cpu_seconds / self.requests if self.requests else 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "completed": self.completed,
            "errors": self.errors,
            "duration_s": round(self.seconds, 4),
            "request_throughput": round(self.request_rate, 3),
            "output_throughput": round(self.token_rate, 3),
            "output_tokens": self.output_tokens,
            "short_outputs": self.short,
            "ttft_ms": self.ttft.scaled(1000.0),
            "itl_ms": self.itl.scaled(1000.0),
            "e2e_ms": self.e2e.scaled(1000.0),
            "output_tokens_per_request": self.tokens.scaled(1.0),
            "client_cpu_s": round(self.client_cpu_seconds, 4),
            "client_cpu_ms_per_request": round(self.client_cpu_ms_per_request, 4),
            "stopped": self.stopped,
            "cut_off": self.cut_off,
        }


def summarize(phase: Phase) -> Summary:
    ok = [r for r in phase.records if r.ok]
    return Summary(
        requests=len(phase.records),
        completed=len(ok),
        errors=dict(Counter(r.error for r in phase.records if r.error is not None)),
        seconds=phase.seconds,
        output_tokens=sum(r.output_tokens for r in ok),
        short=sum(r.output_tokens < r.asked_tokens for r in ok),
        ttft=Distribution.of([r.ttft for r in ok if r.ttft is not None]),
        itl=Distribution.of([gap for r in ok for gap in r.itl]),
        e2e=Distribution.of([r.e2e for r in ok if r.e2e is not None]),
        tokens=Distribution.of([r.output_tokens for r in ok]),
        client_cpu_seconds=phase.cpu_seconds,
        stopped=phase.stopped,
        cut_off=phase.cut_off,
    )

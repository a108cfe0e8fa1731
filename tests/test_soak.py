"""The soak benchmark's short variant (benchmarks/bench_soak.py): about a minute of mixed
traffic (both formats, SSE and unary, client disconnects) over a process mesh while a
worker is SIGKILLed and replaced and NATS goes down and comes back; no request may be
lost, and no process that lived through it may grow much. `GENMESH_SOAK_SECONDS` sets
the length (the benchmark itself runs 30 minutes)."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_soak

SECONDS = float(os.environ.get("GENMESH_SOAK_SECONDS", "60"))
# Bounded growth over the run (after its first tenth, the warm-up): allocator noise and
# caches that fill once stay below these; a leak per request (thousands of them) does not.
RSS_GROWTH_MB = 25.0
FDS_GROWTH = 8


@pytest.mark.chaos
@pytest.mark.timeout(SECONDS + 120)
def test_soak_short(tmp_path: Path) -> None:
    config = bench_soak.SoakConfig(
        seconds=SECONDS,
        clients=4,
        kill_every_s=SECONDS / 3,
        blip_every_s=SECONDS / 2,
        sample_every_s=2.0,
    )
    report = asyncio.run(bench_soak.run_soak(config, tmp_path))
    print("\n" + report.table())
    assert not report.lost, report.table()
    assert report.outcomes["ok"] > 100, report.outcomes
    assert any("killed" in e for e in report.events), report.events
    assert any("NATS down" in e for e in report.events), report.events
    assert {"frontend", "router0"} <= set(report.survivors), report.survivors
    for name in report.survivors:
        start, peak, end = report.start_peak_end(name)
        assert peak.rss_mb - start.rss_mb < RSS_GROWTH_MB, (name, report.table())
        assert end.fds - start.fds <= FDS_GROWTH, (name, report.table())

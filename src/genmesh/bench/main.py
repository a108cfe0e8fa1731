"""`genmesh bench` from its config to its outputs: warm-up, measured phase, table, JSON
file, plot. Exits 0 when every measured request succeeded, 1 when some failed."""

from __future__ import annotations

import io
import sys

from rich.console import Console

from genmesh.bench import plot, report
from genmesh.bench.config import BenchConfig
from genmesh.bench.runner import Phase, Target, measured_count, new_session, run_phase
from genmesh.bench.stats import Summary, summarize
from genmesh.bench.workload import Workload


async def bench(config: BenchConfig) -> tuple[str, Phase, Summary]:
    """Run the warm-up and the measured phase: (the URL, the phase, its summary)."""
    measured = Workload(config)
    async with new_session(config) as session:
        url = Target(config, measured.api, session).url
        with report.LiveProgress(config.progress) as progress:
            if config.warmup:
                progress.phase("warm-up", config.warmup)
                await run_phase(
                    config,
                    session,
                    Workload(config, "warmup"),
                    config.warmup,
                    progress.advance,
                    measured=False,
                )
            count = measured_count(config)
            progress.phase("bench", count)
            phase = await run_phase(config, session, measured, count, progress.advance)
    return url, phase, summarize(phase)


def main_bench(config: BenchConfig) -> int:
    from genmesh.shared.loop import run

    if config.plot is not None:
        try:
            plot.require()
        except plot.PlotUnavailable as exc:
            print(f"genmesh bench: error: {exc}", file=sys.stderr)
            return 2
    url, phase, summary = run(bench(config), "uvloop")
    table = report.table(config, url, summary)
    Console().print(table)
    if config.json_out is not None:
        report.write_json(config.json_out, config, url, summary, phase.records)
    if config.plot is not None:
        text = Console(file=io.StringIO(), width=110, record=True)
        text.print(table)
        plot.write(config.plot, str(table.title), summary, phase.records, text.export_text())
    return 0 if not summary.errors else 1

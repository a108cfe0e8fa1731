"""`genmesh bench` from its config to its outputs: warm-up, measured phase, table, JSON
file, plot. Exits 0 when every measured request succeeded, 1 when some failed, 130 when a
signal stopped it (after reporting what completed until then)."""

from __future__ import annotations

import asyncio
import io
import sys

from rich.console import Console

from genmesh.bench import plot, report
from genmesh.bench.config import BenchConfig
from genmesh.bench.runner import Phase, Target, measured_count, new_session, run_phase
from genmesh.bench.stats import Summary, summarize
from genmesh.bench.workload import Workload
from genmesh.shared.lifecycle import STOPPED_BY_SIGNAL, stop_signals


async def bench(
    config: BenchConfig, stop: asyncio.Event | None = None
) -> tuple[str, Phase, Summary]:
    """Run the warm-up and the measured phase, until their end or `stop`: (the URL, the
    measured phase, its summary). Stopped in the warm-up, nothing is measured: the phase
    is empty."""
    stop = asyncio.Event() if stop is None else stop
    measured = Workload(config)
    async with new_session(config) as session:
        url = Target(config, measured.api, session).url
        with report.LiveProgress(config.progress) as progress:
            if config.warmup:
                progress.phase("warm-up", config.warmup)
                warmup = await run_phase(
                    config,
                    session,
                    Workload(config, "warmup"),
                    config.warmup,
                    progress.advance,
                    stop,
                    measured=False,
                )
                if warmup.stopped:
                    phase = Phase([], 0.0, 0.0, stopped=True)
                    return url, phase, summarize(phase)
            count = measured_count(config)
            progress.phase("bench", count)
            phase = await run_phase(config, session, measured, count, progress.advance, stop)
    return url, phase, summarize(phase)


async def bench_until_signal(config: BenchConfig) -> tuple[str, Phase, Summary]:
    """`bench`, stopped by the first Ctrl-C or SIGTERM; the second raises KeyboardInterrupt
    (the command exits at once). Past the run, the signals are Python's again: a Ctrl-C
    while the outputs are written interrupts them."""
    async with stop_signals(insist=True) as stop:
        return await bench(config, stop)


def main_bench(config: BenchConfig) -> int:
    from genmesh.shared.loop import run

    if config.plot is not None:
        try:
            plot.require()
        except plot.PlotUnavailable as exc:
            print(f"genmesh bench: error: {exc}", file=sys.stderr)
            return 2
    url, phase, summary = run(bench_until_signal(config), "uvloop")
    table = report.table(config, url, summary)
    Console().print(table)
    if config.json_out is not None:
        report.write_json(config.json_out, config, url, summary, phase.records)
    if config.plot is not None:
        text = Console(file=io.StringIO(), width=110, record=True)
        text.print(table)
        plot.write(config.plot, str(table.title), summary, phase.records, text.export_text())
    if summary.stopped:
        return STOPPED_BY_SIGNAL
    return 0 if not summary.errors else 1

"""What a person sees: the live progress bar (rich, on stderr, redrawn 4 times a second
by rich's own thread, so a finished request costs one counter update), the summary table
(stdout) and the `--json-out` file."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from genmesh import __version__
from genmesh.bench.config import BenchConfig
from genmesh.bench.runner import Record
from genmesh.bench.stats import Distribution, Summary


class LiveProgress:
    """Requests done (of -n, or seconds of --duration), req/s and errors so far."""

    def __init__(self, enabled: bool) -> None:
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]:>8.1f} req/s  errors {task.fields[errors]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            refresh_per_second=4,
            disable=not enabled,
        )
        self.task: TaskID | None = None
        self.done = 0
        self.errors = 0

    def __enter__(self) -> LiveProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def phase(self, name: str, total: int | None) -> None:
        if self.task is not None:
            self.progress.remove_task(self.task)
        self.done = self.errors = 0
        self.task = self.progress.add_task(name, total=total, rate=0.0, errors=0)

    def advance(self, record: Record) -> None:
        assert self.task is not None
        self.done += 1
        self.errors += not record.ok
        elapsed = self.progress.tasks[-1].elapsed or 0.0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        self.progress.update(self.task, advance=1, rate=rate, errors=self.errors)


def _ms(value: float) -> str:
    return "-" if value != value else f"{value * 1000:.2f}"  # NaN: no value


def table(config: BenchConfig, url: str, summary: Summary) -> Table:
    loop = (
        f"open loop {config.request_rate} req/s"
        + (f", at most {config.max_concurrency} in flight" if config.max_concurrency else "")
        if config.request_rate is not None
        else f"closed loop, concurrency {config.concurrency}"
    )
    mode = "SSE" if config.stream else "unary"
    errors = ", ".join(f"{kind}: {n}" for kind, n in sorted(summary.errors.items())) or "none"
    caption = (
        f"{summary.completed}/{summary.requests} ok in {summary.seconds:.2f} s  "
        f"{summary.request_rate:.1f} req/s  {summary.token_rate:.0f} output tok/s\n"
        f"errors: {errors}"
        + (f"  (short outputs: {summary.short})" if summary.short else "")
        + f"\nload generator CPU: {summary.client_cpu_ms_per_request:.3f} ms per request"
        + (
            f"\nstopped by a signal: {summary.cut_off} in flight cut off (not counted)"
            if summary.stopped
            else ""
        )
    )
    out = Table(
        title=f"genmesh bench: {url}\n{config.format}, {mode}, {loop}",
        caption=caption,
        caption_justify="left",
    )
    out.add_column("")
    for column in ("mean", "p50", "p90", "p99", "max"):
        out.add_column(column, justify="right")

    def row(name: str, dist: Distribution, show: Any) -> None:
        out.add_row(name, *(show(v) for v in (dist.mean, dist.p50, dist.p90, dist.p99, dist.max)))

    row("TTFT (ms)", summary.ttft, _ms)
    row("ITL (ms)", summary.itl, _ms)
    row("end to end (ms)", summary.e2e, _ms)
    row("output tokens", summary.tokens, lambda v: "-" if v != v else f"{v:.1f}")
    return out


def record_json(record: Record) -> dict[str, Any]:
    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else round(seconds * 1000.0, 4)

    return {
        "index": record.index,
        "prompt_tokens": record.prompt_tokens,
        "asked_tokens": record.asked_tokens,
        "output_tokens": record.output_tokens,
        "arrived_ms": ms(record.arrived),
        "sent_ms": ms(record.sent),
        "ttft_ms": ms(record.ttft),
        "e2e_ms": ms(record.e2e),
        "itl_ms": [ms(gap) for gap in record.itl],
        "error": record.error,
    }


def write_json(
    path: str, config: BenchConfig, url: str, summary: Summary, records: list[Record]
) -> None:
    document = {
        "genmesh_version": __version__,
        "url": url,
        "config": dataclasses.asdict(config),
        "summary": summary.as_json(),
        "requests": [record_json(r) for r in records],
    }
    Path(path).write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))

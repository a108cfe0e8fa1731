"""`--plot FILE.png|FILE.html`: the latency CDFs (TTFT, inter-token, end to end) and
throughput over time, in one figure.

matplotlib draws both: PNG, and the HTML page as the same figure in SVG inside a small
page with the summary table, which opens anywhere and loads nothing. One library for both,
and the lighter file: a self-contained plotly page carries plotly.js inline (megabytes, in
every file), where this page is ~90 kB, about the same whatever the run's size (each CDF is drawn
through at most CDF_POINTS quantiles). matplotlib is the optional `bench` extra
(`pip install 'genmesh[bench]'`); `require()` says so before a run starts.
"""

from __future__ import annotations

import html
import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from genmesh.bench.runner import Record
from genmesh.bench.stats import Distribution, Summary, percentile

if TYPE_CHECKING:
    from matplotlib.axes import Axes

# A CDF is drawn through at most this many quantiles: the picture is the same, and an SVG
# of a million inter-token gaps stays small.
CDF_POINTS = 1000
MISSING_EXTRA = (
    "--plot needs matplotlib, in the optional `bench` extra: pip install 'genmesh[bench]'"
)


class PlotUnavailable(RuntimeError):
    pass


def require() -> None:
    """PlotUnavailable, with how to install it, if matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotUnavailable(MISSING_EXTRA) from None


def _cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    """(milliseconds, fraction) points of the empirical CDF, thinned to CDF_POINTS."""
    ordered = sorted(values)
    if not ordered:
        return [], []
    steps = min(len(ordered), CDF_POINTS)
    fractions = [i / (steps - 1) if steps > 1 else 1.0 for i in range(steps)]
    return [percentile(ordered, f * 100) * 1000 for f in fractions], fractions


def token_times(record: Record) -> list[float]:
    """When each output token of a successful request arrived (seconds from the start):
    the first event's tokens at TTFT, each later one after its inter-token gap."""
    if record.ttft is None:
        return []
    first = record.output_tokens - len(record.itl)
    at = record.sent + record.ttft
    times = [at] * first
    for gap in record.itl:
        at += gap
        times.append(at)
    return times


def bin_width(seconds: float) -> float:
    """A round bin width giving 30 to 75 bins over `seconds` (fewer for the shortest runs)."""
    for width in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60):
        if seconds / width <= 75:
            return width
    return 60 * math.ceil(seconds / (60 * 75))


def _throughput(ax: Axes, records: list[Record], seconds: float) -> None:
    width = bin_width(seconds)
    bins = max(1, math.ceil(seconds / width))
    tokens = [0.0] * bins
    answers = [0.0] * bins
    for record in records:
        if not record.ok or record.e2e is None:
            continue
        for at in token_times(record):
            tokens[min(int(at / width), bins - 1)] += 1 / width
        answers[min(int((record.sent + record.e2e) / width), bins - 1)] += 1 / width
    starts = [i * width for i in range(bins)]
    ax.step(starts, tokens, where="post", color="tab:blue", label="output tok/s")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens/s", color="tab:blue")
    ax.set_ylim(bottom=0)
    twin = ax.twinx()
    twin.step(starts, answers, where="post", color="tab:orange", label="answers/s")
    twin.set_ylabel("requests completed/s", color="tab:orange")
    twin.set_ylim(bottom=0)
    ax.set_title(f"throughput over time ({width:g} s bins)")
    ax.grid(alpha=0.3)


def _cdf_panel(ax: Axes, title: str, values: Sequence[float], dist: Distribution) -> None:
    xs, ys = _cdf(values)
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of samples ≤ x")
    ax.grid(alpha=0.3)
    if not xs:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        return
    ax.plot(xs, ys, color="tab:green")
    marks = (("p50", dist.p50, ":"), ("p90", dist.p90, "-."), ("p99", dist.p99, "--"))
    for name, value, style in marks:
        ax.axvline(value * 1000, color="grey", linestyle=style, linewidth=1)
        ax.annotate(
            f"{name} {value * 1000:.3g}",
            (value * 1000, 0.02),
            rotation=90,
            fontsize=8,
            ha="right",
            va="bottom",
        )
    ax.set_ylim(0, 1.02)


def figure(title: str, summary: Summary, records: list[Record]) -> Any:
    # A bare Figure, not pyplot: no backend or GUI toolkit is chosen, savefig draws files.
    from matplotlib.figure import Figure

    ok = [r for r in records if r.ok]
    fig = Figure(figsize=(13, 9), layout="constrained")
    axes = fig.subplots(2, 2)
    _cdf_panel(axes[0][0], "time to first token", [r.ttft for r in ok if r.ttft], summary.ttft)
    _cdf_panel(axes[0][1], "inter-token latency", [g for r in ok for g in r.itl], summary.itl)
    _cdf_panel(axes[1][0], "end to end", [r.e2e for r in ok if r.e2e], summary.e2e)
    _throughput(axes[1][1], records, summary.seconds)
    errors = sum(summary.errors.values())
    fig.suptitle(
        f"{title}\n{summary.completed} ok, {errors} errors, {summary.request_rate:.1f} req/s, "
        f"{summary.token_rate:.0f} output tok/s",
        fontsize=12,
    )
    return fig


def write(path: str, title: str, summary: Summary, records: list[Record], table: str) -> None:
    """The figure as PNG, or as an HTML page (the SVG figure, then `table`, preformatted)."""
    fig = figure(title, summary, records)
    if path.endswith(".png"):
        fig.savefig(path, dpi=100)
        return
    import matplotlib

    svg = io.StringIO()
    # Text as text, not glyph outlines: a third of the size, and the page can be searched.
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        fig.savefig(svg, format="svg")
    inline = svg.getvalue()
    inline = inline[inline.index("<svg") :]  # no XML prologue inside HTML
    page = (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif;margin:2em}svg{max-width:100%;height:auto}"
        "pre{background:#f6f6f6;padding:1em}</style></head><body>\n"
        f"<h1>{html.escape(title)}</h1>\n{inline}\n"
        f"<pre>{html.escape(table)}</pre>\n</body></html>\n"
    )
    Path(path).write_text(page, encoding="utf-8")

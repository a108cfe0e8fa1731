"""Prometheus exposition shared by every service (docs/observability.md, "Metrics").

Each service keeps its own `CollectorRegistry` (never the process-global default), so
several services in one process, as in tests, never collide. The frontend serves its
registry on `GET /metrics` of its own HTTP port; routers and workers serve theirs on a
small HTTP server of their own when started with `--metrics-port` (0 = off).
"""

from __future__ import annotations

import contextlib
import logging
from bisect import bisect_left
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from genmesh.shared.connection import MetricsConfig

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"

# No `*_created` series: they double every counter's lines and say only when the process
# started, which `process_start_time_seconds` already does. (A process-wide switch; every
# registry in a genmesh process is genmesh's own.)
disable_created_metrics()  # type: ignore[no-untyped-call]


def counter_by_code(
    name: str, documentation: str, known: Sequence[str], counts: Mapping[str, int]
) -> CounterMetricFamily:
    """A counter labelled by genmesh error code: every `known` code shows, at 0 if unseen,
    so a dashboard's series exist before the first error."""
    family = CounterMetricFamily(name, documentation, labels=["code"])
    for code in sorted(set(known) | set(counts)):
        family.add_metric([code], counts.get(code, 0))
    return family


def new_registry() -> CollectorRegistry:
    """A service's own registry, with the standard `process_*` metrics (CPU, memory, fds)."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    return registry


class LoopHistogram(Collector):
    """A labelled histogram for code that runs on one event loop (the frontend's per-token
    path): observing is a bisect and two additions, with none of the locks that
    `prometheus_client.Histogram` takes for threads. Scrapes run on the same loop, so they
    always see a consistent state. Exposed like any Prometheus histogram."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.bounds = sorted(float(b) for b in buckets)
        self._children: dict[tuple[str, ...], HistogramChild] = {}
        registry.register(self)

    def labels(self, *values: str) -> HistogramChild:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = HistogramChild(self.bounds)
        return child

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self._children.items():
            family.add_metric(list(values), child.cumulative(), child.sum)
        yield family


class HistogramChild:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = sorted(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def cumulative(self) -> list[tuple[str, float]]:
        """(le, count of values up to it) for each bucket, as Prometheus exposes them."""
        out, running = [], 0
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]  # type: ignore[no-untyped-call]
        for le, count in zip(les, self.counts, strict=True):
            running += count
            out.append((le, float(running)))
        return out

    def family(self, name: str, documentation: str) -> HistogramMetricFamily:
        """This histogram alone, as a metric family (for collectors that build theirs at
        scrape time)."""
        family = HistogramMetricFamily(name, documentation)
        family.add_metric([], self.cumulative(), self.sum)
        return family

    def observe(self, value: float) -> None:
        # Buckets are `le` (less or equal): bisect_left puts a value equal to a bound in it.
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


class LoopCounter(Collector):
    """A labelled counter for one event loop, like `LoopHistogram`: `child.value += n`."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], CounterChild] = {}
        registry.register(self)

    def labels(self, *values: str) -> CounterChild:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = CounterChild()
        return child

    def describe(self) -> Iterator[Metric]:
        yield CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self._children.items():
            family.add_metric(list(values), child.value)
        yield family


class CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


def metrics_response(registry: CollectorRegistry) -> web.Response:
    """The registry in the Prometheus text format (a few hundred lines at most: rendered
    inline, it takes well under a millisecond)."""
    return web.Response(
        body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


def metrics_handler(registry: CollectorRegistry) -> Handler:
    async def handle(request: web.Request) -> web.Response:
        return metrics_response(registry)

    return handle


@dataclass(slots=True)
class MetricsServer:
    """A started metrics endpoint: `http://<host>:<port>/metrics`."""

    runner: web.AppRunner
    port: int

    async def close(self) -> None:
        await self.runner.cleanup()


async def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    """Serve `registry` on `GET /metrics` at host:port (port 0 would pick a free port; the
    services call this only for a port other than 0, which means "off")."""
    app = web.Application()
    app.router.add_get(METRICS_PATH, metrics_handler(registry))
    runner = web.AppRunner(app, access_log=None)
    async with contextlib.AsyncExitStack() as stack:  # cleaned up if the port is taken
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        await web.TCPSite(runner, host, port).start()
        stack.pop_all()
    bound = runner.addresses[0][1]
    log.info("metrics on http://%s:%d%s", host, bound, METRICS_PATH)
    return MetricsServer(runner, bound)


@contextlib.asynccontextmanager
async def serving_metrics(
    config: MetricsConfig, registry: Callable[[], CollectorRegistry]
) -> AsyncIterator[MetricsServer | None]:
    """A router's or worker's metrics endpoint for the duration of the block; nothing when
    its port is 0 (the default: off)."""
    if not config.port:
        yield None
        return
    server = await serve_metrics(registry(), config.host, config.port)
    try:
        yield server
    finally:
        await server.close()

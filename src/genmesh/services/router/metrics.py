"""A router's Prometheus metrics, read from the router's own counters at scrape time.

The request path only bumps `Router.decisions` and `Router.rejections` (plain
`collections.Counter`s); this collector turns them into metric families when scraped.
Served on `--metrics-port` (docs/observability.md, "Metrics").
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from genmesh.routing.kv_feed import KvCollector
from genmesh.routing.metrics import AdmissionCollector, PdCollector
from genmesh.shared.errors import ErrorCode
from genmesh.shared.metrics import counter_by_code, new_registry

if TYPE_CHECKING:
    from genmesh.services.router.service import Router

# Every code a router answers with itself, shown from the start (at 0).
REJECTION_CODES = tuple(
    code.value
    for code in (
        ErrorCode.NO_WORKER,
        ErrorCode.NOT_FOUND,
        ErrorCode.OVERLOADED,
        ErrorCode.BAD_ENVELOPE,
        ErrorCode.UNKNOWN_CODEC,
    )
)


class RouterCollector(Collector):
    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator[Metric]:
        router = self.router
        policy = router.policy.name
        info = GaugeMetricFamily(
            "genmesh_router_info",
            "This router: its id and policy (always 1)",
            labels=["router", "policy"],
        )
        info.add_metric([router.router_id, policy], 1)
        yield info
        yield GaugeMetricFamily(
            "genmesh_router_workers",
            "Workers this router knows as live (announced within 3 heartbeats)",
            value=len(router.directory.live()),
        )
        decisions = CounterMetricFamily(
            "genmesh_router_decisions",
            "Requests forwarded, by policy and chosen worker",
            labels=["policy", "worker"],
        )
        for worker, count in sorted(router.decisions.items()):
            decisions.add_metric([policy, worker], count)
        yield decisions
        yield counter_by_code(
            "genmesh_router_rejections",
            "Requests the router answered with an error itself, by genmesh error code",
            REJECTION_CODES,
            router.rejections,
        )


def router_registry(router: Router) -> CollectorRegistry:
    registry = new_registry()
    registry.register(RouterCollector(router))
    registry.register(AdmissionCollector(router.admission, "genmesh_router_"))
    registry.register(PdCollector(router.admission.chooser))
    if router.kv is not None:
        registry.register(KvCollector(router.kv))
    return registry

"""The routing core's Prometheus metrics, read from its counters at scrape time, for the
registry of whichever process routes: the admission queue's (a frontend's
`genmesh_frontend_`, a router's `genmesh_router_`) and the P/D paths (`genmesh_pd_`, the
same name in both): docs/observability.md, "Metrics"."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from genmesh.routing.admission import REFUSAL_REASONS, Admission
from genmesh.routing.choice import Chooser
from genmesh.routing.pairing import PATHS


class AdmissionCollector(Collector):
    def __init__(self, admission: Admission, prefix: str) -> None:
        self.admission = admission
        self.prefix = prefix

    def collect(self) -> Iterator[Metric]:
        admission, prefix = self.admission, self.prefix
        yield GaugeMetricFamily(
            prefix + "admission_queue_depth",
            "Requests waiting in the admission queue for a worker that is not busy",
            value=admission.depth,
        )
        yield CounterMetricFamily(
            prefix + "admission_queued",
            "Requests that had to wait in the admission queue",
            value=admission.entered,
        )
        refusals = CounterMetricFamily(
            prefix + "admission_refusals",
            "Requests the admission queue refused: full, waited --admission-max-wait, "
            "their deadline passed, or shutdown",
            labels=["reason"],
        )
        for reason in REFUSAL_REASONS:
            refusals.add_metric([reason], admission.refusals[reason])
        yield refusals


class PdCollector(Collector):
    """`genmesh_pd_routed_total{path}`: requests routed to decode workers, by how they run
    (routing/pairing.py); every path shown from the start, at 0."""

    def __init__(self, chooser: Chooser) -> None:
        self.chooser = chooser

    def collect(self) -> Iterator[Metric]:
        routed = CounterMetricFamily(
            "genmesh_pd_routed",
            "Requests routed to a decode worker, by path: disaggregated (with a prefill "
            "worker), local (little uncached: --pd-local-prefill-tokens), fallback (no "
            "prefill worker free, run alone on the decode worker)",
            labels=["path"],
        )
        for path in PATHS:
            routed.add_metric([path], self.chooser.pd_routed[path])
        yield routed

"""The admission queue's Prometheus metrics, read from its counters at scrape time, for
the registry of whichever process routes (a frontend's `genmesh_frontend_`, a router's
`genmesh_router_`): docs/observability.md, "Metrics"."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from genmesh.routing.admission import REFUSAL_REASONS, Admission


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

"""A worker's Prometheus metrics, read from the worker's own counters at scrape time.

The request path only bumps plain integers on the `Worker` (`stats`, `rejections`,
`aborts`, `engine_errors`); this collector turns them into metric families when scraped,
so metrics cost the worker nothing per token. Served on `--metrics-port`
(docs/observability.md, "Metrics").
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from genmesh.shared.cards import ROLE_PREFILL
from genmesh.shared.errors import ErrorCode
from genmesh.shared.metrics import counter_by_code, new_registry

if TYPE_CHECKING:
    from genmesh.services.worker.service import Worker

OUTCOMES = ("completed", "cancelled", "failed")
# Shown from the start (at 0): what engines raise (engines/base.py), and what `execute`
# makes of anything else.
ENGINE_ERROR_CODES = (
    ErrorCode.INVALID_ARGUMENT.value,
    ErrorCode.UNAVAILABLE.value,
    ErrorCode.INTERNAL.value,
)


class WorkerCollector(Collector):
    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def collect(self) -> Iterator[Metric]:
        worker = self.worker
        info = GaugeMetricFamily(
            "genmesh_worker_info",
            "This worker: its id, engine and model (always 1)",
            labels=["worker", "engine", "model"],
        )
        model = worker.engine.describe().get("model")
        info.add_metric([worker.worker_id, worker.engine.name, str(model or "")], 1)
        yield info
        yield GaugeMetricFamily(
            "genmesh_worker_engine_up",
            "1 while the engine passes its health checks (the worker is in discovery), else 0",
            value=1 if worker.engine_up else 0,
        )
        yield GaugeMetricFamily(
            "genmesh_worker_inflight_requests",
            "Requests admitted and not finished yet",
            value=worker.inflight,
        )
        yield GaugeMetricFamily(
            "genmesh_worker_queued_requests",
            "Admitted requests without any output from the engine yet: waiting in the "
            "engine's scheduler or in prefill (the worker itself never queues)",
            value=worker.queued,
        )
        yield GaugeMetricFamily(
            "genmesh_worker_capacity",
            "Most requests the worker runs at once (--max-concurrency)",
            value=worker.config.max_concurrency,
        )
        requests = CounterMetricFamily(
            "genmesh_worker_requests",
            "Requests by outcome: completed (end frame), cancelled, failed (an error after "
            "admission), rejected (refused before admission)",
            labels=["outcome"],
        )
        for outcome in OUTCOMES:
            requests.add_metric([outcome], worker.stats[outcome])
        requests.add_metric(["rejected"], worker.rejections)
        yield requests
        yield CounterMetricFamily(
            "genmesh_worker_aborts",
            "Engine requests stopped before they ended: cancelled by the client, past "
            "their deadline, or handed back at shutdown",
            value=worker.aborts,
        )
        yield counter_by_code(
            "genmesh_worker_engine_errors",
            "Requests the engine ended with an error, by genmesh error code",
            ENGINE_ERROR_CODES,
            worker.engine_errors,
        )
        if worker.config.role == ROLE_PREFILL:
            stages = CounterMetricFamily(
                "genmesh_pd_stages",
                "Prefill stages of disaggregated requests this prefill worker ran, by outcome",
                labels=["outcome"],
            )
            for outcome in OUTCOMES:
                stages.add_metric([outcome], worker.stage_stats[outcome])
            yield stages
        pd = worker.pd_decoder
        if pd is not None:
            yield pd.transfer_seconds.family(
                "genmesh_pd_transfer_seconds",
                "Disaggregated requests on this decode worker: seconds from the prefill "
                "stage's result to the decode half's first output (the KV transfer, for "
                "engines that pull the KV after the prefill)",
            )
            yield CounterMetricFamily(
                "genmesh_pd_experts_omitted",
                "Disaggregated requests whose routed experts were left out because a half "
                "reported them incomplete",
                value=pd.experts_omitted,
            )


def worker_registry(worker: Worker) -> CollectorRegistry:
    registry = new_registry()
    registry.register(WorkerCollector(worker))
    return registry

"""The frontend's `$SRV` service (`shared/micro.py`): it serves no NATS subject, so its one
endpoint, `http`, stands for its HTTP generate routes (docs/protocol.md, "$SRV (NATS
micro)"). Its counts are read from the frontend's metrics when a `$SRV.STATS` request
comes, so they cost the requests nothing."""

from __future__ import annotations

from nats.aio.client import Client
from nats.micro.service import EndpointInfo, EndpointStats
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from genmesh.services.frontend.metrics import FrontendMetrics
from genmesh.shared.micro import MicroService


class HttpEndpoint:
    """The frontend's generate requests as a `$SRV` endpoint. Its `subject` is the
    frontend's HTTP address (the protocol wants one; no NATS subject is served here)."""

    name = "http"

    def __init__(self, url: str, metrics: FrontendMetrics) -> None:
        self.url = url
        self.metrics = metrics

    def info(self) -> EndpointInfo:
        return EndpointInfo(self.name, self.url, "", metadata={})

    def stats(self) -> EndpointStats:
        m = self.metrics
        finished = errors = 0
        for sample in _samples(m.requests):
            if sample.name.endswith("_total"):
                finished += int(sample.value)
                if sample.labels["error_type"] != "none":
                    errors += int(sample.value)
        inflight = int(sum(s.value for s in _samples(m.inflight)))
        processing_ns = int(
            sum(s.value for s in _samples(m.duration) if s.name.endswith("_sum")) * 1e9
        )
        requests = finished + inflight
        return EndpointStats(
            name=self.name,
            subject=self.url,
            queue_group="",
            num_requests=requests,
            num_errors=errors,
            processing_time=processing_ns,
            average_processing_time=processing_ns // finished if finished else 0,
            last_error=m.last_error,
            data={"inflight": inflight},
        )


def _samples(collector: Collector) -> list[Sample]:
    return [sample for family in collector.collect() for sample in family.samples]


def frontend_micro(nc: Client, namespace: str, url: str, metrics: FrontendMetrics) -> MicroService:
    """The frontend's `$SRV` service, listening on `url`, counted by `metrics`."""
    micro = MicroService(
        nc,
        role="frontend",
        namespace=namespace,
        description=f"genmesh frontend on {url}",
        metadata={"http": url},
    )
    micro.add(HttpEndpoint(url, metrics))
    return micro

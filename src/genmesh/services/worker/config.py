"""`genmesh worker`: everything a worker is configured with, declared once
(`shared/settings.py` derives the flags, variables and --help from it).

`WorkerConfig` is what the `Worker` service itself runs with; `WorkerProcessConfig` is a
whole `genmesh worker` process: that, its engine, its NATS connection and metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from genmesh.engines import ENGINES, create_engine
from genmesh.engines.mock import MockConfig
from genmesh.engines.sglang_pd import BootstrapConfig
from genmesh.engines.zmq_events import ZmqEventsConfig
from genmesh.shared.cards import DEFAULT_HEARTBEAT_S, ROLE_BOTH, ROLES, heartbeat_interval
from genmesh.shared.connection import MeshConnection, MetricsConfig
from genmesh.shared.credentials import NatsAuth, nats_auth_group
from genmesh.shared.ids import new_worker_id
from genmesh.shared.settings import (
    group,
    non_negative_float,
    option,
    positive_int,
    subject_token,
)

if TYPE_CHECKING:
    from genmesh.engines.base import Engine


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    worker_id: str = option(
        default_factory=new_worker_id,
        parse=subject_token,
        help="worker id (a subject token); random if unset",
    )
    max_concurrency: int = option(
        256,
        parse=positive_int,
        help="requests a worker runs at once; more are refused as overloaded (HTTP 503)",
    )
    heartbeat_interval_s: float = option(
        DEFAULT_HEARTBEAT_S,
        flag="--heartbeat-interval",
        parse=heartbeat_interval,
        help="seconds between announcements, in (0, 3600]; routers drop a worker after 3 missed",
    )
    role: str = option(
        ROLE_BOTH,
        choices=ROLES,
        help="prefill/decode disaggregation: 'prefill' runs only the prefill stages decode "
        "workers send it, 'decode' runs requests and has their prefill done by a prefill "
        "worker the router pairs it with, 'both' runs whole requests",
    )
    keepalive_interval_s: float = 5.0
    # How often the engine's health is checked (twice as often while it is down).
    health_interval_s: float = 1.0
    # On SIGTERM: how long in-flight requests may take to finish before they are handed
    # back to their requesters (retryable: they migrate to another worker).
    drain_timeout_s: float = option(
        30.0,
        flag="--drain-timeout",
        parse=non_negative_float,
        help="on SIGTERM, seconds in-flight requests may take before they migrate elsewhere",
    )


@dataclass(frozen=True, slots=True)
class WorkerProcessConfig:
    mesh: MeshConnection = group(MeshConnection())
    auth: NatsAuth = nats_auth_group()
    service: WorkerConfig = group(WorkerConfig())
    engine: str = option(
        "mock",
        choices=ENGINES,
        help="engine adapter: the in-process mock, or a client of a real SGLang/vLLM server",
    )
    engine_url: str | None = option(None, help="HTTP address of the SGLang/vLLM server")
    kv_events: ZmqEventsConfig = group(
        ZmqEventsConfig(), title="KV events of an SGLang/vLLM server (its --kv-events-config)"
    )
    sglang_bootstrap: BootstrapConfig = group(
        BootstrapConfig(), title="P/D: an SGLang prefill server's bootstrap (--role prefill)"
    )
    # A worker's mock runs its timing model in real time (the mock's own default: instant).
    mock: MockConfig = group(MockConfig(speedup=1.0), title="mock engine (--engine mock)")
    testkit_faults: bool = option(
        False,
        help="tests only: let genmesh.<ns>.testkit.<worker id> requests inject engine faults",
    )
    metrics: MetricsConfig = group(MetricsConfig())

    def new_engine(self) -> Engine:
        """The engine adapter these options describe (ValueError for a wrong combination)."""
        return create_engine(
            self.engine,
            url=self.engine_url,
            mock=self.mock,
            kv_events=self.kv_events,
            sglang_bootstrap=self.sglang_bootstrap,
        )

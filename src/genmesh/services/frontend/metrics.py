"""The frontend's Prometheus metrics: an Observer (observers.py) of every generate request.

What each metric means, its labels and buckets: docs/observability.md, "Metrics". The
per-frame path is a branch on the frame type, one clock reading and one histogram
observation per token; the label children of a route are resolved once and cached.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge

from genmesh.client import MIG, ClientFrame, MigrationReason
from genmesh.services.frontend.observers import RequestInfo
from genmesh.shared import frames
from genmesh.shared.errors import ErrorCode
from genmesh.shared.metrics import LoopCounter, LoopHistogram, new_registry

PREFIX = "genmesh_frontend_"

# Time to first token: 1 ms (a warm cache, a tiny prompt) to 60 s (a long queue or prefill).
TTFT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0,
)  # fmt: skip
# Inter-token latency: 0.5 ms (a fast small model) to 5 s (a stall, a migration).
ITL_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04,
    0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
)  # fmt: skip
# Whole requests: 10 ms to 10 min.
DURATION_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0,
    60.0, 90.0, 120.0, 180.0, 300.0, 600.0,
)  # fmt: skip
# Sequence lengths in tokens: powers of two, 1 to 128 Ki.
TOKEN_BUCKETS = tuple(float(1 << i) for i in range(18))

# The label values of migrations_total{reason}: the causes of a migration, grouped.
# A silent worker failed its ping: nobody answers on its ping subject (it died), or it
# answers that it no longer runs the request (the stream's last frames were lost).
MIGRATION_PING = "ping"
MIGRATION_LEFT_DISCOVERY = "left_discovery"  # discovery dropped the worker (left, or expired)
MIGRATION_TIMEOUT = "timeout"  # no ack within --ack-timeout, or silence past --idle-timeout
# The mesh answered a retryable error, or the stream broke otherwise (no router, lost
# frames, a failed publish).
MIGRATION_ERROR = "retryable_error"
MIGRATION_LABELS: dict[MigrationReason, str] = {
    MigrationReason.WORKER_GONE: MIGRATION_PING,
    MigrationReason.NOT_RUNNING: MIGRATION_PING,
    MigrationReason.LEFT_DISCOVERY: MIGRATION_LEFT_DISCOVERY,
    MigrationReason.ACK_TIMEOUT: MIGRATION_TIMEOUT,
    MigrationReason.IDLE_TIMEOUT: MIGRATION_TIMEOUT,
    MigrationReason.RETRYABLE_ERROR: MIGRATION_ERROR,
    MigrationReason.NO_ROUTER: MIGRATION_ERROR,
    MigrationReason.PUBLISH_FAILED: MIGRATION_ERROR,
    MigrationReason.FRAMES_LOST: MIGRATION_ERROR,
}
MIGRATION_REASONS = tuple(dict.fromkeys(MIGRATION_LABELS.values()))

# The clock of arrival times (RequestInfo.received_at); a module global so tests can set it.
_now = time.monotonic
_CANCELLED = ErrorCode.CANCELLED.value


class _Route:
    """The label children of one (format, endpoint), resolved once and shared."""

    __slots__ = (
        "duration",
        "inflight",
        "input_tokens",
        "input_tokens_total",
        "itl",
        "output_tokens",
        "output_tokens_total",
        "ttft",
    )

    def __init__(self, metrics: FrontendMetrics, fmt: str, endpoint: str) -> None:
        self.inflight = metrics.inflight.labels(fmt, endpoint)
        self.ttft = metrics.ttft.labels(fmt, endpoint)
        self.itl = metrics.itl.labels(fmt, endpoint)
        self.duration = metrics.duration.labels(fmt, endpoint)
        self.input_tokens = metrics.input_tokens.labels(fmt, endpoint)
        self.output_tokens = metrics.output_tokens.labels(fmt, endpoint)
        self.input_tokens_total = metrics.input_tokens_total.labels(fmt, endpoint)
        self.output_tokens_total = metrics.output_tokens_total.labels(fmt, endpoint)


class FrontendMetrics:
    """The frontend's metrics in their own registry; `request()` makes it an Observer."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = new_registry() if registry is None else registry
        r = self.registry
        route = ["format", "endpoint"]
        self.requests = Counter(
            PREFIX + "requests",
            "Generate requests finished, by HTTP status sent (499: the client went away) "
            "and genmesh error code ('none' on success)",
            [*route, "status", "error_type"],
            registry=r,
        )
        self.inflight = Gauge(
            PREFIX + "inflight_requests", "Generate requests being handled", route, registry=r
        )
        # The HTTP status and error code of the last request that failed (for `$SRV.STATS`).
        self.last_error = ""
        self.ttft = LoopHistogram(
            PREFIX + "time_to_first_token_seconds",
            "From a request's arrival to its first output token (of any of its generations)",
            route,
            TTFT_BUCKETS,
            r,
        )
        self.itl = LoopHistogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between output tokens of one generation; a frame of k tokens after a gap "
            "g counts k times, as g/k",
            route,
            ITL_BUCKETS,
            r,
        )
        self.duration = LoopHistogram(
            PREFIX + "request_duration_seconds",
            "From arrival to the end of the response, for dispatched requests",
            route,
            DURATION_BUCKETS,
            r,
        )
        self.input_tokens = LoopHistogram(
            PREFIX + "input_sequence_tokens",
            "Prompt length of each dispatched generation",
            route,
            TOKEN_BUCKETS,
            r,
        )
        self.output_tokens = LoopHistogram(
            PREFIX + "output_sequence_tokens",
            "Output tokens of each generation that completed (across its migrations)",
            route,
            TOKEN_BUCKETS,
            r,
        )
        self.input_tokens_total = LoopCounter(
            PREFIX + "input_tokens",
            "Prompt tokens of dispatched generations",
            route,
            r,
        )
        self.output_tokens_total = LoopCounter(
            PREFIX + "output_tokens",
            "Output tokens delivered to clients, counted as they arrive",
            route,
            r,
        )
        self.migrations = Counter(
            PREFIX + "migrations",
            "Generations moved to another worker after a failure, by cause",
            ["reason"],
            registry=r,
        )
        self.cancellations = Counter(
            PREFIX + "cancellations",
            "Requests that ended cancelled (error_type 'cancelled'), whoever cancelled them",
            registry=r,
        )
        self.disconnected = Counter(
            PREFIX + "disconnected_clients",
            "Requests whose client went away before the response was complete (499)",
            registry=r,
        )
        self.migrations_by_label = {
            label: self.migrations.labels(label) for label in MIGRATION_REASONS
        }
        self._routes: dict[tuple[str, str], _Route] = {}
        self._outcomes: dict[tuple[str, str, int, str], Counter] = {}

    def route(self, fmt: str, endpoint: str) -> _Route:
        key = (fmt, endpoint)
        found = self._routes.get(key)
        if found is None:
            found = self._routes[key] = _Route(self, fmt, endpoint)
        return found

    def outcome(self, fmt: str, endpoint: str, status: int, error_type: str | None) -> Counter:
        key = (fmt, endpoint, status, error_type or "none")
        found = self._outcomes.get(key)
        if found is None:
            found = self._outcomes[key] = self.requests.labels(fmt, endpoint, str(status), key[3])
        return found

    def request(self, info: RequestInfo) -> RequestMetrics:
        return RequestMetrics(self, info)


class RequestMetrics:
    """One request's observer: its own timing state; updates the shared metrics."""

    __slots__ = (
        "_first_token",
        "_items",
        "_last_token_at",
        "_mesh_cancelled",
        "_metrics",
        "_route",
        "info",
    )

    def __init__(self, metrics: FrontendMetrics, info: RequestInfo) -> None:
        self._metrics = metrics
        self.info = info
        self._route = metrics.route(info.format, info.endpoint)
        self._route.inflight.inc()
        self._first_token = False
        # Per generation: what its frames said; when its last token arrived (0.0: none
        # yet). Empty until dispatched.
        self._items: list[frames.Summary] = []
        self._last_token_at: list[float] = []
        # An `err cancelled` reached us: the mesh cancelled it, not a departing client.
        self._mesh_cancelled = False

    def dispatched(self, info: RequestInfo) -> None:
        route = self._route
        count = len(info.items)
        self._items = [frames.Summary() for _ in range(count)]
        self._last_token_at = [0.0] * count
        prompt_tokens = 0
        for item in info.items:
            length = len(item.token_ids)
            prompt_tokens += length
            route.input_tokens.observe(length)
        route.input_tokens_total.inc(prompt_tokens)

    def frame(self, index: int, frame: ClientFrame) -> None:
        if frame["t"] == MIG:
            self._metrics.migrations_by_label[MIGRATION_LABELS[frame["reason"]]].inc()
            return
        summary = self._items[index]
        tokens = summary.add(frame)
        if tokens:
            count = len(tokens)
            now = _now()
            route = self._route
            previous = self._last_token_at[index]
            if previous:
                gap = (now - previous) / count
                for _ in range(count):
                    route.itl.observe(gap)
            elif not self._first_token:
                self._first_token = True
                route.ttft.observe(now - self.info.received_at)
            self._last_token_at[index] = now
            route.output_tokens_total.value += count
        if frame["t"] == frames.END:
            self._route.output_tokens.observe(summary.tokens)
        elif frame["t"] == frames.ERR and frame["code"] == _CANCELLED:
            self._mesh_cancelled = True

    def finished(self, status: int, error_type: str | None) -> None:
        metrics, route = self._metrics, self._route
        route.inflight.dec()
        metrics.outcome(self.info.format, self.info.endpoint, status, error_type).inc()
        if error_type is not None:
            metrics.last_error = f"{status} {error_type}"
        if self._items:  # dispatched
            route.duration.observe(_now() - self.info.received_at)
        if error_type == _CANCELLED:
            metrics.cancellations.inc()
            if status == 499 and not self._mesh_cancelled:
                metrics.disconnected.inc()

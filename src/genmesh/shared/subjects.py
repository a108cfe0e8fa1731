"""Every NATS subject genmesh uses, in one place (`docs/protocol.md`, "Subjects")."""

from __future__ import annotations

from dataclasses import dataclass

from genmesh.shared.ids import SUBJECT_TOKEN_RULE, is_subject_token

ROUTER_QUEUE_GROUP = "router"


@dataclass(frozen=True, slots=True)
class Subjects:
    namespace: str = "default"

    def __post_init__(self) -> None:
        if not is_subject_token(self.namespace):
            raise ValueError(f"namespace {self.namespace!r} must be {SUBJECT_TOKEN_RULE}")

    @property
    def prefix(self) -> str:
        return f"genmesh.{self.namespace}"

    @property
    def router_generate(self) -> str:
        return f"{self.prefix}.router.generate"

    def worker_generate(self, worker_id: str) -> str:
        return f"{self.prefix}.worker.{worker_id}.generate"

    def worker_ping(self, worker_id: str) -> str:
        """Answered by the worker while it lives: a requester's liveness check."""
        return f"{self.prefix}.worker.{worker_id}.ping"

    def worker_kv_snapshot(self, worker_id: str) -> str:
        """Answered by a worker that publishes KV events: its cache, for a router that
        missed some (`shared/kv_events.KvSnapshotPage`)."""
        return f"{self.prefix}.worker.{worker_id}.kv_snapshot"

    def worker_kv_pull(self, worker_id: str) -> str:
        """Answered by a prefill worker whose engine hands its KV over the mesh (the mock):
        a decode worker takes a KV handle here (`engines/kv_transfer.py`)."""
        return f"{self.prefix}.worker.{worker_id}.kv_pull"

    def kv_events(self, worker_id: str) -> str:
        """A worker's engine's KV cache events (`shared/kv_events.KvEventsMessage`)."""
        return f"{self.prefix}.kv.{worker_id}"

    @property
    def kv_events_all(self) -> str:
        return f"{self.prefix}.kv.*"

    def testkit(self, worker_id: str) -> str:
        """Fault control of a worker started with `--testkit-faults` (tests only)."""
        return f"{self.prefix}.testkit.{worker_id}"

    @property
    def cancel(self) -> str:
        return f"{self.prefix}.cancel"

    @property
    def abort(self) -> str:
        """Abort by client ID (an operator's or a client's `/abort_request`): every worker
        listens; with a reply subject, each answers what it aborted."""
        return f"{self.prefix}.abort"

    @property
    def flush_cache(self) -> str:
        """Flush the engines' prefix caches: every worker listens and answers."""
        return f"{self.prefix}.flush_cache"

    @property
    def trace(self) -> str:
        """Request trace records, one JSON record per HTTP request (frontends publish)."""
        return f"{self.prefix}.trace"

    @property
    def discovery(self) -> str:
        """Wildcard over the three discovery subjects below."""
        return f"{self.prefix}.discovery.>"

    @property
    def announce(self) -> str:
        return f"{self.prefix}.discovery.announce"

    @property
    def leave(self) -> str:
        return f"{self.prefix}.discovery.leave"

    @property
    def query(self) -> str:
        return f"{self.prefix}.discovery.query"

    @property
    def router_presence(self) -> str:
        return f"{self.prefix}.discovery.router"

"""Admission control's options, and when a worker is busy (docs/routing.md, "Admission
control").

A worker is *full* at its concurrency limit (it would refuse more); it is *busy* past
any threshold set here, from its load reports: it could take more, but more would only
wait inside its engine. The routing core sends nothing to a busy or full worker; when
every eligible worker is, the request waits in the admission queue (`routing/admission.py`)
or, without one, is refused as overloaded. Dynamo's frontends decide the same way
(`--active-decode-blocks-threshold`, a fraction of the KV blocks in use, ai-dynamo/dynamo
docs/fault_tolerance/request_rejection.md). Every option is off by default: a mesh
without them routes exactly as before. Imports nothing heavy: configs read it for --help.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from genmesh.shared.settings import non_negative_int, option

if TYPE_CHECKING:
    from genmesh.shared.discovery import WorkerInfo
    from genmesh.shared.envelope import Envelope

# vLLM's and SGLang's usual page size, and the mock's default.
DEFAULT_BLOCK_SIZE = 16


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    number = float(text)
    if not 0 < number <= 1:
        raise ValueError(text)
    return number


def positive_float(text: str) -> float:
    number = float(text)
    if not 0 < number < float("inf"):
        raise ValueError(text)
    return number


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """Busy thresholds and the admission queue, declared once for every config that
    routes: a router's and a frontend's (each holds it as a group)."""

    busy_kv_usage: float | None = option(
        None,
        flag="--busy-kv-usage",
        parse=fraction,
        help="a worker whose running requests hold more than this fraction of its KV "
        "blocks is busy (gets no new request); off if unset",
    )
    busy_queued: int | None = option(
        None,
        flag="--busy-queued",
        parse=non_negative_int,
        help="a worker with more than this many requests waiting in its engine is busy; "
        "off if unset",
    )
    queue_size: int = option(
        0,
        flag="--admission-queue",
        parse=non_negative_int,
        help="requests that may wait here, by priority, while every eligible worker is "
        "busy or full; more are refused as overloaded (HTTP 503); 0 = none wait",
    )
    max_wait_s: float = option(
        30.0,
        flag="--admission-max-wait",
        parse=positive_float,
        help="seconds a request may wait in the admission queue before it is refused as overloaded",
    )

    @property
    def thresholds(self) -> bool:
        """Whether any busy threshold is set."""
        return self.busy_kv_usage is not None or self.busy_queued is not None

    def busy(self, worker: WorkerInfo) -> bool:
        """Whether `worker` is past a threshold. Requests sent to it since its last load
        report count as waiting in its engine, their prompts' blocks as held: this
        process cannot see them start yet, and a burst between two reports must not all
        land on one worker."""
        queued = self.busy_queued
        if queued is not None and worker.queued + worker.sent_since_report > queued:
            return True
        limit = self.busy_kv_usage
        if limit is not None:
            used, total = worker.kv_blocks_used, worker.kv_blocks_total
            if used is not None and total and used + worker.kv_blocks_sent > limit * total:
                return True
        return False

    def note_sent(self, worker: WorkerInfo, envelope: Envelope) -> None:
        """Count the blocks `envelope`'s prompt will hold on `worker` until its next report
        says (the engine's block size, 16 when it has not said): the queue drains as the
        KV frees, not all at once on the first report that shows room."""
        if self.busy_kv_usage is not None:
            info = worker.engine_info
            size = (info.block_size if info is not None else None) or DEFAULT_BLOCK_SIZE
            worker.kv_blocks_sent += -(-len(envelope.token_ids) // size)

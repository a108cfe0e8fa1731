"""`Chooser`: the worker for an envelope, from a directory of live workers and a policy
(docs/protocol.md §7 says what any router must do; this is that, once)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from genmesh.routing.busy import AdmissionConfig
from genmesh.routing.pairing import (
    DISAGGREGATED,
    FALLBACK,
    LOCAL,
    PdConfig,
    cached_tokens_reader,
    local_prefill,
    prefill_policy,
    prefill_workers,
)
from genmesh.routing.policies import Policy
from genmesh.shared.cards import ROLE_DECODE, ROLE_PREFILL
from genmesh.shared.discovery import WorkerDirectory, WorkerInfo
from genmesh.shared.envelope import Envelope
from genmesh.shared.errors import ErrorCode, MeshError


@dataclass(frozen=True, slots=True)
class Decision:
    """A routing decision: the worker, the free eligible workers it was chosen among
    (for traces), and the prefill worker it is paired with when it is a decode worker
    that does not run the request alone (sent as the `genmesh-prefill` header)."""

    worker: WorkerInfo
    candidates: list[WorkerInfo]
    prefill: WorkerInfo | None = None


class WorkersBusy(MeshError):
    """Every eligible worker is full, or busy past a threshold: the request may wait for
    one (`routing/admission.py`); refused, it is `overloaded`."""

    def __init__(self, eligible: int, thresholds: bool, role: str = "") -> None:
        what = "busy or at capacity" if thresholds else "at capacity"
        workers = f"{role} workers" if role else "workers"
        super().__init__(ErrorCode.OVERLOADED, f"all {eligible} eligible {workers} are {what}")


class Chooser:
    """Chooses a worker per envelope among `directory`'s live workers, with `policy`,
    leaving out the workers that are full or (with `admission`'s thresholds) busy; and,
    for a decode worker, its prefill worker (with `pd`'s conditional disaggregation)."""

    def __init__(
        self,
        directory: WorkerDirectory,
        policy: Policy,
        admission: AdmissionConfig | None = None,
        pd: PdConfig | None = None,
    ) -> None:
        self.directory = directory
        self.policy = policy
        self.prefill_policy = prefill_policy(policy)
        self._cached_tokens = cached_tokens_reader(policy)
        self.local_prefill_tokens = (pd or PdConfig()).local_prefill_tokens
        # Only when a threshold is set: without, the check costs nothing.
        self._busy = admission if admission is not None and admission.thresholds else None
        # Requests routed to decode workers, by path (routing/pairing.py): for metrics.
        self.pd_routed: Counter[str] = Counter()

    def choose(self, envelope: Envelope) -> Decision:
        """The worker for `envelope` (and its prefill worker), counted as sent to it (its
        load until its next report); or MeshError saying why there is none (no_worker,
        not_found, invalid_argument; overloaded as `WorkersBusy`)."""
        routing = envelope.routing
        directory = self.directory
        live = workers = directory.live()
        if not workers:
            raise MeshError(
                ErrorCode.NO_WORKER,
                f"no worker is registered in namespace {directory.subjects.namespace!r}",
            )
        if envelope.model is not None and not any(w.model == envelope.model for w in workers):
            served = ", ".join(sorted({w.model for w in workers if w.model})) or "none reported"
            raise MeshError(
                ErrorCode.NOT_FOUND,
                f"model {envelope.model!r} is not served here; served: {served}",
            )
        if routing.worker is not None:
            pinned = directory.workers.get(routing.worker)
            if pinned is None:
                raise MeshError(ErrorCode.NO_WORKER, f"worker {routing.worker!r} is not known")
            if pinned.role == ROLE_PREFILL:
                raise MeshError(
                    ErrorCode.INVALID_ARGUMENT,
                    f"worker {pinned.id!r} is a prefill worker: it runs only the prefill "
                    "stages of its decode workers, not whole requests",
                )
            workers = [pinned]
        # The card's role read directly (`WorkerInfo.role` with its default costs twice as
        # much, per worker per request).
        eligible = [
            w
            for w in workers
            if w.card.get("role") != ROLE_PREFILL
            and w.serves(envelope.format)
            and (envelope.model is None or w.model == envelope.model)
        ]
        if not eligible:
            wanted = [f"format {envelope.format!r}"]
            if envelope.model is not None:
                wanted.append(f"model {envelope.model!r}")
            prefills = sum(w.role == ROLE_PREFILL for w in workers)
            why = f"; {prefills} of them prefill workers" if prefills else ""
            raise MeshError(
                ErrorCode.NO_WORKER,
                f"none of the {len(workers)} known workers is eligible ({', '.join(wanted)}{why})",
            )
        free = self._free(eligible, routing.exclude)
        busy = self._busy
        if not free:
            raise WorkersBusy(len(eligible), busy is not None)
        worker = self.policy.choose(free, envelope)
        pairs = worker.card.get("role") == ROLE_DECODE
        prefill = self._prefill_for(worker, live, envelope) if pairs else None
        directory.note_sent(worker)
        if busy is not None:
            busy.note_sent(worker, envelope)
        if prefill is not None:
            directory.note_sent(prefill)
            if busy is not None:
                busy.note_sent(prefill, envelope)
        return Decision(worker, free, prefill)

    def ended(self, decision: Decision) -> None:
        """The request sent with `decision` has ended (a frontend that routes itself sees
        its attempts end; a router does not)."""
        self.directory.note_ended(decision.worker)
        if decision.prefill is not None:
            self.directory.note_ended(decision.prefill)

    def _free(self, eligible: list[WorkerInfo], exclude: list[str]) -> list[WorkerInfo]:
        """`eligible` less the full and busy workers, and less `exclude` unless that
        leaves none: excluded workers are a last resort, not banned. A worker that failed
        a request may have failed for a passing reason (a NATS reconnect, an engine
        restart), discovery drops the dead ones, and the migration limit bounds the
        retries."""
        free = [w for w in eligible if not w.full]
        busy = self._busy
        if busy is not None:
            free = [w for w in free if not busy.busy(w)]
        if free and exclude:
            excluded = set(exclude)
            free = [w for w in free if w.id not in excluded] or free
        return free

    def _prefill_for(
        self, decode: WorkerInfo, live: list[WorkerInfo], envelope: Envelope
    ) -> WorkerInfo | None:
        """The prefill worker for a request going to `decode`, None when it runs there
        alone (counted by path); MeshError when it can do neither."""
        alone = local_prefill(decode)
        threshold = self.local_prefill_tokens
        # Read before the prefill choice: with the kv policy shared, it would overwrite it.
        if alone and threshold and len(envelope.token_ids) - self._cached_tokens() < threshold:
            self.pd_routed[LOCAL] += 1
            return None
        eligible = prefill_workers(decode, live, envelope.format)
        free = self._free(eligible, envelope.routing.exclude)
        if free:
            prefill = self.prefill_policy.choose(free, envelope)
            self.pd_routed[DISAGGREGATED] += 1
            return prefill
        if alone:
            self.pd_routed[FALLBACK] += 1
            return None
        if eligible:
            raise WorkersBusy(len(eligible), self._busy is not None, ROLE_PREFILL)
        kind = (decode.disagg or {}).get("kind")
        raise MeshError(
            ErrorCode.NO_WORKER,
            f"no prefill worker (kind {kind!r}, model {decode.model!r}, format "
            f"{envelope.format!r}) for decode worker {decode.id!r}, which cannot prefill "
            "alone",
        )

"""`Chooser`: the worker for an envelope, from a directory of live workers and a policy
(docs/protocol.md §7 says what any router must do; this is that, once)."""

from __future__ import annotations

from dataclasses import dataclass

from genmesh.routing.busy import AdmissionConfig
from genmesh.routing.policies import Policy
from genmesh.shared.discovery import WorkerDirectory, WorkerInfo
from genmesh.shared.envelope import Envelope
from genmesh.shared.errors import ErrorCode, MeshError


@dataclass(frozen=True, slots=True)
class Decision:
    """A routing decision: the worker, and the free eligible workers it was chosen among
    (for traces)."""

    worker: WorkerInfo
    candidates: list[WorkerInfo]


class WorkersBusy(MeshError):
    """Every eligible worker is full, or busy past a threshold: the request may wait for
    one (`routing/admission.py`); refused, it is `overloaded`."""

    def __init__(self, eligible: int, thresholds: bool) -> None:
        what = "busy or at capacity" if thresholds else "at capacity"
        super().__init__(ErrorCode.OVERLOADED, f"all {eligible} eligible workers are {what}")


class Chooser:
    """Chooses a worker per envelope among `directory`'s live workers, with `policy`,
    leaving out the workers that are full or (with `admission`'s thresholds) busy."""

    def __init__(
        self, directory: WorkerDirectory, policy: Policy, admission: AdmissionConfig | None = None
    ) -> None:
        self.directory = directory
        self.policy = policy
        # Only when a threshold is set: without, the check costs nothing.
        self._busy = admission if admission is not None and admission.thresholds else None

    def choose(self, envelope: Envelope) -> Decision:
        """The worker for `envelope`, counted as sent to it (its load until its next
        report); or MeshError saying why there is none (no_worker, not_found; overloaded
        as `WorkersBusy`)."""
        routing = envelope.routing
        directory = self.directory
        workers = directory.live()
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
            workers = [pinned]
        eligible = [
            w
            for w in workers
            if w.serves(envelope.format) and (envelope.model is None or w.model == envelope.model)
        ]
        if not eligible:
            wanted = [f"format {envelope.format!r}"]
            if envelope.model is not None:
                wanted.append(f"model {envelope.model!r}")
            raise MeshError(
                ErrorCode.NO_WORKER,
                f"none of the {len(workers)} known workers is eligible ({', '.join(wanted)})",
            )
        free = [w for w in eligible if not w.full]
        busy = self._busy
        if busy is not None:
            free = [w for w in free if not busy.busy(w)]
        if not free:
            raise WorkersBusy(len(eligible), busy is not None)
        # Excluded workers are a last resort, not banned: a worker that failed a request may
        # have failed for a passing reason (a NATS reconnect, an engine restart), discovery
        # drops the dead ones, and the migration limit bounds the retries.
        if routing.exclude:
            excluded = set(routing.exclude)
            free = [w for w in free if w.id not in excluded] or free
        worker = self.policy.choose(free, envelope)
        directory.note_sent(worker)
        if busy is not None:
            busy.note_sent(worker, envelope)
        return Decision(worker, free)

    def ended(self, decision: Decision) -> None:
        """The request sent with `decision` has ended (a frontend that routes itself sees
        its attempts end; a router does not)."""
        self.directory.note_ended(decision.worker)

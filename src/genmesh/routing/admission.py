"""The admission queue: requests that wait, by priority, for a busy mesh to free a worker
(docs/routing.md, "Admission control").

`Admission` wraps a `Chooser`. `choose` is the synchronous common path: a decision at
once, or None when the request must wait (every eligible worker busy or full, or others
already waiting: nobody overtakes the queue). `wait` then queues it, ordered by the
envelope's routing priority (higher first) and FIFO within a priority, until a load
report or an end seen here frees a worker (`release`), and refuses it past the queue's
bound, its maximum wait, or the request's deadline. A pinned request (`routing.worker`)
never waits. Without a queue (`--admission-queue`
0, the default) `choose` never returns None: a busy mesh refuses as it always did.

A waiter that goes away (its caller cancelled) leaves the queue; a decision made for a
waiter that is gone by the time it would run is handed back (`Chooser.ended`), so
nothing queued is lost or served twice. `close` refuses whatever still waits with a
retryable `unavailable`.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import Counter

from genmesh.routing.busy import AdmissionConfig
from genmesh.routing.choice import Chooser, Decision, WorkersBusy
from genmesh.shared.envelope import Envelope
from genmesh.shared.errors import ErrorCode, MeshError

# Why a queued request was refused: the label values of the refusal metrics.
QUEUE_FULL = "queue_full"
MAX_WAIT = "max_wait"
DEADLINE = "deadline"
SHUTDOWN = "shutdown"
REFUSAL_REASONS = (QUEUE_FULL, MAX_WAIT, DEADLINE, SHUTDOWN)


class _Waiter:
    __slots__ = ("envelope", "future", "waiting")

    def __init__(self, envelope: Envelope, future: asyncio.Future[Decision]) -> None:
        self.envelope = envelope
        self.future = future
        self.waiting = True  # counted in the queue's depth


class Admission:
    """`chooser`'s decisions, with `config`'s queue in front of a busy mesh. `owner` names
    the process in the shutdown refusal."""

    def __init__(self, chooser: Chooser, config: AdmissionConfig, owner: str) -> None:
        self.chooser = chooser
        self.policy = chooser.policy
        self.config = config
        self.owner = owner
        # (-priority, arrival, waiter): the most urgent first, then the oldest.
        self._heap: list[tuple[int, int, _Waiter]] = []
        self._arrivals = itertools.count()
        self._closed: MeshError | None = None
        # For metrics: requests waiting now; requests that entered the queue; refusals by
        # reason.
        self.depth = 0
        self.entered = 0
        self.refusals: Counter[str] = Counter()
        if config.queue_size:
            chooser.directory.on_report(self.release)

    def choose(self, envelope: Envelope) -> Decision | None:
        """The worker for `envelope` now (counted as sent to it); None: it must `wait`;
        or MeshError saying why it is refused."""
        if envelope.routing.worker is not None:
            # Pinned: never queued (one busy worker would hold up the queue's head).
            return self.chooser.choose(envelope)
        if self.depth:  # others wait for a worker: nobody overtakes them
            return None
        try:
            return self.chooser.choose(envelope)
        except WorkersBusy:
            if not self.config.queue_size:
                raise
            return None

    async def wait(self, envelope: Envelope) -> Decision:
        """Queue `envelope` until a worker is free for it; MeshError when it is refused
        (the queue is full, it waited `max_wait_s`, its deadline passed, shutdown)."""
        if self._closed is not None:
            self.refusals[SHUTDOWN] += 1
            raise self._closed
        config = self.config
        if self.depth >= config.queue_size:
            self.refusals[QUEUE_FULL] += 1
            raise _refusal(
                f"the admission queue is full ({self.depth} requests wait for a free worker)"
            )
        timeout, reason = config.max_wait_s, MAX_WAIT
        if envelope.deadline is not None and envelope.deadline - time.time() < timeout:
            timeout, reason = envelope.deadline - time.time(), DEADLINE
        waiter = _Waiter(envelope, asyncio.get_running_loop().create_future())
        priority = envelope.routing.priority or 0
        heapq.heappush(self._heap, (-priority, next(self._arrivals), waiter))
        self.depth += 1
        self.entered += 1
        self.release()  # it may go at once: it only waited behind others
        try:
            async with asyncio.timeout(timeout):
                return await waiter.future
        except TimeoutError:
            if _served(waiter):  # released as the timeout fired: it goes
                return waiter.future.result()
            self.refusals[reason] += 1
            if reason == DEADLINE:
                raise MeshError(
                    ErrorCode.DEADLINE_EXCEEDED, "the request's deadline passed"
                ) from None
            raise _refusal(
                f"no eligible worker became free within {config.max_wait_s:g}s "
                "(waited in the admission queue)"
            ) from None
        except asyncio.CancelledError:
            if _served(waiter):  # chosen for it, but its caller is gone
                self.chooser.ended(waiter.future.result())
            raise
        finally:
            self._leave(waiter)

    def release(self) -> None:
        """Send the waiters a worker can take now, most urgent first; stop at the first
        that none can (strict order: nobody overtakes it)."""
        heap = self._heap
        while heap:
            waiter = heap[0][2]
            if not waiter.waiting or waiter.future.done():  # gone: its caller left
                heapq.heappop(heap)
                continue
            try:
                decision = self.chooser.choose(waiter.envelope)
            except WorkersBusy:
                break
            except MeshError as error:  # no worker may serve it any more (none left)
                heapq.heappop(heap)
                self._leave(waiter)
                waiter.future.set_exception(error)
                continue
            heapq.heappop(heap)
            self._leave(waiter)
            waiter.future.set_result(decision)
        if len(heap) > 2 * self.depth + 64:  # waiters that left, still in the heap
            self._heap = [entry for entry in heap if entry[2].waiting]
            heapq.heapify(self._heap)

    def ended(self, decision: Decision) -> None:
        """The request sent with `decision` has ended: its worker may take a waiter."""
        self.chooser.ended(decision)
        if self.depth:
            self.release()

    def close(self) -> None:
        """Refuse whatever waits, and whatever would wait from now on, as `unavailable`
        (retryable: another router or frontend may serve it)."""
        self._closed = MeshError(ErrorCode.UNAVAILABLE, f"{self.owner} is shutting down")
        for _, _, waiter in self._heap:
            if waiter.waiting and not waiter.future.done():
                self._leave(waiter)
                self.refusals[SHUTDOWN] += 1
                waiter.future.set_exception(self._closed)
        self._heap.clear()

    def _leave(self, waiter: _Waiter) -> None:
        if waiter.waiting:
            waiter.waiting = False
            self.depth -= 1


def _served(waiter: _Waiter) -> bool:
    future = waiter.future
    return future.done() and not future.cancelled() and future.exception() is None


def _refusal(message: str) -> MeshError:
    # Not retryable: the mesh has waited already, and a requester's own retry (a
    # migration) would only queue it again. HTTP clients still see 503 + Retry-After.
    return MeshError(ErrorCode.OVERLOADED, message, retryable=False)

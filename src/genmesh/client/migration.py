"""Migration: one request's attempts, and whether it moves to another worker after a failure.

The law: with a deterministic engine, a migrated request returns exactly what an
uninterrupted one returns. The continuation is the original request with the delivered
tokens appended to the prompt, budgets shrunk by as many, prompt logprobs not asked
again (the first attempt delivered them), and the failed workers excluded. Engines read
budgets and output options from these canonical fields, so no native payload changes
(`docs/protocol.md` §5.5, §11.3).

`Migrator` owns one request's attempts: the attempt number, the tokens and routed experts
delivered, the workers that failed it, the decision to retry or to fail, and the pause
before a retry. It does no I/O and knows no clock but the one it is given, so every
decision is unit-tested in process (tests/unit/test_migrator.py); `MeshClient.generate`
runs the attempts it describes. `Quarantine` is the client-wide list of workers found
dead, which every request avoids for a while.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from enum import StrEnum
from typing import Literal, TypedDict

from genmesh.shared import frames
from genmesh.shared.envelope import Continuation, Envelope

MIG: Literal["mig"] = "mig"
# An `err` frame's `detail` key naming the prefill worker whose stage failed the request
# (set by the decode worker: docs/protocol.md §6.6).
PREFILL_WORKER_DETAIL = "prefill_worker"
DEFAULT_MIGRATION_LIMIT = 3
# A refusal before admission (overloaded; a draining worker; no router subscribed; no
# worker subscribed where the client routed it) is retried after a pause that doubles
# each time (0.1, 0.2, 0.4 s): a full mesh gets a moment to free a slot, and a router or
# worker reconnecting to NATS a moment to subscribe again, instead of meeting every
# attempt at once.
REFUSAL_BACKOFF_S = 0.1
# A worker whose ping subject had no responders is left out of this client's requests
# for this long: it may stay listed until discovery expires it (3 heartbeats).
DEAD_WORKER_QUARANTINE_S = 10.0


class MigrationReason(StrEnum):
    """Why an attempt failed, so that the request moved on (a `mig` frame's `reason`)."""

    # The mesh answered a retryable `err`: a worker at its limit or every eligible one
    # full (overloaded), an engine failure, an engine that is down, a drain, ...
    RETRYABLE_ERROR = "retryable_error"
    # Nothing is subscribed to the router subject (none runs, or all are reconnecting).
    NO_ROUTER = "no_router"
    # The request could not be published (NATS closed, or its reconnect buffer is full).
    PUBLISH_FAILED = "publish_failed"
    # No worker acknowledged the request within the ack timeout.
    ACK_TIMEOUT = "ack_timeout"
    # The acknowledged stream stayed silent past the idle timeout.
    IDLE_TIMEOUT = "idle_timeout"
    # The silent worker's ping subject has no responders: it is gone. Or nothing is
    # subscribed to the generate subject of the worker the client chose itself: gone, or
    # (just after a NATS outage) not subscribed again yet.
    WORKER_GONE = "worker_gone"
    # The silent worker answered its ping that it no longer runs the request: the last
    # frames of the stream were lost (a NATS outage, a reconnect).
    NOT_RUNNING = "not_running"
    # The worker left discovery without draining (its engine went down), or expired.
    LEFT_DISCOVERY = "left_discovery"
    # A gap in the frames' `seq`: frames were lost on the way.
    FRAMES_LOST = "frames_lost"


# Refusals: the mesh said no before anyone admitted the request, so a retry waits a moment
# (`worker_gone` before an ack: nobody was subscribed to the chosen worker's subject).
_REFUSALS = frozenset(
    {MigrationReason.RETRYABLE_ERROR, MigrationReason.NO_ROUTER, MigrationReason.WORKER_GONE}
)


class MigFrame(TypedDict):
    """Made by the client for its caller, never on the wire: the request moves on to
    attempt `attempt`; the frames that follow are that attempt's."""

    t: Literal["mig"]
    id: str  # the original request's id
    attempt: int
    reason: MigrationReason
    message: str  # the failure's own words
    from_worker: str | None  # the failed attempt's worker, if it acknowledged
    delivered: int  # tokens delivered by all attempts so far


# What `MeshClient.generate` yields: the reply frames, and `mig` between attempts.
ClientFrame = frames.Frame | MigFrame


def attempt_id(base_id: str, attempt: int) -> str:
    """Each attempt has its own ID: a cancel of a failed attempt (tombstoned on every
    worker) must not also cancel the attempt that replaces it."""
    return base_id if attempt == 1 else f"{base_id}~{attempt}"


def continuation(
    original: Envelope, delivered: list[int], attempt: int, excluded: list[str]
) -> Envelope:
    """The envelope of attempt `attempt` after `delivered` tokens reached the client."""
    env = replace(
        original,
        id=attempt_id(original.id, attempt),
        sampling=original.sampling.copy(),
        output=replace(original.output),
        routing=original.routing.copy(),
    )
    env.routing.exclude = sorted(set(env.routing.exclude) | set(excluded))
    if not delivered:
        # Nothing reached the client: a fresh start elsewhere, the same request.
        env.continuation = Continuation(
            attempt, 0, len(original.token_ids), original.sampling.max_tokens
        )
        return env
    env.token_ids = original.token_ids + delivered
    s = env.sampling
    if s.max_tokens is not None:
        s.max_tokens = max(s.max_tokens - len(delivered), 0)
    s.min_tokens = max(s.min_tokens - len(delivered), 0)
    # Routed experts keep their original start: an engine may report rows only with its
    # last chunk, so the failed attempt may have delivered none; the Migrator drops the
    # rows the client already has.
    env.output.prompt_logprobs_start = None
    env.continuation = Continuation(
        attempt=attempt,
        delivered=len(delivered),
        prompt_len=len(original.token_ids),
        max_tokens=original.sampling.max_tokens,
    )
    return env


class Quarantine:
    """Workers this client found dead (their ping subject had no responders), left out of
    every request it sends for `seconds`: routers may still list them until discovery
    expires them, and each would cost a request its acknowledgement timeout."""

    def __init__(
        self,
        seconds: float = DEAD_WORKER_QUARANTINE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.seconds = seconds
        self.clock = clock
        self._until: dict[str, float] = {}

    def add(self, worker: str) -> None:
        self._until[worker] = self.clock() + self.seconds

    def workers(self) -> set[str]:
        """The workers quarantined now."""
        if self._until:
            now = self.clock()
            self._until = {w: until for w, until in self._until.items() if until > now}
        return set(self._until)

    def apply(self, envelope: Envelope) -> Envelope:
        """`envelope`, also excluding the quarantined workers."""
        dead = self.workers() - set(envelope.routing.exclude) if self._until else set()
        if not dead:
            return envelope
        routing = envelope.routing.copy()
        routing.exclude = sorted(set(routing.exclude) | dead)
        return replace(envelope, routing=routing)


class Migrator:
    """One request's attempts.

    For each attempt, the caller sends `envelope` and shows every frame it gets to
    `accept`: a frame it accepts goes on to the caller's caller; a failure the request
    survives is not accepted, and the caller leaves the attempt and asks `next` what
    follows: a `mig` frame (send the new `envelope`, after `pause` seconds), or the `err`
    frame that ends the request.
    """

    def __init__(
        self,
        envelope: Envelope,
        *,
        limit: int = DEFAULT_MIGRATION_LIMIT,
        no_migration: str | None = None,
        quarantine: Quarantine | None = None,
        deadline: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`limit`: migrations allowed (0: never). `no_migration`: why the request must not
        continue elsewhere once tokens were delivered (a restart before any token is
        always safe). `quarantine`: workers to avoid (None for a pinned request).
        `deadline`: when the request must be over, on `clock`, which times the pauses."""
        self.original = envelope
        self.limit = limit
        self.no_migration = no_migration
        self.quarantine = quarantine
        self.deadline = deadline
        self.clock = clock
        self.attempt = 1
        self.envelope = self._avoiding_quarantined(envelope)
        # Every token delivered by every attempt, in order.
        self.delivered: list[int] = []
        # Workers of failed attempts that had acknowledged them.
        self.failed: list[str] = []
        # Seconds to wait before the next attempt (after a refusal).
        self.pause = 0.0
        self._expert_values = 0  # routed-expert values delivered
        self._resend = 0  # of those, how many the current attempt is still to send again
        self._refusals = 0
        self._failure: frames.ErrFrame | None = None

    def accept(self, frame: frames.Frame) -> bool:
        """Note a frame of the current attempt; False for a failure the request may
        survive (then leave the attempt and call `next`; the frame is not for the caller)."""
        if frame["t"] == frames.OUT or frame["t"] == frames.END:
            experts = frame.get("routed_experts")
            if experts:
                self._resend = _skip_experts(frame, experts, self._resend)
                self._expert_values += sum(len(row) for row in frame.get("routed_experts", ()))
            self.delivered.extend(frame["tokens"])
        elif frame["t"] == frames.ERR and frame["retryable"] and self.attempt <= self.limit:
            self._failure = frame
            return False
        return True

    def next(self, reason: MigrationReason, worker: str | None) -> MigFrame | frames.ErrFrame:
        """What follows the failed attempt: the `mig` frame of the next one (whose envelope
        `envelope` now is), or the `err` frame that ends the request. `reason`: why it
        failed; `worker`: who had acknowledged it, if anyone."""
        failure = self._failure
        if failure is None:
            raise RuntimeError("Migrator.next() without a failure that accept() refused")
        self._failure = None
        if self.delivered and self.no_migration is not None:
            final: frames.ErrFrame = {
                **failure,
                "message": f"{failure['message']} (not migrated: {self.no_migration})",
                "retryable": False,
            }
            return final
        if worker is not None:
            self.failed.append(worker)
        # A decode worker whose prefill half failed names the prefill worker: the next
        # pair leaves it out too (the decode worker itself may be fine, but is excluded
        # like any worker of a failed attempt).
        prefill = (failure.get("detail") or {}).get(PREFILL_WORKER_DETAIL)
        if isinstance(prefill, str) and prefill not in self.failed:
            self.failed.append(prefill)
        self.attempt += 1
        self.envelope = self._avoiding_quarantined(
            continuation(self.original, self.delivered, self.attempt, self.failed)
        )
        self._resend = self._expert_values
        # Refused before admission: wait a moment (a timeout has waited already).
        self.pause = 0.0
        if worker is None and reason in _REFUSALS:
            self._refusals += 1
            self.pause = REFUSAL_BACKOFF_S * 2 ** (self._refusals - 1)
            if self.deadline is not None:
                self.pause = max(0.0, min(self.pause, self.deadline - self.clock()))
        return {
            "t": MIG,
            "id": self.original.id,
            "attempt": self.attempt,
            "reason": reason,
            "message": failure["message"],
            "from_worker": worker,
            "delivered": len(self.delivered),
        }

    def _avoiding_quarantined(self, envelope: Envelope) -> Envelope:
        return envelope if self.quarantine is None else self.quarantine.apply(envelope)


def _skip_experts(frame: frames.OutputFrame, rows: list[list[int]], skip: int) -> int:
    """Drop the first `skip` routed-expert values of a continuation's frames, and return
    how many are still to drop: it reports rows from the original start again (an engine
    may send them only with its last chunk), and the client has the ones delivered."""
    if skip <= 0:
        return skip
    kept: list[list[int]] = []
    for row in rows:
        if skip >= len(row):
            skip -= len(row)
            continue
        kept.append(row[skip:])
        skip = 0
    frame["routed_experts"] = kept
    return skip

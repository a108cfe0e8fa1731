"""The Migrator's decisions, in process: no NATS, no processes, a fake clock.

What each attempt is sent, when a failed attempt is retried or ends the request, the pause
before a retry, the quarantine of dead workers and the routed experts a continuation
re-sends. The same rules hold end to end in tests/test_migration.py (the law) and
tests/test_resilience.py.
"""

from __future__ import annotations

import pytest

from genmesh.client import request
from genmesh.client.migration import (
    REFUSAL_BACKOFF_S,
    MigFrame,
    MigrationReason,
    Migrator,
    Quarantine,
)
from genmesh.shared import frames
from genmesh.shared.envelope import Envelope
from genmesh.shared.errors import ErrorCode, MeshError

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def out(rid: str, tokens: list[int], **extra: object) -> frames.OutFrame:
    frame: frames.OutFrame = {"t": "out", "id": rid, "seq": 1, "tokens": tokens}
    frame.update(extra)  # type: ignore[typeddict-item]
    return frame


def end(rid: str, tokens: list[int]) -> frames.EndFrame:
    return {
        "t": "end",
        "id": rid,
        "seq": 2,
        "tokens": tokens,
        "finish": {"reason": "length"},
        "usage": {},
    }


def failure(rid: str, code: ErrorCode = ErrorCode.UNAVAILABLE) -> frames.ErrFrame:
    return frames.err(rid, 3, MeshError(code, f"it failed ({code})"))


def original(max_tokens: int = 8, **kwargs: object) -> Envelope:
    env = request([1, 2, 3], max_tokens=max_tokens, min_tokens=4, **kwargs)  # type: ignore[arg-type]
    env.output.prompt_logprobs_start = 1
    return env


def fail_attempt(m: Migrator, reason: MigrationReason, worker: str | None) -> MigFrame:
    assert m.accept(failure(m.envelope.id)) is False
    following = m.next(reason, worker)
    assert following["t"] == "mig", following
    return following


def test_the_first_attempt_is_the_request_itself() -> None:
    env = original()
    m = Migrator(env)
    assert m.envelope is env
    assert m.attempt == 1


def test_a_failure_before_any_token_starts_the_same_request_elsewhere() -> None:
    env = original()
    m = Migrator(env)
    mig = fail_attempt(m, MigrationReason.ACK_TIMEOUT, None)
    assert mig == {
        "t": "mig",
        "id": env.id,
        "attempt": 2,
        "reason": MigrationReason.ACK_TIMEOUT,
        "message": "it failed (unavailable)",
        "from_worker": None,
        "delivered": 0,
    }
    second = m.envelope
    assert second.id == f"{env.id}~2"
    assert second.token_ids == env.token_ids
    assert second.sampling.max_tokens == 8
    assert second.output.prompt_logprobs_start == 1  # nothing was delivered: ask again
    assert second.continuation is not None
    assert (second.continuation.attempt, second.continuation.delivered) == (2, 0)
    assert m.pause == 0.0  # a timeout has waited already


def test_a_continuation_carries_what_was_delivered_and_excludes_the_failed_workers() -> None:
    env = original()
    m = Migrator(env)
    assert m.accept({"t": "ack", "id": env.id, "seq": 0, "worker": "w1", "dispatch": "d"})
    assert m.accept(out(env.id, [10, 11]))
    mig = fail_attempt(m, MigrationReason.WORKER_GONE, "w1")
    assert (mig["from_worker"], mig["delivered"]) == ("w1", 2)
    assert m.envelope.token_ids == [1, 2, 3, 10, 11]
    assert m.envelope.sampling.max_tokens == 6
    assert m.envelope.sampling.min_tokens == 2
    assert m.envelope.output.prompt_logprobs_start is None  # the first attempt sent them
    assert m.envelope.routing.exclude == ["w1"]
    assert m.accept(out(m.envelope.id, [12]))
    fail_attempt(m, MigrationReason.IDLE_TIMEOUT, "w2")
    third = m.envelope
    assert third.id == f"{env.id}~3"
    assert third.token_ids == [1, 2, 3, 10, 11, 12]
    assert third.routing.exclude == ["w1", "w2"]
    assert third.continuation is not None
    assert (third.continuation.delivered, third.continuation.prompt_len) == (3, 3)
    assert third.continuation.max_tokens == 8
    assert m.delivered == [10, 11, 12]
    assert env.token_ids == [1, 2, 3]  # the original is never changed


def test_terminal_frames_and_non_retryable_errors_are_passed_on() -> None:
    m = Migrator(original())
    assert m.accept(end(m.envelope.id, [5]))
    m = Migrator(original())
    assert m.accept(failure(m.envelope.id, ErrorCode.INVALID_ARGUMENT))  # not retryable
    assert m.accept(failure(m.envelope.id, ErrorCode.DEADLINE_EXCEEDED))


def test_the_limit_passes_the_last_failure_on() -> None:
    m = Migrator(original(), limit=2)
    fail_attempt(m, MigrationReason.RETRYABLE_ERROR, "w1")
    fail_attempt(m, MigrationReason.RETRYABLE_ERROR, "w2")
    last = failure(m.envelope.id)
    assert m.accept(last) is True  # the caller gets it as it is: retryable, the limit spent
    assert m.attempt == 3


def test_a_pinned_request_never_migrates() -> None:
    m = Migrator(original(worker="w1"), limit=0)
    assert m.accept(failure(m.envelope.id)) is True


def test_a_request_that_must_not_migrate_still_restarts_before_its_first_token() -> None:
    m = Migrator(original(), no_migration="guided decoding")
    fail_attempt(m, MigrationReason.RETRYABLE_ERROR, "w1")  # nothing delivered: safe
    assert m.accept(out(m.envelope.id, [7]))
    assert m.accept(failure(m.envelope.id)) is False
    final = m.next(MigrationReason.RETRYABLE_ERROR, "w2")
    assert final["t"] == "err"
    assert final["retryable"] is False
    assert final["code"] == "unavailable"
    assert final["message"] == "it failed (unavailable) (not migrated: guided decoding)"
    assert m.attempt == 2  # no attempt follows


def test_next_needs_a_failure() -> None:
    m = Migrator(original())
    with pytest.raises(RuntimeError):
        m.next(MigrationReason.RETRYABLE_ERROR, None)


@pytest.mark.parametrize(
    "reason",
    [
        MigrationReason.RETRYABLE_ERROR,
        MigrationReason.NO_ROUTER,
        # Before an ack: nothing subscribed to the chosen worker's subject (it may be
        # reconnecting to NATS).
        MigrationReason.WORKER_GONE,
    ],
)
def test_refusals_back_off_doubling(reason: MigrationReason) -> None:
    m = Migrator(original(), limit=5)
    pauses = []
    for _ in range(4):
        fail_attempt(m, reason, None)
        pauses.append(m.pause)
    assert pauses == [REFUSAL_BACKOFF_S * f for f in (1, 2, 4, 8)]


@pytest.mark.parametrize(
    ("reason", "worker"),
    [
        (MigrationReason.RETRYABLE_ERROR, "w1"),  # failed after its ack: not a refusal
        (MigrationReason.ACK_TIMEOUT, None),  # waited already
        (MigrationReason.PUBLISH_FAILED, None),
        (MigrationReason.LEFT_DISCOVERY, "w1"),
        (MigrationReason.WORKER_GONE, "w1"),  # its ping found it gone, after its ack
    ],
)
def test_other_failures_retry_at_once(reason: MigrationReason, worker: str | None) -> None:
    m = Migrator(original())
    fail_attempt(m, reason, worker)
    assert m.pause == 0.0


def test_the_back_off_never_passes_the_deadline() -> None:
    clock = Clock()
    m = Migrator(original(), deadline=clock.now + 0.15, clock=clock)
    fail_attempt(m, MigrationReason.RETRYABLE_ERROR, None)
    assert m.pause == pytest.approx(0.1)
    clock.now += 0.1
    fail_attempt(m, MigrationReason.RETRYABLE_ERROR, None)
    assert m.pause == pytest.approx(0.05)  # 0.2 asked, 0.05 left
    clock.now += 1.0
    fail_attempt(m, MigrationReason.NO_ROUTER, None)
    assert m.pause == 0.0  # past it: the attempt reports the deadline


def test_quarantined_workers_are_avoided_by_every_attempt_until_they_expire() -> None:
    clock = Clock()
    quarantine = Quarantine(seconds=10.0, clock=clock)
    quarantine.add("dead")
    env = original()
    env.routing.exclude = ["mine"]
    m = Migrator(env, quarantine=quarantine)
    assert m.envelope.routing.exclude == ["dead", "mine"]
    assert env.routing.exclude == ["mine"]
    fail_attempt(m, MigrationReason.WORKER_GONE, "w1")
    assert m.envelope.routing.exclude == ["dead", "mine", "w1"]
    clock.now += 10.0
    fail_attempt(m, MigrationReason.RETRYABLE_ERROR, "w2")
    assert m.envelope.routing.exclude == ["mine", "w1", "w2"]
    assert quarantine.workers() == set()


def test_a_pinned_request_ignores_the_quarantine() -> None:
    quarantine = Quarantine()
    quarantine.add("w1")
    env = original(worker="w1")
    assert Migrator(env, limit=0, quarantine=None).envelope is env
    assert quarantine.apply(env).routing.exclude == ["w1"]  # what pinning avoids


def test_a_continuation_drops_the_routed_experts_already_delivered() -> None:
    """A continuation reports rows from the original start again (an engine may send them
    only with its last chunk); the client has the first ones already."""
    m = Migrator(original())
    rid = m.envelope.id
    assert m.accept(out(rid, [10], routed_experts=[[1, 2], [3, 4]]))
    assert m.accept(out(rid, [11], routed_experts=[[5, 6]]))
    fail_attempt(m, MigrationReason.RETRYABLE_ERROR, "w1")  # 6 values delivered
    rid = m.envelope.id
    first = out(rid, [12], routed_experts=[[1, 2], [3, 4, 5]])
    assert m.accept(first)
    assert first["routed_experts"] == []  # 5 of the 6 again
    second = out(rid, [13], routed_experts=[[6, 7], [8, 9]])
    assert m.accept(second)
    assert second["routed_experts"] == [[7], [8, 9]]  # the 6th again, then new ones
    fail_attempt(m, MigrationReason.RETRYABLE_ERROR, "w2")  # 9 values delivered
    again = out(m.envelope.id, [14], routed_experts=[[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])
    assert m.accept(again)
    assert again["routed_experts"] == [[10]]

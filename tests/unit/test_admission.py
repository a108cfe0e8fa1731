"""Admission control in process (`routing/busy.py`, `routing/admission.py`): busy
thresholds, the wait queue's order, its refusals, cancellation and release, on a
directory filled by hand. tests/test_admission.py runs the same over a real mesh."""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

import pytest

from genmesh.client import request
from genmesh.routing.admission import Admission
from genmesh.routing.busy import AdmissionConfig
from genmesh.routing.choice import Chooser, Decision, WorkersBusy
from genmesh.routing.policies import RoundRobin
from genmesh.shared.discovery import WorkerDirectory
from genmesh.shared.engine_info import EngineInfo
from genmesh.shared.envelope import Envelope
from genmesh.shared.errors import ErrorCode, MeshError
from genmesh.shared.settings import parse
from genmesh.shared.subjects import Subjects

pytestmark = pytest.mark.unit


def card(wid: str, *, inflight: int = 0, capacity: int = 1, **load: Any) -> dict[str, Any]:
    return {
        "id": wid,
        "subject": f"genmesh.ns.worker.{wid}.generate",
        "model": "m",
        "inflight": inflight,
        "capacity": capacity,
        **load,
    }


def directory(*cards: dict[str, Any]) -> WorkerDirectory:
    found = WorkerDirectory(cast(Any, None), Subjects("ns"))  # never started: no NATS
    for c in cards:
        found._update(c)  # as a card from discovery
    return found


def admission(found: WorkerDirectory, **options: Any) -> Admission:
    config = AdmissionConfig(**options)
    return Admission(Chooser(found, RoundRobin(), config), config, "the test")


def env(priority: int | None = None, deadline: float | None = None) -> Envelope:
    envelope = request([1, 2])
    envelope.routing.priority = priority
    envelope.deadline = deadline
    return envelope


async def queued(adm: Admission, envelope: Envelope) -> asyncio.Task[Decision]:
    """`envelope` waiting in the queue (the task that waits for it)."""
    assert adm.choose(envelope) is None
    task = asyncio.create_task(adm.wait(envelope))
    await asyncio.sleep(0)
    return task


def report(found: WorkerDirectory, c: dict[str, Any]) -> None:
    found._update(c)


# ----------------------------------------------------------------- busy thresholds


def test_thresholds_are_off_by_default_and_the_refusal_is_todays() -> None:
    found = directory(card("a", inflight=1))
    adm = admission(found)
    assert AdmissionConfig().thresholds is False
    with pytest.raises(WorkersBusy) as caught:
        adm.choose(env())
    assert caught.value.code is ErrorCode.OVERLOADED
    assert caught.value.message == "all 1 eligible workers are at capacity"
    assert caught.value.retryable is True


def test_a_worker_past_the_kv_threshold_is_busy() -> None:
    found = directory(
        card("a", capacity=8, kv_blocks_used=91, kv_blocks_total=100),
        card("b", capacity=8, kv_blocks_used=89, kv_blocks_total=100),
    )
    adm = admission(found, busy_kv_usage=0.9)
    decision = adm.choose(env())  # a: 91 > 90 blocks; b: 89
    assert decision is not None
    assert decision.worker.id == "b"
    # b: 89 + the prompt's block = 90: not more than 90; one more block would be.
    assert adm.choose(env()) is not None
    with pytest.raises(WorkersBusy) as caught:
        adm.choose(env())
    assert caught.value.message == "all 2 eligible workers are busy or at capacity"
    report(found, card("a", capacity=8, kv_blocks_used=50, kv_blocks_total=100))
    decision = adm.choose(env())
    assert decision is not None
    assert decision.worker.id == "a"


def test_prompt_blocks_sent_since_the_report_count_against_the_kv_threshold() -> None:
    found = directory(card("a", capacity=8, kv_blocks_used=0, kv_blocks_total=8))
    found.workers["a"].engine_info = EngineInfo(model="m", block_size=4)
    adm = admission(found, busy_kv_usage=0.5)
    prompt = request(list(range(1, 10)))  # 9 tokens: 3 blocks of 4
    # Checked before each send: 0, 3, 4 blocks of 8 are not past half; 5 is.
    assert adm.choose(prompt) is not None
    assert found.workers["a"].kv_blocks_sent == 3
    assert adm.choose(request([1])) is not None
    assert adm.choose(request([1])) is not None
    with pytest.raises(WorkersBusy):
        adm.choose(request([1]))
    report(found, card("a", capacity=8, kv_blocks_used=2, kv_blocks_total=8))
    assert found.workers["a"].kv_blocks_sent == 0
    assert adm.choose(request([1])) is not None


def test_a_worker_that_announces_no_kv_use_is_never_kv_busy() -> None:
    adm = admission(directory(card("a", capacity=8)), busy_kv_usage=0.1)
    assert adm.choose(env()) is not None


def test_queued_requests_and_sends_since_the_report_make_a_worker_busy() -> None:
    found = directory(card("a", capacity=8, queued=2), card("b", capacity=8, queued=1))
    adm = admission(found, busy_queued=1)
    # a: 2 waiting in its engine, more than 1: busy. b: 1, then 1 + 1 sent since its report.
    first = adm.choose(env())
    assert first is not None
    assert first.worker.id == "b"
    with pytest.raises(WorkersBusy):
        adm.choose(env())
    report(found, card("b", capacity=8, queued=0))  # b started them
    second = adm.choose(env())
    assert second is not None
    assert second.worker.id == "b"


def test_malformed_load_fields_count_as_not_announced() -> None:
    found = directory(card("a", queued="3", kv_blocks_used=-1, kv_blocks_total=True))
    w = found.workers["a"]
    assert (w.queued, w.kv_blocks_used, w.kv_blocks_total) == (0, None, None)


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--busy-kv-usage", "0"), ("--busy-kv-usage", "1.5"), ("--admission-max-wait", "0")],
)
def test_option_values_out_of_range_are_refused(flag: str, value: str) -> None:
    with pytest.raises(SystemExit):
        parse(AdmissionConfig, [flag, value])


# ----------------------------------------------------------------- the queue


async def test_without_a_queue_a_busy_mesh_refuses_at_once() -> None:
    adm = admission(directory(card("a", inflight=1)), busy_queued=0)
    with pytest.raises(WorkersBusy):
        adm.choose(env())
    assert adm.depth == 0


async def test_the_queue_releases_by_priority_then_arrival() -> None:
    found = directory(card("a", inflight=1))
    adm = admission(found, queue_size=8)
    order = [("low", 0), ("high", 5), ("low2", 0), ("high2", 5), ("none", None)]
    tasks = {name: await queued(adm, env(priority)) for name, priority in order}
    assert adm.depth == 5
    served: list[str] = []
    for _ in order:
        report(found, card("a", inflight=0))  # room for one: released by the report
        await asyncio.sleep(0)
        done = [name for name, t in tasks.items() if t.done() and name not in served]
        assert len(done) == 1
        served += done
        report(found, card("a", inflight=1))
    # Higher first; FIFO within a priority; no priority is priority 0.
    assert served == ["high", "high2", "low", "low2", "none"]
    assert adm.depth == 0
    assert adm.entered == 5


async def test_a_newcomer_does_not_overtake_the_queue() -> None:
    found = directory(card("a", inflight=1))
    adm = admission(found, queue_size=4)
    waiting = await queued(adm, env())
    found.workers["a"].inflight = 0  # room, before any release has run
    newcomer = env()
    assert adm.choose(newcomer) is None  # it would get a: it waits behind the waiter
    second = asyncio.create_task(adm.wait(newcomer))
    await asyncio.sleep(0)  # its wait() runs a release: the older waiter goes first
    assert (await waiting).worker.id == "a"
    assert not second.done()
    assert adm.depth == 1
    second.cancel()
    await asyncio.gather(second, return_exceptions=True)


async def test_a_pinned_request_never_waits() -> None:
    found = directory(card("a", inflight=1), card("b"))
    adm = admission(found, queue_size=4)
    pinned = env()
    pinned.routing.worker = "a"
    with pytest.raises(WorkersBusy) as caught:
        adm.choose(pinned)
    assert caught.value.message == "all 1 eligible workers are at capacity"


async def test_past_the_bound_the_queue_refuses_with_the_exact_reason() -> None:
    adm = admission(directory(card("a", inflight=1)), queue_size=2)
    tasks = [await queued(adm, env()) for _ in range(2)]
    with pytest.raises(MeshError) as caught:
        await adm.wait(env())
    error = caught.value
    assert error.code is ErrorCode.OVERLOADED
    assert error.message == "the admission queue is full (2 requests wait for a free worker)"
    assert error.retryable is False  # the mesh waited already: no migration re-queues it
    assert adm.refusals["queue_full"] == 1
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_past_the_maximum_wait_it_is_refused() -> None:
    adm = admission(directory(card("a", inflight=1)), queue_size=2, max_wait_s=0.05)
    started = time.monotonic()
    with pytest.raises(MeshError) as caught:
        await adm.wait(env())
    assert time.monotonic() - started >= 0.05
    assert caught.value.code is ErrorCode.OVERLOADED
    assert caught.value.message == (
        "no eligible worker became free within 0.05s (waited in the admission queue)"
    )
    assert adm.depth == 0
    assert adm.refusals["max_wait"] == 1


async def test_the_request_deadline_bounds_the_wait() -> None:
    adm = admission(directory(card("a", inflight=1)), queue_size=2, max_wait_s=30.0)
    with pytest.raises(MeshError) as caught:
        await adm.wait(env(deadline=time.time() + 0.05))
    assert caught.value.code is ErrorCode.DEADLINE_EXCEEDED
    assert caught.value.message == "the request's deadline passed"
    assert adm.depth == 0
    assert adm.refusals["deadline"] == 1


async def test_a_caller_that_goes_away_leaves_the_queue() -> None:
    found = directory(card("a", inflight=1))
    adm = admission(found, queue_size=4)
    gone = await queued(adm, env(priority=9))
    stays = await queued(adm, env())
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert adm.depth == 1
    report(found, card("a", inflight=0))
    decision = await stays  # the cancelled one took nothing
    assert decision.worker.id == "a"
    assert found.workers["a"].sent_since_report == 1
    assert adm.depth == 0


async def test_a_decision_for_a_caller_that_went_away_is_handed_back() -> None:
    found = directory(card("a", inflight=1))
    adm = admission(found, queue_size=4)
    task = await queued(adm, env())
    report(found, card("a", inflight=0))  # the waiter is chosen for...
    task.cancel()  # ...and cancelled before it runs again
    with pytest.raises(asyncio.CancelledError):
        await task
    assert found.workers["a"].open_here == 0  # ended: not counted as running here


async def test_an_end_seen_here_releases_a_waiter() -> None:
    found = directory(card("a"))
    adm = admission(found, queue_size=4)
    first = adm.choose(env())
    assert first is not None  # a is full now (1 sent since its report, capacity 1)
    task = await queued(adm, env())
    assert not task.done()
    first.worker.sent_since_report = 0  # its report came, and the end: in that order
    adm.ended(first)
    assert (await asyncio.wait_for(task, 1)).worker.id == "a"


async def test_a_waiter_whose_workers_all_left_is_refused_with_why() -> None:
    found = directory(card("a", inflight=1))
    adm = admission(found, queue_size=4)
    task = await queued(adm, env())
    del found.workers["a"]
    adm.release()  # as discovery does after a removal
    with pytest.raises(MeshError) as caught:
        await task
    assert caught.value.code is ErrorCode.NO_WORKER
    assert caught.value.message == "no worker is registered in namespace 'ns'"


async def test_close_refuses_what_waits_with_a_retryable_error() -> None:
    adm = admission(directory(card("a", inflight=1)), queue_size=4)
    tasks = [await queued(adm, env()) for _ in range(3)]
    adm.close()
    for task in tasks:
        with pytest.raises(MeshError) as caught:
            await task
        assert caught.value.code is ErrorCode.UNAVAILABLE
        assert caught.value.message == "the test is shutting down"
        assert caught.value.retryable is True
    with pytest.raises(MeshError):  # and whatever would wait from now on
        await adm.wait(env())
    assert adm.depth == 0
    assert adm.refusals["shutdown"] == 4


async def test_nothing_is_lost_or_served_twice_under_churn() -> None:
    found = directory(card("a", capacity=2), card("b", capacity=2))
    adm = admission(found, queue_size=1000, max_wait_s=5.0)
    served: list[str] = []

    async def one(i: int) -> None:
        envelope = env(priority=i % 3)
        decision = adm.choose(envelope) or await adm.wait(envelope)
        served.append(envelope.id)
        await asyncio.sleep(0.001 * (i % 4))
        adm.ended(decision)
        # The worker's next report: what this process sent has started and ended.
        found._update(card(decision.worker.id, capacity=2))

    tasks = [asyncio.create_task(one(i)) for i in range(200)]
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert len(served) == len(set(served)) == 200
    assert adm.depth == 0
    assert sum(adm.refusals.values()) == 0

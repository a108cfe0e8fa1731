"""The routing core (`genmesh.routing`), in process: no NATS, a directory filled by hand.

Routers and frontends that route make this one choice, so its refusals are the mesh's
words wherever they are said; tests/test_routers.py and tests/test_frontend_routing.py
check the same over a real mesh.
"""

from __future__ import annotations

import random
from typing import Any, cast

import pytest

from genmesh.client import request
from genmesh.routing.choice import Chooser
from genmesh.routing.policies import POLICIES, LeastLoaded, RoundRobin, Sticky, make_policy
from genmesh.shared.discovery import WorkerDirectory, WorkerInfo
from genmesh.shared.errors import ErrorCode, MeshError
from genmesh.shared.subjects import Subjects

pytestmark = pytest.mark.unit


def directory(*workers: WorkerInfo) -> WorkerDirectory:
    found = WorkerDirectory(cast(Any, None), Subjects("ns"))  # never started: no NATS
    found.workers = {w.id: w for w in workers}
    return found


def worker(
    wid: str, *, inflight: int = 0, capacity: int = 4, model: str = "m", formats: Any = None
) -> WorkerInfo:
    card: dict[str, Any] = {"id": wid, "model": model}
    if formats is not None:
        card["formats"] = formats
    return WorkerInfo(wid, f"genmesh.ns.worker.{wid}.generate", card, 0.0, inflight, capacity)


def refusal(chooser: Chooser, **fields: Any) -> MeshError:
    env = request([1, 2], **fields)
    with pytest.raises(MeshError) as caught:
        chooser.choose(env)
    return caught.value


def test_round_robin_rotates_over_the_sorted_free_workers() -> None:
    chooser = Chooser(directory(worker("b"), worker("a")), RoundRobin())
    picked = [chooser.choose(request([1])).worker.id for _ in range(4)]
    assert picked == ["a", "b", "a", "b"]


def test_a_choice_counts_as_load_until_the_next_report() -> None:
    w = worker("a", inflight=1, capacity=3)
    chooser = Chooser(directory(w), RoundRobin())
    decision = chooser.choose(request([1]))
    assert decision.worker is w
    assert decision.candidates == [w]
    assert w.load == 2
    chooser.choose(request([1]))
    assert w.full
    error = refusal(chooser)
    assert (error.code, error.message) == (
        ErrorCode.OVERLOADED,
        "all 1 eligible workers are at capacity",
    )
    assert error.retryable


def test_no_worker_at_all() -> None:
    error = refusal(Chooser(directory(), RoundRobin()))
    assert error.code == ErrorCode.NO_WORKER
    assert error.message == "no worker is registered in namespace 'ns'"


def test_unknown_model_is_not_found() -> None:
    error = refusal(Chooser(directory(worker("a", model="x")), RoundRobin()), model="y")
    assert error.code == ErrorCode.NOT_FOUND
    assert error.message == "model 'y' is not served here; served: x"
    assert not error.retryable


def test_pin_to_an_unknown_worker() -> None:
    error = refusal(Chooser(directory(worker("a")), RoundRobin()), worker="ghost")
    assert (error.code, error.message) == (ErrorCode.NO_WORKER, "worker 'ghost' is not known")


def test_a_pin_wins_over_the_policy() -> None:
    chooser = Chooser(directory(worker("a"), worker("b")), RoundRobin())
    assert {chooser.choose(request([1], worker="b")).worker.id for _ in range(3)} == {"b"}


def test_format_eligibility() -> None:
    chooser = Chooser(directory(worker("a", formats=["sglang"])), RoundRobin())
    error = refusal(chooser)  # request() sends the "tokens" format
    assert error.code == ErrorCode.NO_WORKER
    assert error.message == "none of the 1 known workers is eligible (format 'tokens')"
    chooser = Chooser(directory(worker("a", formats=["*"])), RoundRobin())
    assert chooser.choose(request([1])).worker.id == "a"


def test_exclusions_steer_but_never_refuse() -> None:
    chooser = Chooser(directory(worker("a"), worker("b")), RoundRobin())
    env = request([1])
    env.routing.exclude = ["a"]
    decision = chooser.choose(env)
    assert decision.worker.id == "b"
    assert [w.id for w in decision.candidates] == ["b"]
    env.routing.exclude = ["a", "b"]  # every one excluded: the last resort is all of them
    assert len(chooser.choose(env).candidates) == 2


def test_least_loaded_picks_the_lighter_of_two() -> None:
    light, heavy = worker("a", inflight=0), worker("b", inflight=3)
    chooser = Chooser(directory(light, heavy), LeastLoaded(random.Random(1)))
    assert chooser.choose(request([1])).worker is light


def test_sticky_stays_on_an_idle_worker_and_rotates_off_a_busy_one() -> None:
    chooser = Chooser(directory(worker("b", capacity=99), worker("a", capacity=99)), Sticky())
    # One request at a time (c=1): each ends before the next, so one worker serves them all.
    for _ in range(3):
        decision = chooser.choose(request([1]))
        assert decision.worker.id == "a"
        chooser.ended(decision)
    # Overlapping requests: the last worker still runs one of ours, so the next rotates.
    first = chooser.choose(request([1]))
    second = chooser.choose(request([1]))
    third = chooser.choose(request([1]))
    assert [first.worker.id, second.worker.id, third.worker.id] == ["a", "b", "a"]
    assert first.worker.open_here == 2
    for decision in (first, second, third):
        chooser.ended(decision)
    assert first.worker.open_here == second.worker.open_here == 0
    # Idle again: it stays on the worker it chose last.
    assert chooser.choose(request([1])).worker.id == "a"


def test_open_here_counts_sends_until_they_end_across_reports() -> None:
    w = worker("a")
    chooser = Chooser(directory(w), RoundRobin())
    decision = chooser.choose(request([1]))
    w.sent_since_report = 0  # a load report came in meanwhile: it says nothing of ends
    assert w.open_here == 1
    chooser.ended(decision)
    chooser.ended(decision)  # never below zero
    assert w.open_here == 0


def test_policies_by_name() -> None:
    assert {make_policy(name).name for name in POLICIES} == set(POLICIES)
    with pytest.raises(ValueError, match="unknown router policy 'nope'"):
        make_policy("nope")

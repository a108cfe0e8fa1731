"""The routing core picks a prefill/decode pair (routing/choice.py, routing/pairing.py), in
process with a directory filled by hand: which prefill worker goes with a decode worker,
when the request runs on the decode worker alone, and the refusals. The header that
carries the pair is tested over real NATS in tests/test_pd_routing.py."""

from __future__ import annotations

from typing import Any

import pytest

from genmesh.client import request
from genmesh.client.migration import MigrationReason, Migrator
from genmesh.routing.admission import Admission
from genmesh.routing.busy import AdmissionConfig
from genmesh.routing.choice import Chooser, WorkersBusy
from genmesh.routing.kv_policy import KvPolicy
from genmesh.routing.pairing import PdConfig
from genmesh.routing.policies import KvConfig, Policy, RoundRobin, make_policy
from genmesh.shared import frames
from genmesh.shared.discovery import WorkerInfo
from genmesh.shared.engine_info import EngineInfo
from genmesh.shared.envelope import TokenIds
from genmesh.shared.errors import ErrorCode, MeshError
from genmesh.shared.kv_events import BlockStored
from tests.unit.test_routing import directory

pytestmark = pytest.mark.unit

BS = 4
PROMPT = list(range(100, 132))  # 32 tokens, 8 blocks of BS


def worker(
    wid: str,
    role: str = "both",
    *,
    kind: str = "mock",
    local_prefill: bool = True,
    inflight: int = 0,
    capacity: int = 4,
    model: str = "m",
    formats: Any = None,
    events: bool = True,
) -> WorkerInfo:
    """A worker as its card announces it (services/worker/service.py: `role`, and
    `disagg` = {"kind", **pd_card()} unless the role is both)."""
    card: dict[str, Any] = {"id": wid, "model": model, "role": role}
    if role != "both":
        card["disagg"] = {"kind": kind, "local_prefill": local_prefill}
    if formats is not None:
        card["formats"] = formats
    if events:
        card["kv_events"] = True
    info = WorkerInfo(wid, f"genmesh.ns.worker.{wid}.generate", card, 0.0, inflight, capacity)
    info.engine_info = EngineInfo(model=model, block_size=BS)
    return info


def chooser(
    *workers: WorkerInfo,
    policy: Policy | None = None,
    local_prefill_tokens: int = 0,
    admission: AdmissionConfig | None = None,
) -> Chooser:
    return Chooser(
        directory(*workers),
        policy or RoundRobin(),
        admission,
        PdConfig(local_prefill_tokens=local_prefill_tokens),
    )


def pair(c: Chooser, tokens: list[int] = PROMPT, **fields: Any) -> tuple[str, str | None]:
    decision = c.choose(request(tokens, **fields))
    return decision.worker.id, None if decision.prefill is None else decision.prefill.id


def refusal(c: Chooser, **fields: Any) -> MeshError:
    with pytest.raises(MeshError) as caught:
        c.choose(request(PROMPT, **fields))
    return caught.value


def kv_holding(wid: str, tokens: list[int], **config: Any) -> KvPolicy:
    """A kv policy whose index has `wid` holding `tokens`' full blocks (from its events)."""
    policy = make_policy("kv", KvConfig(**config))
    assert isinstance(policy, KvPolicy)
    event = BlockStored([f"{wid}{i}" for i in range(len(tokens) // BS)], None, TokenIds(tokens), BS)
    policy.index.apply(wid, [event])
    return policy


def test_a_decode_worker_gets_a_prefill_worker_and_both_count_the_load() -> None:
    d, p = worker("d", "decode"), worker("p", "prefill")
    c = chooser(d, p)
    decision = c.choose(request(PROMPT))
    assert (decision.worker, decision.prefill, decision.candidates) == (d, p, [d])
    assert (d.load, p.load, d.open_here, p.open_here) == (1, 1, 1, 1)
    c.ended(decision)
    assert (d.open_here, p.open_here) == (0, 0)
    assert c.pd_routed == {"disaggregated": 1}


def test_whole_requests_never_go_to_prefill_workers() -> None:
    c = chooser(worker("a"), worker("p", "prefill"))
    assert {pair(c) for _ in range(4)} == {("a", None)}
    assert c.pd_routed == {}  # not a decode worker: no P/D path to count
    error = refusal(chooser(worker("p1", "prefill"), worker("p2", "prefill")))
    assert (error.code, error.message) == (
        ErrorCode.NO_WORKER,
        "none of the 2 known workers is eligible (format 'tokens'; 2 of them prefill workers)",
    )


def test_a_request_pinned_to_a_prefill_worker_is_refused() -> None:
    c = chooser(worker("d", "decode"), worker("p", "prefill"))
    error = refusal(c, worker="p")
    assert (error.code, error.retryable) == (ErrorCode.INVALID_ARGUMENT, False)
    assert error.message == (
        "worker 'p' is a prefill worker: it runs only the prefill stages of its decode "
        "workers, not whole requests"
    )
    assert pair(c, worker="d") == ("d", "p")  # pinned to a decode worker: still paired


def test_the_prefill_worker_has_the_decode_workers_kind_model_and_format() -> None:
    d = worker("d", "decode", kind="sglang")
    others = [
        worker("p-mock", "prefill", kind="mock"),
        worker("p-model", "prefill", kind="sglang", model="other"),
        worker("p-format", "prefill", kind="sglang", formats=["vllm"]),
    ]
    c = chooser(d, *others, worker("p", "prefill", kind="sglang"))
    assert {pair(c) for _ in range(4)} == {("d", "p")}


def test_the_prefill_choice_has_its_own_rotation() -> None:
    # One instance for both choices would advance the rotation twice per request: every
    # request would go to d1 (turns 0, 2, 4 ...) and p2 (turns 1, 3, 5 ...).
    c = chooser(
        worker("d1", "decode"),
        worker("d2", "decode"),
        worker("p1", "prefill"),
        worker("p2", "prefill"),
    )
    assert [pair(c) for _ in range(4)] == [("d1", "p1"), ("d2", "p2")] * 2
    assert c.prefill_policy is not c.policy


def test_the_kv_policy_is_shared_and_picks_the_prefill_worker_holding_the_prompt() -> None:
    policy = kv_holding("p2", PROMPT)
    c = chooser(worker("d", "decode"), worker("p1", "prefill"), worker("p2", "prefill"),
                policy=policy)  # fmt: skip
    assert c.prefill_policy is policy  # one index, which the KV feed fills
    assert pair(c) == ("d", "p2")


def test_excluded_prefill_workers_are_a_last_resort() -> None:
    c = chooser(
        worker("d", "decode", capacity=99),
        worker("p1", "prefill", capacity=99),
        worker("p2", "prefill", capacity=99),
    )
    env = request(PROMPT)
    env.routing.exclude = ["p1"]
    assert {c.choose(env).prefill.id for _ in range(3)} == {"p2"}  # type: ignore[union-attr]
    env.routing.exclude = ["p1", "p2"]
    assert {c.choose(env).prefill.id for _ in range(2)} == {"p1", "p2"}  # type: ignore[union-attr]


def test_full_or_busy_prefill_workers_are_passed_over() -> None:
    full = worker("p1", "prefill", inflight=4, capacity=4)
    busy = worker("p2", "prefill")
    busy.queued = 3
    c = chooser(
        worker("d", "decode"),
        full,
        busy,
        worker("p3", "prefill"),
        admission=AdmissionConfig(busy_queued=2),
    )
    assert pair(c) == ("d", "p3")


def test_no_free_prefill_worker_falls_back_to_the_decode_worker_alone() -> None:
    c = chooser(worker("d", "decode"), worker("p", "prefill", inflight=4, capacity=4))
    assert pair(c) == ("d", None)
    c = chooser(worker("d", "decode"))  # none at all
    assert pair(c) == ("d", None)
    assert c.pd_routed == {"fallback": 1}


def test_a_decode_worker_that_cannot_prefill_alone_waits_for_a_busy_prefill_worker() -> None:
    d = worker("d", "decode", kind="sglang", local_prefill=False)
    p = worker("p", "prefill", kind="sglang", inflight=4, capacity=4)
    error = refusal(chooser(d, p))
    assert isinstance(error, WorkersBusy)  # so the admission queue may hold it
    assert (error.code, error.message) == (
        ErrorCode.OVERLOADED,
        "all 1 eligible prefill workers are at capacity",
    )
    assert d.load == 0  # nothing counted for a refusal


def test_the_admission_queue_holds_a_request_whose_prefill_workers_are_busy() -> None:
    d = worker("d", "decode", kind="sglang", local_prefill=False)
    p = worker("p", "prefill", kind="sglang", inflight=4, capacity=4)
    config = AdmissionConfig(queue_size=4)
    admission = Admission(chooser(d, p, admission=config), config, "test")
    assert admission.choose(request(PROMPT)) is None  # it waits, not refused
    p.inflight = 0  # the prefill worker's next report: room again
    decision = admission.choose(request(PROMPT))
    assert decision is not None
    assert decision.prefill is p


def test_an_sglang_like_decode_worker_without_prefill_workers_is_no_worker() -> None:
    d = worker("d", "decode", kind="sglang", local_prefill=False)
    c = chooser(d, worker("p", "prefill", kind="vllm"), local_prefill_tokens=1000)
    error = refusal(c)
    assert (error.code, error.retryable) == (ErrorCode.NO_WORKER, False)
    assert error.message == (
        "no prefill worker (kind 'sglang', model 'm', format 'tokens') for decode worker "
        "'d', which cannot prefill alone"
    )
    assert c.pd_routed == {}


def test_a_short_uncached_prompt_runs_on_the_decode_worker_alone() -> None:
    # Round robin knows no cache: every prompt token counts as uncached.
    c = chooser(worker("d", "decode"), worker("p", "prefill"), local_prefill_tokens=10)
    assert pair(c, tokens=PROMPT[:9]) == ("d", None)
    assert pair(c, tokens=PROMPT[:10]) == ("d", "p")
    assert c.pd_routed == {"local": 1, "disaggregated": 1}
    # A decode worker that cannot run a request alone always gets its prefill worker.
    c = chooser(worker("d", "decode", local_prefill=False), worker("p", "prefill"),
                local_prefill_tokens=10)  # fmt: skip
    assert pair(c, tokens=PROMPT[:2]) == ("d", "p")


def test_the_threshold_counts_only_what_the_decode_worker_has_not_cached() -> None:
    # d holds the first 24 of the 32 prompt tokens: 8 uncached, below 10.
    policy = kv_holding("d", PROMPT[:24])
    c = chooser(worker("d", "decode"), worker("p", "prefill"), policy=policy,
                local_prefill_tokens=10)  # fmt: skip
    assert pair(c) == ("d", None)
    # Another prompt, nothing of it cached there: 32 uncached.
    assert pair(c, tokens=[t + 1000 for t in PROMPT]) == ("d", "p")
    assert c.pd_routed == {"local": 1, "disaggregated": 1}


def test_without_events_the_prediction_counts_from_the_next_request_on() -> None:
    # The kv policy predicts what it routed: the first request finds nothing cached (the
    # prediction it records for this choice must not count), the same prompt again does.
    policy = make_policy("kv", KvConfig(events="off"))
    c = chooser(worker("d", "decode"), worker("p", "prefill"), policy=policy,
                local_prefill_tokens=8)  # fmt: skip
    assert pair(c) == ("d", "p")
    assert pair(c) == ("d", None)


def test_the_migrator_excludes_the_prefill_worker_a_decode_worker_names() -> None:
    m = Migrator(request([1, 2, 3]))
    err = frames.err(
        m.envelope.id,
        1,
        MeshError(ErrorCode.UNAVAILABLE, "prefill failed", detail={"prefill_worker": "p1"}),
    )
    assert m.accept(err) is False
    following = m.next(MigrationReason.RETRYABLE_ERROR, "d1")
    assert following["t"] == "mig"
    assert m.envelope.routing.exclude == ["d1", "p1"]
    # Without the detail (a decode worker's own failure) only the decode worker is.
    m = Migrator(request([1, 2, 3]))
    assert m.accept(frames.err(m.envelope.id, 1, MeshError(ErrorCode.UNAVAILABLE, "x"))) is False
    m.next(MigrationReason.RETRYABLE_ERROR, "d1")
    assert m.envelope.routing.exclude == ["d1"]

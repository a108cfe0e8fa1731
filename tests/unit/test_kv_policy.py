"""The `kv` policy (routing/kv_policy.py): overlap against load, the temperature, ties,
block sizes and the approximate mode, in process with a directory filled by hand."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from genmesh.client import request
from genmesh.commandline import command_argv
from genmesh.routing.choice import Chooser
from genmesh.routing.kv_policy import KvPolicy
from genmesh.routing.policies import KvConfig, make_policy
from genmesh.shared.connection import MeshConnection
from genmesh.shared.discovery import WorkerInfo
from genmesh.shared.engine_info import EngineInfo
from genmesh.shared.envelope import TokenIds
from genmesh.shared.errors import ErrorCode, MeshError
from genmesh.shared.kv_events import BlockRemoved, BlockStored, block_keys
from genmesh.shared.settings import parse
from genmesh.up.config import UpConfig
from genmesh.up.run import frontend_configs
from tests.unit.test_routing import directory

pytestmark = pytest.mark.unit

BS = 4
PROMPT = list(range(100, 132))  # 8 blocks
OTHER = list(range(500, 532))


def worker(
    wid: str, *, load: int = 0, events: bool = True, block_size: int | None = BS
) -> WorkerInfo:
    card: dict[str, Any] = {"id": wid, "model": "m"}
    if events:
        card["kv_events"] = True
    info = WorkerInfo(wid, f"genmesh.ns.worker.{wid}.generate", card, 0.0, load, 64)
    info.engine_info = EngineInfo(model="m", block_size=block_size)
    return info


def holding(policy: KvPolicy, wid: str, tokens: list[int]) -> None:
    blocks = len(tokens) // BS
    event = BlockStored([f"{wid}{i}" for i in range(blocks)], None, TokenIds(tokens), BS)
    policy.index.apply(wid, [event])


def kv(**options: Any) -> KvPolicy:
    """A kv policy with Dynamo's default weight (1.0) unless `options` say otherwise."""
    options.setdefault("overlap_weight", 1.0)
    policy = make_policy("kv", KvConfig(**options))
    assert isinstance(policy, KvPolicy)
    return policy


def choose(policy: KvPolicy, *workers: WorkerInfo, tokens: list[int] = PROMPT) -> str:
    return policy.choose(list(workers), request(tokens)).id


def test_the_worker_holding_the_prefix_wins_until_its_load_outweighs_it() -> None:
    policy = kv()
    holding(policy, "b", PROMPT[:24])  # 6 of the 8 blocks
    # cost = 1.0 x (8 - overlap) + load x 8: b = 2 + 8 load_b, a = 8 + 8 load_a.
    assert choose(policy, worker("a"), worker("b")) == "b"
    assert choose(policy, worker("a"), worker("b", load=1)) == "a"  # 10 > 8
    assert choose(policy, worker("a", load=1), worker("b", load=1)) == "b"
    # A heavier overlap weight keeps it there under the same load (3 x 2 + 8 < 3 x 8).
    assert choose(kv(overlap_weight=3.0), worker("a"), worker("b", load=1)) == "a"  # no index
    heavy = kv(overlap_weight=3.0)
    holding(heavy, "b", PROMPT[:24])
    assert choose(heavy, worker("a"), worker("b", load=1)) == "b"


def test_by_default_a_cached_prefix_outweighs_a_few_active_requests() -> None:
    policy = make_policy("kv")
    assert isinstance(policy, KvPolicy)
    holding(policy, "b", PROMPT[:24])
    # cost = 8 x (8 - overlap) + load x 8: b = 16 + 8 load_b, a = 64 + 8 load_a.
    assert choose(policy, worker("a"), worker("b", load=5)) == "b"  # 56 < 64
    assert choose(policy, worker("a"), worker("b", load=6)) == "a"  # 64: a tie, the lower id


def test_a_prompt_shorter_than_a_block_still_weighs_load() -> None:
    policy = kv()
    assert choose(policy, worker("a", load=2), worker("b", load=1), tokens=[1, 2, 3]) == "b"
    # Six tokens are two blocks, the first held by b: 1 x 1 + 2 x 2 < 1 x 2 + 2 x 2.
    holding(policy, "b", [1, 2, 3, 4])
    six = [1, 2, 3, 4, 5, 6]
    assert choose(policy, worker("a", load=2), worker("b", load=2), tokens=six) == "b"


def test_weight_zero_is_load_only() -> None:
    policy = kv(overlap_weight=0.0)
    holding(policy, "b", PROMPT)
    assert choose(policy, worker("a"), worker("b", load=1)) == "a"
    assert choose(policy, worker("a"), worker("b")) == "a"  # a tie: the lower id


def test_temperature_zero_is_deterministic_and_ties_go_to_the_lowest_id() -> None:
    # Every router fed the same events picks the same worker, whatever its directory order.
    for order in (["c", "a", "b"], ["b", "c", "a"], ["a", "b", "c"]):
        policy = kv()
        holding(policy, "b", PROMPT)
        holding(policy, "c", PROMPT)
        picked = {choose(policy, *(worker(w) for w in order)) for _ in range(5)}
        assert picked == {"b"}
        assert choose(policy, *(worker(w) for w in order), tokens=OTHER) == "a"


def test_a_temperature_draws_cheaper_workers_more_often() -> None:
    policy = KvPolicy(KvConfig(temperature=0.5), rng=random.Random(7))
    holding(policy, "b", PROMPT)
    picks = Counter(choose(policy, worker("a"), worker("b")) for _ in range(1000))
    # Costs 8 and 0, rescaled to [-2, 0]: b with weight 1, a with e^-2 (p = 0.12).
    assert 60 < picks["a"] < 190
    assert picks["a"] + picks["b"] == 1000
    even = Counter(choose(policy, worker("a"), worker("b"), tokens=OTHER) for _ in range(1000))
    assert 400 < even["a"] < 600  # equal costs: equally likely


def test_workers_with_other_block_sizes_are_refused_with_the_reason() -> None:
    policy = kv()
    with pytest.raises(MeshError) as caught:
        choose(policy, worker("a"), worker("b", block_size=16), worker("c", block_size=None))
    assert caught.value.code == ErrorCode.UNAVAILABLE
    assert caught.value.message == (
        "kv routing needs one KV block size among the eligible workers; they report 4, 16"
    )
    assert not caught.value.retryable


def test_the_block_size_comes_from_the_workers_cards() -> None:
    policy = kv()
    # 16-token blocks: the prompt is two blocks, both held by b.
    event = BlockStored([1, 2], None, TokenIds(PROMPT), 16)
    policy.index.apply("b", [event])
    assert choose(policy, worker("a", block_size=16), worker("b", block_size=None)) == "b"
    assert choose(policy, worker("a", block_size=4), worker("b", block_size=None)) == "a"


# -- approximate mode ---------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_without_events_a_prefix_follows_where_it_was_routed_for_the_ttl() -> None:
    clock = Clock()
    policy = KvPolicy(KvConfig(approx_ttl_s=60.0), clock=clock)
    a, b = worker("a", events=False), worker("b", events=False)
    a.inflight = 1
    assert choose(policy, a, b) == "b"  # a is busy: b, which now is taken to hold it
    a.inflight = 0
    assert choose(policy, a, b) == "b"
    assert choose(policy, a, b, tokens=OTHER) == "a"
    clock.now = 59.0  # b's prediction was refreshed at 0 by the second choice
    assert choose(policy, a, b) == "b"
    clock.now = 200.0
    assert choose(policy, a, b) == "a"  # expired everywhere: a tie, the lower id


def test_a_prediction_is_bounded_by_the_workers_cache_size() -> None:
    policy = kv()
    small = worker("a", events=False)
    small.engine_info = EngineInfo(model="m", block_size=BS, max_total_num_tokens=6 * BS)
    assert choose(policy, small) == "a"
    assert policy.predicted.keys_held == 6  # of the prompt's 8 blocks
    assert policy.predicted.overlaps(policy_keys(PROMPT)) == {}  # its first two went


def policy_keys(tokens: list[int]) -> list[int]:
    return block_keys(TokenIds(tokens), BS)


def test_workers_with_events_are_never_predicted() -> None:
    policy = kv()
    assert choose(policy, worker("a"), worker("b")) == "a"
    assert policy.predicted.keys_held == 0
    assert choose(policy, worker("a", load=1), worker("b")) == "b"  # nothing held by a


def test_kv_events_off_predicts_even_for_workers_that_publish() -> None:
    policy = kv(events="off")
    holding(policy, "b", PROMPT)  # events are not followed: ignored
    assert choose(policy, worker("a"), worker("b")) == "a"
    assert policy.predicted.keys_held == 8
    assert choose(policy, worker("a", load=0), worker("b")) == "a"


def test_the_chooser_counts_a_kv_choice_as_load() -> None:
    policy = kv()
    holding(policy, "b", PROMPT)
    a, b = worker("a"), worker("b")
    chooser = Chooser(directory(a, b), policy)
    assert chooser.choose(request(PROMPT)).worker is b
    assert b.load == 1
    # Now b costs 0 + 8 x 1 and a 8 + 0: a tie, to the lower id.
    assert chooser.choose(request(PROMPT)).worker is a
    assert a.load == 1


def test_forget_drops_a_worker_from_both_views() -> None:
    policy = kv()
    holding(policy, "b", PROMPT)
    policy.predicted.record("b", [1, 2])
    policy.forget("b")
    assert policy.index.keys_held == 0
    assert policy.predicted.keys_held == 0


def test_up_hands_the_kv_options_to_routers_and_frontends_alike() -> None:
    argv = ["--router-policy", "kv", "--kv-overlap-weight", "2", "--kv-events", "off"]
    config = parse(UpConfig, argv, environ={"GENMESH_KV_TEMPERATURE": "0.5"})
    wanted = KvConfig(overlap_weight=2.0, temperature=0.5, events="off")
    assert config.router.kv == wanted
    [(_, frontend)] = frontend_configs(config, MeshConnection("nats://x:4222"))
    assert (frontend.router_policy, frontend.kv) == ("kv", wanted)
    # And on their command lines as `up` starts them.
    for argv_out in (command_argv(frontend), command_argv(config.router)):
        assert argv_out[argv_out.index("--kv-overlap-weight") + 1] == "2.0"
        assert argv_out[argv_out.index("--kv-events") + 1] == "off"


def test_routers_fed_the_same_events_in_any_interleaving_choose_alike() -> None:
    # Each worker's events in its own order, the workers' streams interleaved differently
    # in each router (as NATS delivers subjects independently): same index, same choices.
    rng = random.Random(7)
    prefixes = [list(range(1000 * g, 1000 * g + 16)) for g in range(6)]
    streams: dict[str, list[list[Any]]] = {}
    for wid in ("a", "b", "c"):
        held = rng.sample(range(6), 3)
        stored = [
            [BlockStored([f"{wid}{g}.{i}" for i in range(4)], None, TokenIds(prefixes[g]), BS)]
            for g in held
        ]
        removed = [[BlockRemoved([f"{wid}{held[0]}.{i}" for i in range(2, 4)])]]
        streams[wid] = [*stored, *removed]

    def fed(seed: int) -> KvPolicy:
        policy = kv()
        pending = {wid: list(events) for wid, events in streams.items()}
        order = random.Random(seed)
        while any(pending.values()):
            wid = order.choice([w for w, events in pending.items() if events])
            policy.index.apply(wid, pending[wid].pop(0))
        return policy

    routers = [fed(seed) for seed in (1, 2, 3)]
    workers = [worker("c"), worker("a"), worker("b")]
    picked = []
    for g, prefix in enumerate(prefixes):
        prompt = prefix + [g] * 3
        choices = {choose(router, *workers, tokens=prompt) for router in routers}
        assert len(choices) == 1, (g, choices)
        picked.append(choices.pop())
    assert len(set(picked)) > 1  # the events decided, not one fixed favourite

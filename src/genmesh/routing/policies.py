"""Routing policies: given the eligible, non-full workers, pick one."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from genmesh.shared.settings import non_negative_float, option

if TYPE_CHECKING:  # imported for types only: the router's --help lists the policies
    from genmesh.shared.discovery import WorkerInfo
    from genmesh.shared.envelope import Envelope


class Policy(Protocol):
    name: str

    def choose(self, workers: list[WorkerInfo], envelope: Envelope) -> WorkerInfo:
        """One of `workers` (eligible, not full, never empty) for `envelope`."""
        ...


@runtime_checkable
class CacheAware(Protocol):
    """A policy that knows what each worker's cache holds (`kv`)."""

    # Prompt tokens the cache of the worker `choose` last returned held before that
    # choice (conditional disaggregation reads it: routing/pairing.py).
    chosen_cached_tokens: int


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, workers: list[WorkerInfo], envelope: Envelope) -> WorkerInfo:
        # Sorted, so the rotation is stable while the set is.
        ordered = sorted(workers, key=lambda w: w.id)
        return ordered[next(self._counter) % len(ordered)]


class Sticky:
    """The worker chosen last, while nothing this process sent it is still running; else
    the next in round robin.

    At low load one worker serves everything and stays warm: at c=1 a worker woken every
    other request is woken colder, which costs more than its share of the work
    (docs/performance.md, "c=1: where the time goes"). Under load it rotates like
    `round_robin`. Only a process that sees its requests end (a frontend that routes
    itself) knows when the last worker is idle; in a router it is `round_robin`."""

    name = "sticky"

    def __init__(self) -> None:
        self._rotation = RoundRobin()
        self._last: str | None = None

    def choose(self, workers: list[WorkerInfo], envelope: Envelope) -> WorkerInfo:
        for worker in workers:
            if worker.id == self._last and worker.open_here == 0:
                return worker
        chosen = self._rotation.choose(workers, envelope)
        self._last = chosen.id
        return chosen


class Random:
    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, workers: list[WorkerInfo], envelope: Envelope) -> WorkerInfo:
        return self._rng.choice(workers)


class LeastLoaded:
    """Power of two choices: two random workers, the less loaded wins.

    Exact minimum would send every router's next request to the same worker between load
    reports (herding); two random choices keep nearly all of its benefit without that.
    """

    name = "least_loaded"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, workers: list[WorkerInfo], envelope: Envelope) -> WorkerInfo:
        if len(workers) == 1:
            return workers[0]
        a, b = self._rng.sample(workers, 2)
        return a if a.load <= b.load else b


POLICIES: dict[str, type[RoundRobin] | type[Sticky] | type[Random] | type[LeastLoaded]] = {
    "round_robin": RoundRobin,
    "sticky": Sticky,
    "random": Random,
    "least_loaded": LeastLoaded,
}


# The KV-cache-aware policy (routing/kv_policy.py), made by `make_policy` only: it imports
# the index and the block hashing, which the configs that read this module for --help
# need not load.
KV_POLICY = "kv"
POLICY_NAMES = (*POLICIES, KV_POLICY)


@dataclass(frozen=True, slots=True)
class KvConfig:
    """The `kv` policy's options, declared once: a router's (`RouterConfig.kv`) and a
    frontend's that routes itself (`FrontendConfig.kv`) hold this group, and `genmesh up`
    hands the routers' to the frontends. Defaults are Dynamo's KV router's but for the
    overlap weight (docs/routing.md, "The kv policy")."""

    # Dynamo's default is 1.0; at 1.0 one more active request on the worker holding a
    # 1,024-token prefix already sends the next request elsewhere to recompute it, and the
    # caches end up holding copies of each other's prefixes (docs/routing.md, measured).
    overlap_weight: float = option(
        8.0,
        flag="--kv-overlap-weight",
        parse=non_negative_float,
        help="weight of the prompt blocks a worker would still have to compute, "
        "against its active blocks (Dynamo's --kv-overlap-score-weight, whose default is "
        "1); 0 = load only",
    )
    temperature: float = option(
        0.0,
        flag="--kv-temperature",
        parse=non_negative_float,
        help="softmax temperature over the workers' costs; 0 = always the cheapest "
        "(ties to the lowest worker id, so every router chooses alike)",
    )
    events: str = option(
        "on",
        flag="--kv-events",
        choices=("on", "off"),
        help="follow the workers' KV events (workers whose card says they publish "
        "them); off = predict every worker's cache from what was routed to it",
    )
    approx_ttl_s: float = option(
        120.0,
        flag="--kv-approx-ttl",
        parse=non_negative_float,
        help="seconds a routed prompt is taken to stay in the cache of a worker "
        "without KV events (Dynamo's --router-ttl)",
    )


def make_policy(name: str, kv: KvConfig | None = None) -> Policy:
    if name == KV_POLICY:
        from genmesh.routing.kv_policy import KvPolicy

        return KvPolicy(kv or KvConfig())
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown router policy {name!r}; choose one of: {', '.join(POLICY_NAMES)}"
        ) from None


# `--router-policy`, declared once for every config that routes: a router's
# (`RouterConfig`) and a frontend's that routes itself (`FrontendConfig`), each taking it
# with `settings.reuse`, so that `genmesh up --router-policy X` means the same in both.
POLICY_OPTION = option(
    "round_robin", flag="--router-policy", choices=POLICY_NAMES, help="how to pick a worker"
)

"""Prefill/decode pairs: what the routing core needs to send a request to a decode worker
with a prefill worker (docs/disaggregation.md, "Routing a pair"). The choice itself is
`Chooser`'s (`routing/choice.py`); here are its option, the kinds it reads off the
workers' cards (their roles: `shared/cards.py`), and the paths it counts. Imports nothing
heavy: configs read it for --help.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from genmesh.routing.policies import CacheAware, Policy, make_policy
from genmesh.shared.cards import ROLE_PREFILL
from genmesh.shared.settings import non_negative_int, option

if TYPE_CHECKING:
    from genmesh.shared.discovery import WorkerInfo


# How a request routed to a decode worker runs (`genmesh_pd_routed_total{path}`): with a
# prefill worker; alone on the decode worker because little of its prompt is uncached
# there (`--pd-local-prefill-tokens`); alone there because no prefill worker could take it.
DISAGGREGATED, LOCAL, FALLBACK = "disaggregated", "local", "fallback"
PATHS = (DISAGGREGATED, LOCAL, FALLBACK)


@dataclass(frozen=True, slots=True)
class PdConfig:
    """Conditional disaggregation, declared once: a router's (`RouterConfig.pd`) and a
    frontend's that routes itself (`FrontendConfig.pd`) hold this group, and `genmesh up`
    hands the routers' to the frontends."""

    local_prefill_tokens: int = option(
        0,
        flag="--pd-local-prefill-tokens",
        parse=non_negative_int,
        help="a request whose prompt has fewer tokens than this not yet cached on its "
        "decode worker (the kv policy's overlap; nothing cached for other policies) runs "
        "there alone when that worker can (its card's disagg.local_prefill), without a "
        "prefill worker; 0 = always disaggregate",
    )


def prefill_policy(policy: Policy) -> Policy:
    """The policy instance the prefill choice uses beside `policy` (the decode choice's).

    The kv policy's state is what each worker's cache holds, which both choices read and
    the KV feed fills: shared. The others keep a rotation, a last worker or draws of their
    own: a fresh instance, so that choosing a prefill worker does not move the decode
    choice's rotation (with one decode and one prefill worker each would otherwise skip
    every other candidate)."""
    return policy if isinstance(policy, CacheAware) else make_policy(policy.name)


def cached_tokens_reader(policy: Policy) -> Callable[[], int]:
    """How to read the prompt tokens cached on the worker `policy` chose last: the kv
    policy's count; nothing for the others, which know no cache. Asked once (isinstance
    on a protocol costs microseconds)."""
    if isinstance(policy, CacheAware):
        return lambda: policy.chosen_cached_tokens
    return lambda: 0


def prefill_workers(decode: WorkerInfo, live: list[WorkerInfo], fmt: str) -> list[WorkerInfo]:
    """The live prefill workers that may prefill for `decode`: the same P/D kind (its
    engine's: the halves must speak one transfer protocol), the same model, format `fmt`."""
    kind = _kind(decode)
    if kind is None:
        return []
    model = decode.model
    return [
        w
        for w in live
        if w.role == ROLE_PREFILL and _kind(w) == kind and w.model == model and w.serves(fmt)
    ]


def local_prefill(decode: WorkerInfo) -> bool:
    """Whether decode worker `decode` can run a request alone (its card says so: the mock
    and vLLM can, SGLang's decode server cannot)."""
    facts = decode.disagg
    return facts is not None and facts.get("local_prefill") is True


def _kind(worker: WorkerInfo) -> object:
    facts = worker.disagg
    return None if facts is None else facts.get("kind")

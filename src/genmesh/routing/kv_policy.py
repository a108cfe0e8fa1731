"""The `kv` policy: the worker whose cache already holds the most of a request's prompt,
weighed against its load, as Dynamo's KV router weighs them (docs/routing.md).

Per eligible worker, with the request's prompt in `blocks` blocks (the last one possibly
partial, at least one) of which the worker holds the first `overlap`:

    cost = overlap_weight x (blocks - overlap) + active_blocks

The first term is the prefill still to compute there; `active_blocks` the decode load,
taken as the worker's active requests (its last load report plus what this process has
sent it since: `WorkerInfo.load`) times this request's blocks. Dynamo's selector
(lib/kv-router/src/scheduling/selector.rs) has the same shape: `logit =
overlap_score_weight x potential_prefill_blocks + decode_blocks`, temperature 0 by
default, its weight 1.0 by default where ours is 8.0 (`KvConfig`: measured on the
issue's shared-prefix workload, docs/routing.md). At temperature 0 the cheapest worker
wins, ties to the lowest worker id, so routers fed the same events choose alike; above 0
a worker is drawn with softmax weights over the negated costs, scaled as Dynamo scales
them (by the spread of the costs), so the temperature means the same whatever the
prompt's length.

What a worker holds comes from its KV events (`KvIndex`, fed by `routing/kv_feed.py`)
when its card says it publishes them and `--kv-events` is on; otherwise from what was
routed to it (`PredictedCache`, `--kv-approx-ttl`).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable

from genmesh.routing.kv_index import KvIndex, PredictedCache
from genmesh.routing.policies import KV_POLICY, KvConfig
from genmesh.shared.discovery import WorkerInfo
from genmesh.shared.envelope import Envelope
from genmesh.shared.errors import ErrorCode, MeshError
from genmesh.shared.kv_events import KV_EVENTS_CARD_KEY, request_block_keys

# Workers that report no block size: vLLM's and the mock's default.
DEFAULT_BLOCK_SIZE = 16


def publishes_kv_events(worker: WorkerInfo) -> bool:
    return worker.card.get(KV_EVENTS_CARD_KEY) is True


class KvPolicy:
    name = KV_POLICY

    def __init__(
        self,
        config: KvConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.follows_events = config.events == "on"
        self.index = KvIndex()
        self.predicted = PredictedCache(config.approx_ttl_s, clock)
        self._rng = rng or random.Random()
        # See `CacheAware` (routing/policies.py).
        self.chosen_cached_tokens = 0
        # The last envelope's block keys (envelope, block size, keys): a pair's two choices
        # (its decode worker's, then its prefill worker's) hash one prompt once.
        self._keys: tuple[Envelope, int, list[int]] | None = None

    def uses_events(self, worker: WorkerInfo) -> bool:
        return self.follows_events and publishes_kv_events(worker)

    def forget(self, worker: str) -> None:
        """`worker` left the mesh: what it held is gone."""
        self.index.drop(worker)
        self.predicted.drop(worker)

    def choose(self, workers: list[WorkerInfo], envelope: Envelope) -> WorkerInfo:
        size = block_size(workers)
        keys = self._block_keys(envelope, size)
        with_events = [self.uses_events(w) for w in workers]
        from_events = self.index.overlaps(keys) if any(with_events) else {}
        predicted = self.predicted.overlaps(keys) if not all(with_events) else {}
        # A partial last block is computed too, and a prompt shorter than a block still
        # costs its worker one: else such prompts would ignore load altogether.
        blocks = max(1, -(-len(envelope.token_ids) // size))
        weight = self.config.overlap_weight
        held = [
            (from_events if events else predicted).get(w.id, 0)
            for w, events in zip(workers, with_events, strict=True)
        ]
        costs = [
            weight * (blocks - overlap) + w.load * blocks
            for w, overlap in zip(workers, held, strict=True)
        ]
        pick = self._pick(workers, costs)
        chosen = workers[pick]
        # Before the prediction below counts this prompt as cached there.
        self.chosen_cached_tokens = min(held[pick] * size, len(envelope.token_ids))
        if not self.uses_events(chosen):
            info = chosen.engine_info
            tokens = None if info is None else info.max_total_num_tokens
            self.predicted.record(chosen.id, keys, None if tokens is None else tokens // size)
        return chosen

    def _block_keys(self, envelope: Envelope, size: int) -> list[int]:
        last = self._keys
        if last is not None and last[0] is envelope and last[1] == size:
            return last[2]
        keys = request_block_keys(envelope, size)
        self._keys = (envelope, size, keys)
        return keys

    def _pick(self, workers: list[WorkerInfo], costs: list[float]) -> int:
        """The index of the worker chosen among `workers`."""
        temperature = self.config.temperature
        low, high = min(costs), max(costs)
        if temperature == 0:
            return min((i for i, c in enumerate(costs) if c == low), key=lambda i: workers[i].id)
        # Dynamo's softmax_sample: costs rescaled to [-1/temperature, 0] before exp(); all
        # equal, all equally likely. Sorted, so a seeded draw does not depend on the order
        # of discovery.
        ordered = sorted(range(len(workers)), key=lambda i: workers[i].id)
        scale = 1.0 / ((high - low) * temperature) if high > low else 0.0
        weights = [math.exp((low - costs[i]) * scale) for i in ordered]
        return self._rng.choices(ordered, weights)[0]


def block_size(workers: list[WorkerInfo]) -> int:
    """The block size the workers' caches share (their cards' `engine_info.block_size`);
    `DEFAULT_BLOCK_SIZE` if none says. A mix cannot be compared block for block: refused."""
    sizes = {
        w.engine_info.block_size
        for w in workers
        if w.engine_info is not None and w.engine_info.block_size is not None
    }
    if len(sizes) > 1:
        raise MeshError(
            ErrorCode.UNAVAILABLE,
            "kv routing needs one KV block size among the eligible workers; they report "
            + ", ".join(str(s) for s in sorted(sizes)),
            retryable=False,
        )
    return sizes.pop() if sizes else DEFAULT_BLOCK_SIZE

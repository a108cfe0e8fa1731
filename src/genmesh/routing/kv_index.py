"""Which worker holds which prompt blocks: the `kv` policy's view of the workers' caches.

Blocks are known by the router's keys (`shared/kv_events.block_keys`): chained hashes, so
a key stands for the whole prefix up to its block's end, and a request's overlap with a
worker's cache is how far down the request's keys that worker holds every one. Two
sources fill a `BlockHolders`:

- `KvIndex`, from the engines' KV events: each worker's engine hashes map to router keys
  (a stored event's first block chains from its parent's key), so removals can be applied
  whatever hash the engine uses;
- `PredictedCache`, for workers that publish no events (Dynamo's `--no-kv-events`, the
  SGLang router's approximate tree): the prompts routed to a worker are taken to stay in
  its cache for a TTL.

Holders are kept per key as a bit mask of worker slots: the walk down a request's keys is
one dict lookup and one integer AND per block whatever the number of workers, and a key
costs one int of memory instead of a set (benchmarks/bench_kv_index.py).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from genmesh.shared.kv_events import (
    ROOT_SEED,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    KvEvent,
    stored_keys,
)

log = logging.getLogger(__name__)

# The device cache. vLLM's offloading connectors also report blocks in "CPU" (and
# others); routing counts only what a prefill can use as it stands.
GPU_MEDIA = (None, "GPU")


class BlockHolders:
    """Router key -> the workers holding that block, as a bit mask of worker slots."""

    def __init__(self) -> None:
        self._holders: dict[int, int] = {}
        self._slots: dict[str, int] = {}
        self._ids: list[str | None] = []  # slot -> worker id (None: free)

    def _slot(self, worker: str) -> int:
        slot = self._slots.get(worker)
        if slot is None:
            try:
                slot = self._ids.index(None)
                self._ids[slot] = worker
            except ValueError:
                slot = len(self._ids)
                self._ids.append(worker)
            self._slots[worker] = slot
        return slot

    def _free_slot(self, worker: str) -> None:
        slot = self._slots.pop(worker, None)
        if slot is not None:
            self._ids[slot] = None

    def _hold(self, bit: int, key: int) -> None:
        holders = self._holders
        holders[key] = holders.get(key, 0) | bit

    def _release(self, bit: int, key: int) -> None:
        holders = self._holders
        mask = holders.get(key, 0) & ~bit
        if mask:
            holders[key] = mask
        else:
            holders.pop(key, None)

    def overlaps(self, keys: Sequence[int]) -> dict[str, int]:
        """Per worker holding the first block, how many leading blocks of `keys` it holds
        (all of them up to that depth: a block past a missing one is of no use to a
        prefill). Workers holding none are absent."""
        holders = self._holders
        found: dict[str, int] = {}
        live = 0
        depth = 0
        for key in keys:
            mask = holders.get(key, 0)
            held = mask if depth == 0 else live & mask
            if held != live and depth:
                self._record(live & ~held, depth, found)
            live = held
            if not live:
                return found
            depth += 1
        if live:
            self._record(live, depth, found)
        return found

    def _record(self, mask: int, depth: int, found: dict[str, int]) -> None:
        ids = self._ids
        while mask:
            low = mask & -mask
            worker = ids[low.bit_length() - 1]
            if worker is not None:
                found[worker] = depth
            mask ^= low

    @property
    def keys_held(self) -> int:
        """Distinct blocks held by at least one worker."""
        return len(self._holders)


class KvIndex(BlockHolders):
    """The workers' caches as their KV events describe them.

    Per worker, engine hash -> router key: a stored event's blocks get their keys by
    chaining from the key of their parent (`stored_keys`), and a removal names engine
    hashes. A stored event whose parent this index does not hold (it was evicted before
    its child was stored, or stored before this router had any state and not in the
    snapshot) is skipped: its blocks' keys depend on the parent's, which is unknown, and
    no request could reach them anyway, since a walk from the first block stops at the
    missing parent, as the engine's own prefix match does. Such events are counted
    (`orphans`)."""

    def __init__(self) -> None:
        super().__init__()
        self._blocks: dict[str, dict[EngineHash, int]] = {}
        # A key some worker holds under more than one engine hash (engines that hash
        # something the router does not, such as a LoRA id): how many extra.
        self._extra: dict[tuple[str, int], int] = {}
        self.orphans = 0

    def workers(self) -> list[str]:
        return list(self._blocks)

    def blocks_of(self, worker: str) -> int:
        return len(self._blocks.get(worker, ()))

    def apply(self, worker: str, events: Iterable[KvEvent]) -> None:
        """Apply one message's events, in order, to `worker`'s cache."""
        blocks = self._blocks.get(worker)
        if blocks is None:
            blocks = self._blocks[worker] = {}
        bit = 1 << self._slot(worker)
        for event in events:
            if isinstance(event, BlockStored):
                if event.medium in GPU_MEDIA:
                    self._store(worker, blocks, bit, event)
            elif isinstance(event, BlockRemoved):
                if event.medium in GPU_MEDIA:
                    for engine_hash in event.block_hashes:
                        key = blocks.pop(engine_hash, None)
                        if key is not None:
                            self._unhold(worker, bit, key)
            elif isinstance(event, AllBlocksCleared):
                self._clear(worker, blocks, bit)

    def _store(
        self, worker: str, blocks: dict[EngineHash, int], bit: int, event: BlockStored
    ) -> None:
        if event.parent_hash is None:
            parent = ROOT_SEED
        else:
            known = blocks.get(event.parent_hash)
            if known is None:
                self.orphans += 1
                log.debug("worker %s stored blocks under an unknown parent; skipped", worker)
                return
            parent = known
        for engine_hash, key in zip(event.block_hashes, stored_keys(event, parent), strict=True):
            old = blocks.get(engine_hash)
            if old == key:
                continue
            if old is not None:
                self._unhold(worker, bit, old)
            blocks[engine_hash] = key
            if self._holders.get(key, 0) & bit:
                extra = (worker, key)
                self._extra[extra] = self._extra.get(extra, 0) + 1
            else:
                self._hold(bit, key)

    def _unhold(self, worker: str, bit: int, key: int) -> None:
        extra = (worker, key)
        count = self._extra.get(extra)
        if count is None:
            self._release(bit, key)
        elif count > 1:
            self._extra[extra] = count - 1
        else:
            del self._extra[extra]

    def _clear(self, worker: str, blocks: dict[EngineHash, int], bit: int) -> None:
        for key in blocks.values():
            self._release(bit, key)
        blocks.clear()
        if self._extra:
            self._extra = {k: n for k, n in self._extra.items() if k[0] != worker}

    def clear(self, worker: str) -> None:
        """Forget what `worker` holds (before a snapshot rebuilds it)."""
        blocks = self._blocks.get(worker)
        if blocks is not None:
            self._clear(worker, blocks, 1 << self._slots[worker])

    def drop(self, worker: str) -> None:
        """Forget `worker` altogether (it left the mesh)."""
        self.clear(worker)
        self._blocks.pop(worker, None)
        self._free_slot(worker)


class PredictedCache(BlockHolders):
    """The caches of workers without KV events, predicted from what was routed to them:
    a prompt's blocks are taken to stay in the cache of the worker it went to for `ttl`
    seconds after it was last routed there (Dynamo's `--no-kv-events` mode with its
    `--router-ttl`; the SGLang router's approximate radix tree), and, when the worker's
    cache size is known, only as many as it holds, least recently routed out first (as
    the engines evict). Expired entries leave lazily, oldest first, whenever the cache is
    used."""

    def __init__(self, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.ttl = ttl
        self.clock = clock
        # Per worker, key -> expiry, in expiry order (every entry lives `ttl`).
        self._expiry: dict[str, OrderedDict[int, float]] = {}

    def record(self, worker: str, keys: Iterable[int], capacity: int | None = None) -> None:
        """`keys` were routed to `worker` now, whose cache holds `capacity` blocks (None:
        unknown)."""
        now = self.clock()
        self.expire(now)
        entries = self._expiry.get(worker)
        if entries is None:
            entries = self._expiry[worker] = OrderedDict()
        bit = 1 << self._slot(worker)
        until = now + self.ttl
        for key in keys:
            if key in entries:
                entries.move_to_end(key)
            else:
                self._hold(bit, key)
            entries[key] = until
        # In expiry order, which is also the order they were last routed in.
        while capacity is not None and len(entries) > capacity:
            self._release(bit, entries.popitem(last=False)[0])

    def overlaps(self, keys: Sequence[int]) -> dict[str, int]:
        self.expire(self.clock())
        return super().overlaps(keys)

    def expire(self, now: float) -> None:
        for worker, entries in self._expiry.items():
            if entries and next(iter(entries.values())) <= now:
                bit = 1 << self._slots[worker]
                while entries:
                    key, until = next(iter(entries.items()))
                    if until > now:
                        break
                    del entries[key]
                    self._release(bit, key)

    def drop(self, worker: str) -> None:
        entries = self._expiry.pop(worker, None)
        if entries:
            bit = 1 << self._slots[worker]
            for key in entries:
                self._release(bit, key)
        self._free_slot(worker)

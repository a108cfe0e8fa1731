"""The mock engine's KV cache: a paged block pool with prefix caching, as vLLM's.

Modelled on vLLM's `BlockPool` (vllm/v1/core/block_pool.py) and its KV cache manager
(vllm/v1/core/kv_cache_manager.py):

- The pool has a fixed number of blocks of `block_size` tokens. A running request holds
  one block per `block_size` tokens of its sequence (the last one partly filled); blocks
  that a running request holds are never evicted.
- A full block is *cached* under a hash chained over every token up to its end (and its
  extra keys: a cache salt, multimodal items), so it is only ever found behind the same
  prefix. A request's prompt blocks are cached once its prefill is done, its output
  blocks as they fill (vLLM caches full blocks of generated tokens too).
- Freed blocks go to a free queue in eviction order; a block is evicted (its hash
  dropped, a `BlockRemoved` event) only when the pool hands it out again. A request
  frees its blocks last block first, so a prefix's tail is evicted before its head.
- Events are queued as vLLM's are (`BlockStored` per newly cached run of blocks with its
  parent's hash, `BlockRemoved` per evicted block, `AllBlocksCleared` on a reset) and
  taken by the engine once per scheduler step (`take_events`).

Where the mock departs from vLLM, and why:

- **No waiting for blocks.** vLLM does not schedule a request until the pool has blocks
  for it. The mock runs every request it admits, so when the pool has no free block what
  does not fit is simply not cached: the request holds what it got and caches no block
  past it.
- **Blank blocks are reused before cached ones.** vLLM appends every freed block to the
  tail of one queue, so a blank block freed recently waits behind older cached blocks;
  the mock puts blank blocks first, so a cached block is evicted only when no blank one
  is left (as SGLang's radix cache evicts only when out of free pages): eviction is LRU
  among the free cached blocks.
- **No duplicate blocks.** vLLM keeps a second physical block with the same hash when two
  requests computed the same block at once (`BlockHashToBlockMap`, NOTE #1) and announces
  the hash twice; the mock keeps the first, moves the later request onto it and frees its
  own, as SGLang does on insert, so every cached hash is announced once and removed once.
- **Its own block hash.** SHA-256 (vLLM's default algorithm; its events carry the 32
  bytes) over the parent's hash, the block's tokens as little-endian int32 and its extra
  keys: deliberately not the router's `block_keys`, so a router is proven to key its index
  on the tokens the events carry, never on an engine's hashing.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from genmesh.codecs.int32 import to_le_bytes
from genmesh.shared.envelope import TokenIds
from genmesh.shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

# vLLM's `MEDIUM_GPU` (vllm/distributed/kv_events.py): where the mock's blocks live.
MEDIUM = "GPU"
# The parent of every sequence's first block (vLLM's NONE_HASH, fixed here so every mock
# worker hashes alike, as vLLM does with sha256).
_ROOT = hashlib.sha256(b"genmesh-mock-kv").digest()

ExtraKeys = Sequence[tuple[Any, ...] | None] | None


def mock_block_hash(parent: bytes | None, tokens: bytes, extra: tuple[Any, ...] | None) -> bytes:
    """The mock's hash of one block: `tokens` its little-endian int32 bytes."""
    h = hashlib.sha256(parent or _ROOT)
    h.update(tokens)
    if extra:
        h.update(repr(extra).encode())
    return h.digest()


@dataclass(slots=True, eq=False)
class _Block:
    id: int
    # Set while the block is cached (findable by a later request).
    hash: bytes | None = None
    # Running requests holding it; a block is free (in the queue) at 0.
    refs: int = 0


class BlockPool:
    """`num_blocks` blocks of `block_size` tokens. With `on_step`, the events of each
    scheduler step go to `on_step(events)` when the step is over: the mock has no step loop
    of its own (its requests advance as event-loop turns), so a step is one turn, and what
    a turn queued is taken at the start of the next. Without, the owner calls
    `take_events` itself."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        on_step: Callable[[list[KvEvent]], None] | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a block pool needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._on_step = on_step
        # Freed blocks in the order they are handed out: blank ones first, then cached
        # ones least recently used first. Blocks never used yet are made when first
        # needed (`_unused` of them are left), so a big idle pool costs nothing.
        self._free: OrderedDict[int, _Block] = OrderedDict()
        self._unused = num_blocks
        self._cached: dict[bytes, _Block] = {}
        self._events: list[KvEvent] = []

    @property
    def free_blocks(self) -> int:
        return len(self._free) + self._unused

    @property
    def held_blocks(self) -> int:
        """Blocks running requests hold (vLLM's `get_usage` is their share)."""
        return self.num_blocks - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        return len(self._cached)

    def take_events(self) -> list[KvEvent]:
        """The events queued since the last call, oldest first (vLLM's `take_events`)."""
        events, self._events = self._events, []
        return events

    def open(self, prompt: Sequence[int], extra: ExtraKeys = None) -> RequestBlocks:
        """A request's blocks: the cached blocks its prompt starts with (held from now
        on), and new blocks for the rest of it, as far as the pool has them."""
        return RequestBlocks(self, TokenIds(prompt), extra)

    def clear(self) -> bool:
        """Forget every cached block (vLLM's `reset_prefix_cache`): only while no request
        holds a block; False (nothing done) otherwise."""
        if self.free_blocks < self.num_blocks:
            return False
        for block in self._cached.values():
            block.hash = None
        self._cached.clear()
        self._emit(AllBlocksCleared())
        return True

    # -- for RequestBlocks ---------------------------------------------------------------

    def _emit(self, event: KvEvent) -> None:
        if not self._events and self._on_step is not None:
            asyncio.get_running_loop().call_soon(self._step_over)
        self._events.append(event)

    def _step_over(self) -> None:
        events = self.take_events()
        if events and self._on_step is not None:
            self._on_step(events)

    def _lookup(self, block_hash: bytes) -> _Block | None:
        return self._cached.get(block_hash)

    def _allocate(self) -> _Block | None:
        """A free block, evicting what it cached; None when every block is held."""
        if self._free and (not self._unused or next(iter(self._free.values())).hash is None):
            _, block = self._free.popitem(last=False)
        elif self._unused:
            block = _Block(self.num_blocks - self._unused)
            self._unused -= 1
        else:
            return None
        if block.hash is not None:
            del self._cached[block.hash]
            self._emit(BlockRemoved([block.hash], medium=MEDIUM))
            block.hash = None
        block.refs = 1
        return block

    def _touch(self, block: _Block) -> None:
        if block.refs == 0:
            del self._free[block.id]
        block.refs += 1

    def _cache(self, block: _Block, block_hash: bytes) -> None:
        block.hash = block_hash
        self._cached[block_hash] = block

    def _release(self, block: _Block) -> None:
        block.refs -= 1
        if block.refs:
            return
        self._free[block.id] = block
        if block.hash is None:
            self._free.move_to_end(block.id, last=False)


class RequestBlocks:
    """The blocks one running request holds, from its start (`BlockPool.open`) to its
    end (`release`). `cached_tokens`: the prompt tokens found cached."""

    def __init__(self, pool: BlockPool, prompt: TokenIds, extra: ExtraKeys) -> None:
        self._pool = pool
        self._tokens = prompt
        self._extra = list(extra or ())
        size = pool.block_size
        data = to_le_bytes(prompt)
        step = size * 4
        # The chained hash of every full block so far (output blocks' as they fill).
        self._hashes: list[bytes] = []
        parent: bytes | None = None
        for i in range(len(prompt) // size):
            parent = mock_block_hash(parent, data[i * step : (i + 1) * step], self._extra_of(i))
            self._hashes.append(parent)
        # At least one prompt token is computed, as in vLLM (the last position's logits
        # are needed): a prompt cached whole is found a block short.
        hits: list[_Block] = []
        for block_hash in self._hashes[: (len(prompt) - 1) // size]:
            block = pool._lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        for block in hits:
            pool._touch(block)  # before allocating, so allocation cannot evict them
        self._blocks = hits
        # Leading blocks that are cached (found, or stored by this request).
        self._stored = len(hits)
        # The pool ran dry: no further block is held or cached.
        self._starved = False
        self.cached_tokens = len(hits) * size
        self._grow()

    def _extra_of(self, block: int) -> tuple[Any, ...] | None:
        return self._extra[block] if block < len(self._extra) else None

    def _grow(self) -> None:
        """Hold a block for every `block_size` tokens of the sequence, as far as the pool
        has free ones."""
        needed = -(-len(self._tokens) // self._pool.block_size)
        while len(self._blocks) < needed and not self._starved:
            block = self._pool._allocate()
            if block is None:
                self._starved = True
            else:
                self._blocks.append(block)

    def prefilled(self) -> None:
        """The prompt is computed: cache its full blocks."""
        self._store(len(self._tokens))

    def extend(self, tokens: Sequence[int]) -> None:
        """Tokens generated in a step. The last one's KV is computed at the next step,
        so the blocks cached now are those full without it."""
        self._tokens.extend(tokens)
        self._grow()
        self._store(len(self._tokens) - 1)

    def release(self) -> None:
        """The request ended: its blocks are free again, its last block first, so a
        prefix's tail is evicted before its head. What it cached stays cached."""
        for block in reversed(self._blocks):
            self._pool._release(block)
        self._blocks = []
        self._starved = True

    def _store(self, computed: int) -> None:
        """Cache the held blocks that `computed` tokens fill, one `BlockStored` per run of
        newly cached blocks (a run breaks where a block was cached already)."""
        pool, size = self._pool, self._pool.block_size
        full = min(computed // size, len(self._blocks))
        run: list[int] = []
        for i in range(self._stored, full):
            if i == len(self._hashes):
                block_tokens = to_le_bytes(self._tokens[i * size : (i + 1) * size])
                parent = self._hashes[i - 1] if i else None
                self._hashes.append(mock_block_hash(parent, block_tokens, self._extra_of(i)))
            block_hash = self._hashes[i]
            existing = pool._lookup(block_hash)
            if existing is None:
                pool._cache(self._blocks[i], block_hash)
                run.append(i)
                continue
            # Computed here and by another request at once: keep the cached one.
            self._flush_run(run)
            run = []
            pool._touch(existing)
            pool._release(self._blocks[i])
            self._blocks[i] = existing
        self._flush_run(run)
        self._stored = max(self._stored, full)

    def _flush_run(self, run: list[int]) -> None:
        if not run:
            return
        size = self._pool.block_size
        first, end = run[0], run[-1] + 1
        extra = [self._extra_of(i) for i in run]
        self._pool._emit(
            BlockStored(
                block_hashes=[self._hashes[i] for i in run],
                parent_hash=self._hashes[first - 1] if first else None,
                token_ids=TokenIds(self._tokens[first * size : end * size]),
                block_size=size,
                extra_keys=extra if any(k is not None for k in extra) else None,
                medium=MEDIUM,
            )
        )

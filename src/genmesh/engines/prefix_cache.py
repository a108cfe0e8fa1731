"""A small prefix cache for the mock engine: what makes `cached_tokens` and a flush real.

Tokens are cached in whole blocks of `block_size`, each block keyed by a hash of every
token up to its end (so a block is only ever found behind the same prefix, as in vLLM's
block hashing and SGLang's radix tree). Blocks are evicted least recently used first once
more than `capacity_tokens` are held.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixCache:
    def __init__(self, block_size: int, capacity_tokens: int) -> None:
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self.block_size = block_size
        self.capacity_blocks = max(capacity_tokens // block_size, 0)
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        """Blocks held."""
        return len(self._blocks)

    def _keys(self, tokens: Sequence[int]) -> list[int]:
        keys: list[int] = []
        key = 0
        size = self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            # Python hashes tuples of ints the same in every process (no salt).
            key = hash((key, *tokens[start : start + size]))
            keys.append(key)
        return keys

    def lookup(self, prompt: Sequence[int]) -> int:
        """How many leading tokens of `prompt` are cached. At least one prompt token is
        always computed (as in real engines: the last position's logits are needed), so
        the answer stops a block short of a prompt that is cached whole."""
        hits = 0
        for key in self._keys(prompt):
            if key not in self._blocks:
                break
            self._blocks.move_to_end(key)
            hits += 1
        cached = hits * self.block_size
        if cached >= len(prompt):
            cached = max(cached - self.block_size, 0)
        return cached

    def insert(self, tokens: Sequence[int]) -> None:
        """Cache the whole blocks of `tokens` (a prompt, or a prompt and its output)."""
        if not self.capacity_blocks:
            return
        for key in self._keys(tokens):
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()

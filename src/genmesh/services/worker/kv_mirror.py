"""The worker's copy of its engine's KV cache, as the engine's events describe it: what a
router that missed some events rebuilds its index from (docs/protocol.md §13).

Engine-agnostic: it knows blocks only by the engine's hashes and the facts a
`BlockStored` carries (parent, tokens, extra keys), whichever engine sent them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from genmesh.shared.envelope import TokenIds
from genmesh.shared.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    KvEvent,
)

# A block's identity: an engine announces the same hash per medium it holds it on (vLLM's
# offloading connectors store a GPU block's copy on "CPU" under its hash).
_Key = tuple[str | None, EngineHash]


@dataclass(slots=True)
class _Block:
    parent: EngineHash | None
    tokens: TokenIds
    block_size: int
    extra: tuple[Any, ...] | None
    lora_id: int | None


class KvMirror:
    def __init__(self) -> None:
        self._blocks: dict[_Key, _Block] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def copy(self) -> KvMirror:
        """The cache as of now, unchanged by later events (its blocks are never modified,
        only replaced or dropped): what a snapshot is paged from."""
        frozen = KvMirror()
        frozen._blocks = dict(self._blocks)
        return frozen

    def apply(self, events: Iterable[KvEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self._store(event)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    self._blocks.pop((event.medium, block_hash), None)
            elif isinstance(event, AllBlocksCleared):
                self._blocks.clear()

    def _store(self, event: BlockStored) -> None:
        size, parent = event.block_size, event.parent_hash
        extra = event.extra_keys or ()
        for i, block_hash in enumerate(event.block_hashes):
            self._blocks[(event.medium, block_hash)] = _Block(
                parent,
                TokenIds(event.token_ids[i * size : (i + 1) * size]),
                size,
                extra[i] if i < len(extra) else None,
                event.lora_id,
            )
            parent = block_hash

    def pages(self, page_bytes: int) -> list[list[BlockStored]]:
        """The cache as `BlockStored` events that rebuild it in order, each block after
        its parent, a chain's consecutive blocks in one event; cut into pages of about
        `page_bytes` at most once encoded (at least one page, maybe empty). A block
        whose parent is not cached (an engine may evict a parent first) comes with its
        parent's hash all the same, as the live event did."""
        pages: list[list[BlockStored]] = [[]]
        size = 0
        run: list[tuple[_Key, _Block]] = []
        for key, block in self._parents_first():
            cost = len(block.tokens) * 4 + _hash_size(key[1]) + 8
            if size + cost > page_bytes and (run or pages[-1]):
                _close(run, pages[-1])
                run = []
                pages.append([])
                size = 0
            if run and not _continues(run[-1], key, block):
                _close(run, pages[-1])
                run = []
            run.append((key, block))
            size += cost
        _close(run, pages[-1])
        return pages

    def _parents_first(self) -> Iterator[tuple[_Key, _Block]]:
        """Depth first from each block whose parent is not cached: a chain's blocks come
        one after the other."""
        children: dict[_Key, list[_Key]] = {}
        roots: list[_Key] = []
        for key, block in self._blocks.items():
            parent = (key[0], block.parent)
            if block.parent is not None and parent in self._blocks:
                children.setdefault(parent, []).append(key)
            else:
                roots.append(key)
        stack = roots[::-1]
        while stack:
            key = stack.pop()
            yield key, self._blocks[key]
            stack += children.get(key, [])[::-1]


def _hash_size(block_hash: EngineHash) -> int:
    return len(block_hash) if isinstance(block_hash, bytes) else 9


def _continues(last: tuple[_Key, _Block], key: _Key, block: _Block) -> bool:
    (medium, last_hash), previous = last
    return (
        block.parent == last_hash
        and key[0] == medium
        and block.block_size == previous.block_size
        and block.lora_id == previous.lora_id
    )


def _close(run: list[tuple[_Key, _Block]], page: list[BlockStored]) -> None:
    if not run:
        return
    (medium, _), first = run[0]
    tokens = TokenIds()
    for _, block in run:
        tokens.extend(block.tokens)
    extra = [block.extra for _, block in run]
    page.append(
        BlockStored(
            block_hashes=[key[1] for key, _ in run],
            parent_hash=first.parent,
            token_ids=tokens,
            block_size=first.block_size,
            extra_keys=extra if any(k is not None for k in extra) else None,
            lora_id=first.lora_id,
            medium=medium,
        )
    )

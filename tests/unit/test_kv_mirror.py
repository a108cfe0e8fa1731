"""The worker's mirror of its engine's cache and the snapshot pages made of it."""

from __future__ import annotations

import pytest

from genmesh.services.worker.kv_mirror import KvMirror
from genmesh.shared.envelope import TokenIds
from genmesh.shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

pytestmark = pytest.mark.unit


def stored(hashes: list[int], parent: int | None, first_token: int, **kw: object) -> BlockStored:
    tokens = TokenIds(range(first_token, first_token + 2 * len(hashes)))
    return BlockStored(hashes, parent, tokens, 2, **kw)  # type: ignore[arg-type]


def flat(mirror: KvMirror, page_bytes: int = 1 << 20) -> list[tuple[list[object], object]]:
    return [(e.block_hashes, e.parent_hash) for p in mirror.pages(page_bytes) for e in p]


def test_a_chain_comes_back_as_one_event_with_its_tokens_and_facts() -> None:
    mirror = KvMirror()
    mirror.apply([stored([1], None, 10), stored([2, 3], 1, 12, extra_keys=[("s",), None])])
    ((event,),) = mirror.pages(1 << 20)
    assert (event.block_hashes, event.parent_hash) == ([1, 2, 3], None)
    assert list(event.token_ids) == list(range(10, 16))
    assert event.extra_keys == [None, ("s",), None]


def test_parents_come_first_whatever_order_they_were_stored_in() -> None:
    mirror = KvMirror()
    # A parent evicted and stored again after its children: the dict order is wrong.
    mirror.apply([stored([1, 2], None, 0), stored([5], 2, 50), BlockRemoved([2])])
    mirror.apply([stored([2], 1, 2), stored([6], 1, 60)])
    order = [h for hashes, _ in flat(mirror) for h in hashes]
    assert order.index(1) < order.index(2) < order.index(5)
    assert order.index(1) < order.index(6)
    assert sorted(order) == [1, 2, 5, 6]


def test_an_orphan_keeps_its_parents_hash() -> None:
    mirror = KvMirror()
    mirror.apply([stored([1, 2, 3], None, 0), BlockRemoved([2])])
    assert flat(mirror) == [([1], None), ([3], 2)]


def test_removals_and_clears_apply_per_medium() -> None:
    mirror = KvMirror()
    mirror.apply([stored([1], None, 0, medium="GPU"), stored([1], None, 0, medium="CPU")])
    mirror.apply([BlockRemoved([1], medium="GPU")])
    ((event,),) = mirror.pages(1 << 20)
    assert event.medium == "CPU"
    mirror.apply([AllBlocksCleared()])
    assert (len(mirror), mirror.pages(1 << 20)) == (0, [[]])


def test_pages_are_cut_by_size_and_a_chain_continues_on_the_next() -> None:
    mirror = KvMirror()
    mirror.apply([stored(list(range(1, 11)), None, 0)])
    pages = mirror.pages(3 * (2 * 4 + 9 + 8))  # three blocks of 2 tokens, int hashes
    assert [[e.block_hashes for e in p] for p in pages] == [
        [[1, 2, 3]],
        [[4, 5, 6]],
        [[7, 8, 9]],
        [[10]],
    ]
    assert [p[0].parent_hash for p in pages] == [None, 3, 6, 9]
    assert len(mirror.pages(1)) == 10

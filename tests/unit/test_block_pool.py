"""The mock's paged prefix cache (engines/prefix_cache.py) and the KV events it publishes
(engines/kv_feed.py, `MockEngine.kv_events`)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from genmesh.client import request
from genmesh.engines.base import EngineOutput
from genmesh.engines.mock import MockConfig, MockEngine
from genmesh.engines.prefix_cache import MEDIUM, BlockPool, mock_block_hash
from genmesh.shared.envelope import Envelope
from genmesh.shared.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    decode_engine_batch,
    encode_engine_batch,
    request_block_keys,
    stored_keys,
)

pytestmark = pytest.mark.unit


def run(pool: BlockPool, prompt: list[int], output: list[int] = ()) -> int:  # type: ignore[assignment]
    """One request start to end: its cached tokens."""
    blocks = pool.open(prompt)
    blocks.prefilled()
    if output:
        blocks.extend(output)
    blocks.release()
    return blocks.cached_tokens


def stored(events: list[KvEvent]) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]


# ------------------------------------------------------------------ hits


def test_hits_are_whole_blocks_behind_the_same_prefix() -> None:
    pool = BlockPool(num_blocks=16, block_size=4)
    prompt = list(range(10))
    assert run(pool, prompt) == 0  # blocks [0..3], [4..7]; the tail 8, 9 is no whole block
    assert pool.open(prompt).cached_tokens == 8
    pool = BlockPool(num_blocks=16, block_size=4)
    run(pool, prompt)
    assert pool.open(list(range(8))).cached_tokens == 4  # cached whole: one block computed
    assert pool.open([0, 1, 2, 3, 99, 5, 6, 7, 8]).cached_tokens == 4  # diverges in block 2
    assert pool.open([9, 1, 2, 3, 4, 5, 6, 7, 8]).cached_tokens == 0  # same block 2, other prefix


def test_nothing_is_cached_before_the_prefill_is_done() -> None:
    pool = BlockPool(num_blocks=16, block_size=4)
    first = pool.open(list(range(9)))
    assert pool.open(list(range(9))).cached_tokens == 0  # computing, not cached yet
    first.prefilled()
    assert pool.open(list(range(9))).cached_tokens == 8


def test_extra_keys_enter_the_hash_so_a_salted_prompt_hits_only_its_salt() -> None:
    pool = BlockPool(num_blocks=16, block_size=4)
    prompt = list(range(9))
    salted = pool.open(prompt, [("salt-a",)])
    salted.prefilled()
    salted.release()
    assert pool.open(prompt).cached_tokens == 0
    assert pool.open(prompt, [("salt-b",)]).cached_tokens == 0
    assert pool.open(prompt, [("salt-a",)]).cached_tokens == 8
    (event,) = stored(pool.take_events())
    assert event.extra_keys == [("salt-a",), None]


# ------------------------------------------------------------------ eviction


def test_free_cached_blocks_are_evicted_least_recently_used_first() -> None:
    pool = BlockPool(num_blocks=6, block_size=2)
    run(pool, [1, 2, 3, 4])
    run(pool, [5, 6, 7, 8])
    assert pool.cached_blocks == 4
    assert run(pool, [1, 2, 3, 4, 9]) == 4  # touched: now the most recent
    pool.take_events()
    # Needs 4 blocks: the blank one, the last unused one, then evicts [7,8] and [5,6]
    # (least recently used, and of a prefix its tail first).
    run(pool, list(range(10, 18)))
    removed = [e for e in pool.take_events() if isinstance(e, BlockRemoved)]
    h56 = mock_block_hash(None, bytes([5, 0, 0, 0, 6, 0, 0, 0]), None)
    h78 = mock_block_hash(h56, bytes([7, 0, 0, 0, 8, 0, 0, 0]), None)
    assert removed == [BlockRemoved([h78], medium=MEDIUM), BlockRemoved([h56], medium=MEDIUM)]
    assert pool.open([1, 2, 3, 4, 9]).cached_tokens == 4
    assert pool.open([5, 6, 7, 8, 9]).cached_tokens == 0


def test_blank_blocks_are_used_before_any_cached_block_is_evicted() -> None:
    pool = BlockPool(num_blocks=3, block_size=2)
    run(pool, [1, 2])
    run(pool, [3, 4, 5])  # [3,4] cached; its partial block is freed blank, after [1,2]
    run(pool, [6])  # vLLM's one queue would evict [1,2] here; the blank block serves
    assert pool.cached_blocks == 2
    assert not [e for e in pool.take_events() if isinstance(e, BlockRemoved)]


def test_blocks_a_running_request_holds_are_never_evicted() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    holder = pool.open([1, 2, 3, 4, 5])  # holds 3 blocks
    holder.prefilled()
    pool.take_events()
    other = pool.open([7, 8, 9, 10, 11, 12, 13])  # wants 4: gets the one left
    assert pool.free_blocks == 0
    assert not [e for e in pool.take_events() if isinstance(e, BlockRemoved)]
    probe = pool.open([1, 2, 3, 4, 6])
    assert probe.cached_tokens == 4  # the holder's blocks still hit
    probe.release()
    other.prefilled()
    # What did not fit is simply not cached: only its one held block.
    assert [len(e.block_hashes) for e in stored(pool.take_events())] == [1]
    other.extend([14, 15, 16])  # nothing more to hold, nothing more cached
    assert pool.take_events() == []
    other.release()
    holder.release()
    assert pool.free_blocks == 4


def test_usage_counts_held_blocks_and_a_shared_prefix_once() -> None:
    """What slows the mock's decode steps (vLLM's `get_usage`)."""
    pool = BlockPool(num_blocks=10, block_size=2)
    run(pool, [1, 2, 3, 4])  # cached, free again
    assert pool.held_blocks == 0
    a, b = pool.open([1, 2, 3, 4, 5]), pool.open([1, 2, 3, 4, 6])
    assert pool.held_blocks == 4  # the shared 2 blocks, and one block of its own each
    a.release()
    b.release()
    assert pool.held_blocks == 0


def test_output_blocks_are_cached_as_they_fill_without_the_last_sampled_token() -> None:
    pool = BlockPool(num_blocks=16, block_size=4)
    blocks = pool.open([1, 2, 3, 4, 5, 6])
    blocks.prefilled()
    assert [list(e.token_ids) for e in stored(pool.take_events())] == [[1, 2, 3, 4]]
    blocks.extend([7, 8])  # 8 is sampled, its KV computed at the next step
    assert pool.take_events() == []
    blocks.extend([9])
    (event,) = stored(pool.take_events())
    assert list(event.token_ids) == [5, 6, 7, 8]
    assert event.parent_hash == mock_block_hash(None, _le([1, 2, 3, 4]), None)
    blocks.release()
    # A later request with that conversation as its prompt finds it all.
    assert pool.open([1, 2, 3, 4, 5, 6, 7, 8, 9]).cached_tokens == 8


def test_a_block_two_requests_computed_at_once_is_cached_and_announced_once() -> None:
    pool = BlockPool(num_blocks=8, block_size=2)
    a, b = pool.open([1, 2, 3, 4, 5]), pool.open([1, 2, 3, 4, 5])
    assert pool.free_blocks == 2
    a.prefilled()
    b.prefilled()  # its copies go back: it holds a's blocks now
    assert [len(e.block_hashes) for e in stored(pool.take_events())] == [2]
    assert pool.free_blocks == 4
    a.release()
    b.release()
    assert pool.free_blocks == 8
    assert pool.cached_blocks == 2


# ------------------------------------------------------------------ flush


def test_a_flush_is_refused_while_blocks_are_held_and_then_clears_everything() -> None:
    pool = BlockPool(num_blocks=8, block_size=2)
    blocks = pool.open([1, 2, 3])
    blocks.prefilled()
    assert pool.clear() is False
    blocks.release()
    pool.take_events()
    assert pool.clear() is True
    assert pool.take_events() == [AllBlocksCleared()]
    assert (pool.cached_blocks, pool.free_blocks) == (0, 8)
    assert run(pool, [1, 2, 3]) == 0


# ------------------------------------------------------------------ event content


def test_stored_events_chain_their_parents_and_carry_what_a_router_keys() -> None:
    """The hashes are the mock's own (32-byte SHA-256, not the router's keys), yet the
    router keys the blocks from the events exactly as it keys the prompt."""
    pool = BlockPool(num_blocks=32, block_size=4)
    prompt = list(range(100, 118))
    first = pool.open(prompt[:9])
    first.prefilled()
    first.release()
    second = pool.open(prompt)
    second.prefilled()
    events = stored(pool.take_events())
    assert [len(e.block_hashes) for e in events] == [2, 2]
    one, two = events
    assert one.parent_hash is None
    assert two.parent_hash == one.block_hashes[-1]
    assert all(isinstance(h, bytes) and len(h) == 32 for h in one.block_hashes + two.block_hashes)
    assert (one.block_size, one.medium, one.lora_id, one.extra_keys) == (4, "GPU", None, None)
    assert list(one.token_ids) + list(two.token_ids) == prompt[:16]
    keys = stored_keys(one)
    keys += stored_keys(two, keys[-1])
    assert keys == request_block_keys(request(prompt), 4)


def test_the_events_survive_the_engines_wire_encoding() -> None:
    pool = BlockPool(num_blocks=2, block_size=2)
    run(pool, [1, 2, 3, 4, 5])
    run(pool, [6, 7, 8])
    batch = KvEventBatch(1.5, pool.take_events())
    assert [type(e) for e in batch.events] == [BlockStored, BlockRemoved, BlockRemoved, BlockStored]
    for array_like in (True, False):
        decoded = decode_engine_batch(encode_engine_batch(batch, array_like=array_like))
        assert [type(e) for e in decoded.events] == [type(e) for e in batch.events]
        assert [getattr(e, "block_hashes", None) for e in decoded.events] == [
            getattr(e, "block_hashes", None) for e in batch.events
        ]


# ------------------------------------------------------------------ the mock engine's stream


def mock(**knobs: Any) -> MockEngine:
    return MockEngine(MockConfig(vocab_size=1000, eos_token_id=7, **knobs))


async def outputs(engine: MockEngine, prompt: list[int], **kw: Any) -> list[EngineOutput]:
    return [o async for o in engine.generate(request(prompt, **kw))]


async def test_without_a_cache_the_mock_publishes_no_events() -> None:
    assert mock().kv_events() is None
    assert mock(prefix_cache=True).kv_events() is not None
    engine = mock(kv_blocks=64)  # the size alone turns the cache on
    assert engine.kv_events() is not None
    assert engine.describe()["engine_info"]["max_total_num_tokens"] == 64 * 16


async def test_one_batch_per_step_with_what_that_step_did() -> None:
    engine = mock(kv_blocks=64, block_size=4)
    events = engine.kv_events()
    assert events is not None
    # Two instant requests run in the same turns: each step's events come as one batch.
    await asyncio.gather(
        outputs(engine, list(range(100, 110)), max_tokens=1),
        outputs(engine, list(range(200, 210)), max_tokens=1),
    )
    batch = await asyncio.wait_for(anext(events), 1)
    assert [len(e.block_hashes) for e in stored(batch.events)] == [2, 2]
    assert [list(e.token_ids)[:1] for e in stored(batch.events)] == [[100], [200]]
    # Nothing more was queued: the two stores were one batch, not one per block.
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(anext(events), 0.05)
    await engine.flush_cache()
    batch = await asyncio.wait_for(anext(events), 1)
    assert batch.events == [AllBlocksCleared()]
    await events.aclose()  # type: ignore[attr-defined]


async def test_the_mock_reports_cached_tokens_and_stores_its_output_blocks() -> None:
    engine = mock(kv_blocks=64, block_size=4)
    prompt = list(range(100, 110))
    first = await outputs(engine, prompt, max_tokens=7, ignore_eos=True)
    generated = [t for o in first for t in o.tokens]
    again = await outputs(engine, prompt + generated, max_tokens=1)
    # 17 tokens: 4 whole blocks, the last token not computed by the first request.
    assert again[0].cached_tokens == 16
    assert again[-1].usage == {"prompt_tokens": 17, "completion_tokens": 1, "cached_tokens": 16}


async def test_a_small_pool_evicts_and_says_so() -> None:
    engine = mock(kv_blocks=4, block_size=4)
    events = engine.kv_events()
    assert events is not None
    await outputs(engine, list(range(100, 112)), max_tokens=1)
    await outputs(engine, list(range(200, 212)), max_tokens=1)
    seen: list[KvEvent] = []
    while len(seen) < 5:
        seen += (await asyncio.wait_for(anext(events), 1)).events
    first, *removed, second, last = seen
    assert isinstance(first, BlockStored)
    assert isinstance(second, BlockStored)
    # The first request held a 4th block for its output token, freed blank: the second
    # took it, then evicted the first's blocks tail first: two for its prompt, one for
    # its output token.
    assert removed == [BlockRemoved([h], medium="GPU") for h in first.block_hashes[:0:-1]]
    assert last == BlockRemoved([first.block_hashes[0]], medium="GPU")
    assert (await outputs(engine, list(range(200, 212)), max_tokens=1))[0].cached_tokens == 8


def _le(tokens: list[int]) -> bytes:
    return b"".join(t.to_bytes(4, "little") for t in tokens)


async def test_multimodal_items_key_the_mocks_blocks_as_the_router_keys_the_request() -> None:
    """vLLM's extra keys (shared/kv_events.request_extra_keys) enter the mock's hashes and
    its events, down to the block its output completes: the router's keys of the events
    are the request's, and another image behind the same text is not a hit."""

    def with_image(image: str) -> Envelope:
        env = request(list(range(84)), max_tokens=13, ignore_eos=True)
        env.format = "vllm"
        env.engine = {
            "features": {
                "mm_hashes": {"image": [image]},
                "mm_placeholders": {"image": [{"offset": 76, "length": 8}]},
                "kwargs_data": {"image": ["YQ=="]},
            }
        }
        return env

    engine = mock(kv_blocks=64)
    events = engine.kv_events()
    assert events is not None
    cat = with_image("c" * 64)
    [o async for o in engine.generate(cat)]
    seen: list[KvEvent] = []
    while len(stored(seen)) < 2:
        seen += (await asyncio.wait_for(anext(events), 1)).events
    prompt_blocks, output_block = stored(seen)
    # 84 + 13 tokens, the last not computed: 6 blocks of 16, the 6th completed by output
    # (stored in the step that completed it, the prompt's after the prefill).
    assert len(prompt_blocks.block_hashes) == 5
    assert prompt_blocks.extra_keys == [None, None, None, None, (("c" * 64, 12),)]
    assert output_block.parent_hash == prompt_blocks.block_hashes[-1]
    assert output_block.extra_keys == [(("c" * 64, -4),)]
    assert stored_keys(prompt_blocks) == request_block_keys(cat, 16)
    dog = [o async for o in engine.generate(with_image("d" * 64))]
    assert dog[0].cached_tokens == 64  # the text before the image
    again = [o async for o in engine.generate(with_image("c" * 64))]
    assert again[0].cached_tokens == 80

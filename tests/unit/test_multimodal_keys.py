"""Multimodal items in the router's block keys, as vLLM keys its KV blocks
(vllm/v1/core/kv_cache_utils.py `generate_block_hash_extra_keys`): a block over an item's
placeholders carries `(item hash, item offset - block start)`, then the cache salt on the
first block; stored events carry the same per-block extra keys, so the keys a router makes
of a request and of the events its blocks caused are equal. Features vLLM would refuse,
reaching routing in an envelope no format checked, leave the text-only keys."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from genmesh.codecs import get_codec
from genmesh.shared.envelope import Envelope, Routing, TokenIds
from genmesh.shared.kv_events import (
    BlockStored,
    KvEventBatch,
    KvEventsMessage,
    block_keys,
    decode_engine_batch,
    encode_engine_batch,
    mm_block_keys,
    request_block_keys,
    request_extra_keys,
    stored_keys,
)
from genmesh.shared.multimodal import FeaturesError, MmItem, envelope_items

pytestmark = pytest.mark.unit

BLOCK = 16
PROMPT = list(range(1000, 1080))  # 5 blocks
CAT, DOG = "c" * 64, "d" * 64
# An image on tokens 20..43: it starts in block 1 and ends in block 2.
FEATURES: dict[str, Any] = {
    "mm_hashes": {"image": [CAT]},
    "mm_placeholders": {"image": [{"offset": 20, "length": 24}]},
    "kwargs_data": {"image": ["YQ=="]},
}


def envelope(features: Any = FEATURES, salt: str | None = None, fmt: str = "vllm") -> Envelope:
    engine = {} if features is None else {"features": features}
    return Envelope(
        "e", TokenIds(PROMPT), format=fmt, engine=engine, routing=Routing(cache_salt=salt)
    )


def features(**changes: Any) -> dict[str, Any]:
    out = copy.deepcopy(FEATURES)
    out.update(changes)
    return out


def test_vllms_own_extra_keys_cases() -> None:
    """vLLM's tests/v1/core/test_kv_cache_utils.py `test_generate_block_hash_extra_keys`
    (20 tokens; items at 0..4 and 10..14), on the blocks an engine hashes."""
    items = [MmItem("hash1", 0, 5), MmItem("hash2", 10, 5)]
    # Blocks of 5: each item in a block of its own, the blocks between without keys.
    assert mm_block_keys(items, 5, 4) == [[("hash1", 0)], [], [("hash2", 0)], []]
    # Blocks of 15: both items in the first block, in prompt order, with their offsets.
    assert mm_block_keys(items, 15, 1) == [[("hash1", 0), ("hash2", 10)]]
    # Partial overlap: an item from 3 to 7 in blocks of 5 began 2 tokens before block 1.
    assert mm_block_keys([MmItem("hash1", 3, 5)], 5, 2) == [[("hash1", 3)], [("hash1", -2)]]
    assert mm_block_keys([], 5, 4) == [[], [], [], []]  # vLLM's `_no_mm_inputs` case


def test_the_blocks_an_image_touches_carry_its_hash_and_offset_then_the_salt() -> None:
    assert request_extra_keys(envelope(), BLOCK) == [
        None,
        ((CAT, 4),),  # starts 4 tokens into block 1
        ((CAT, -12),),  # began 12 tokens before block 2
        None,
        None,
    ]
    assert request_extra_keys(envelope(salt="s"), BLOCK) == [
        ("s",),
        ((CAT, 4),),
        ((CAT, -12),),
        None,
        None,
    ]


def test_an_item_at_a_block_start_and_two_items_in_one_block() -> None:
    two = features(
        mm_hashes={"image": [CAT, DOG]},
        mm_placeholders={"image": [{"offset": 0, "length": 4}, {"offset": 8, "length": 4}]},
        kwargs_data={"image": ["YQ==", "Yg=="]},
    )
    assert request_extra_keys(envelope(two, salt="s"), BLOCK) == [
        ((CAT, 0), (DOG, 8), "s"),  # items first, then the salt: vLLM's order
        None,
        None,
        None,
        None,
    ]


def test_same_image_same_prefix_same_keys() -> None:
    first = request_block_keys(envelope(), BLOCK)
    again = request_block_keys(envelope(copy.deepcopy(FEATURES)), BLOCK)
    assert first == again
    assert len(first) == 5


def test_another_image_changes_the_keys_from_the_first_block_it_touches_on() -> None:
    text = request_block_keys(envelope(None), BLOCK)
    cat = request_block_keys(envelope(), BLOCK)
    dog = request_block_keys(envelope(features(mm_hashes={"image": [DOG]})), BLOCK)
    assert cat[0] == dog[0] == text[0]  # the text block before the image: as text alone
    for i in range(1, 5):  # from block 1 on, every key differs (chained)
        assert len({cat[i], dog[i], text[i]}) == 3


def test_the_same_image_elsewhere_keys_its_blocks_apart() -> None:
    moved = features(mm_placeholders={"image": [{"offset": 21, "length": 24}]})
    here, there = request_block_keys(envelope(), BLOCK), request_block_keys(envelope(moved), BLOCK)
    assert here[0] == there[0]
    assert here[1] != there[1]


def test_layouts_vllm_accepts_key_as_vllm_keys_them() -> None:
    two = features(
        mm_hashes={"image": [CAT, DOG]},
        mm_placeholders={"image": [{"offset": 20, "length": 8}, {"offset": 50, "length": 8}]},
        kwargs_data={"image": ["YQ==", "Yg=="]},
    )
    base = request_block_keys(envelope(two), BLOCK)
    # Placeholders out of order: vLLM's engine sorts the items by offset.
    swapped = features(
        mm_hashes={"image": [DOG, CAT]},
        mm_placeholders={"image": [{"offset": 50, "length": 8}, {"offset": 20, "length": 8}]},
        kwargs_data={"image": ["Yg==", "YQ=="]},
    )
    assert request_block_keys(envelope(swapped), BLOCK) == base
    # No kwargs_data (items from the engine's cache): the hashes place them all the same.
    assert request_block_keys(envelope({**two, "kwargs_data": None}), BLOCK) == base
    # vLLM's block hashing keys an item by its hash whatever its modality.
    audio = {
        "mm_hashes": {"audio": [CAT], "image": [DOG]},
        "mm_placeholders": {
            "audio": [{"offset": 20, "length": 8}],
            "image": [{"offset": 50, "length": 8}],
        },
    }
    assert request_block_keys(envelope(audio), BLOCK) == base


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        (
            {"mm_placeholders": {"image": [{"offset": 20, "length": 24},
                                           {"offset": 30, "length": 4}]},
             "mm_hashes": {"image": [CAT, DOG]}, "kwargs_data": {"image": ["YQ==", "Yg=="]}},
            "mm_placeholders must be globally non-overlapping and sorted",
        ),
        (
            {"mm_hashes": {"image": [CAT, DOG]}, "kwargs_data": {"image": ["YQ==", "Yg=="]}},
            "image mm_hashes and mm_placeholders must have the same length",
        ),
        (
            {"kwargs_data": {"image": ["YQ==", "Yg=="]}},
            "image kwargs_data and mm_hashes must have the same length",
        ),
        (
            {"mm_hashes": {"video": [CAT]}, "kwargs_data": {"video": ["YQ=="]}},
            "mm_hashes and mm_placeholders must use the same modalities",
        ),
        (
            {"mm_placeholders": {"image": [{"offset": 70, "length": 11}]}},
            "mm_placeholders must remain within the token_ids sequence",
        ),
        (
            {"mm_placeholders": {"image": [{"offset": 20, "length": 0}]}},
            "features.mm_placeholders.image[0]: expected "
            "{offset: integer >= 0, length: integer > 0}",
        ),
        (
            {"mm_hashes": {"image": [7]}},
            "features.mm_hashes: expected a map of lists of strings",
        ),
    ],
)  # fmt: skip
def test_features_vllm_refuses_leave_the_text_only_keys(
    changes: dict[str, Any], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    bad = envelope(features(**changes), salt="s")
    with pytest.raises(FeaturesError) as info:
        envelope_items(bad)
    assert str(info.value) == reason
    with caplog.at_level(logging.WARNING, logger="genmesh.shared.kv_events"):
        keys = request_block_keys(bad, BLOCK)
    assert keys == request_block_keys(envelope(None, salt="s"), BLOCK)
    assert f"request e: routed on its tokens alone: {reason}" in caplog.text


def test_the_fallback_cases_differ_from_a_valid_layout_only_in_their_fault() -> None:
    """Each case above changes `FEATURES` in one respect: `FEATURES` itself is valid."""
    assert envelope_items(envelope()) == [MmItem(CAT, 20, 24)]


def test_features_mean_nothing_outside_a_vllm_envelope() -> None:
    assert envelope_items(envelope(fmt="sglang")) == []
    assert request_extra_keys(envelope(fmt="sglang"), BLOCK) is None
    with pytest.raises(FeaturesError, match="features: expected a map"):
        envelope_items(envelope("not features"))


def test_an_engine_caching_prompt_and_output_keys_the_block_the_output_completes() -> None:
    # 84 prompt tokens, an image on the last 8: block 5 (80..95) is full once 12 output
    # tokens are cached, and holds the image's last 4 tokens.
    tail = features(mm_placeholders={"image": [{"offset": 76, "length": 8}]})
    env = Envelope("e", TokenIds(range(84)), format="vllm", engine={"features": tail})
    assert request_extra_keys(env, BLOCK) == [None, None, None, None, ((CAT, 12),)]
    with_output = request_extra_keys(env, BLOCK, length=96)
    assert with_output == [None, None, None, None, ((CAT, 12),), ((CAT, -4),)]


@pytest.mark.parametrize("array_like", [True, False])
def test_stored_events_with_these_extra_keys_give_the_requests_keys(array_like: bool) -> None:
    """An engine reporting the blocks of the request (as newer vLLM does, `extra_keys` per
    block), its batch on the engine's wire, then genmesh's on the bus: the router's keys of
    the stored blocks are the request's."""
    env = envelope(salt="s")
    extra = request_extra_keys(env, BLOCK)
    assert extra is not None
    stored = BlockStored(list(range(5)), None, TokenIds(PROMPT), BLOCK, extra_keys=extra)
    batch = decode_engine_batch(encode_engine_batch(KvEventBatch(1.0, [stored]), array_like=False))
    codec = get_codec("msgpack")
    message = KvEventsMessage("w", 1, 1.0, batch.events)
    received = KvEventsMessage.from_wire(codec.decode(codec.encode(message.to_wire())))
    event = received.events[0]
    assert isinstance(event, BlockStored)
    assert stored_keys(event) == request_block_keys(env, BLOCK)
    assert stored_keys(event) != block_keys(TokenIds(PROMPT), BLOCK, [("s",)])
    if array_like:  # SGLang's and older vLLM's form has no extra keys: text-only keys
        plain = decode_engine_batch(encode_engine_batch(KvEventBatch(1.0, [stored])))
        assert isinstance(plain.events[0], BlockStored)
        assert plain.events[0].extra_keys is None


def vllm_gen_mm_extra_hash_keys(
    items: list[MmItem], start: int, end: int, first: int
) -> tuple[list[tuple[str, int]], int]:
    """vLLM's `_gen_mm_extra_hash_keys` (vllm/v1/core/kv_cache_utils.py), transcribed as
    the reference: one block at a time, from the item the previous block stopped at."""
    keys: list[tuple[str, int]] = []
    if not items or items[-1].offset + items[-1].length <= start:
        return keys, first
    i = first
    while i < len(items):
        item = items[i]
        if end > item.offset:
            if start >= item.offset + item.length:
                i += 1
                continue
            keys.append((item.identifier, item.offset - start))
            if end >= item.offset + item.length:
                i += 1
            else:
                break
        else:
            break
    return keys, i


@given(
    gaps=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 40)), max_size=6),
    block_size=st.integers(1, 32),
    tail=st.integers(0, 40),
)
def test_keys_per_item_equal_vllms_walk_per_block(
    gaps: list[tuple[int, int]], block_size: int, tail: int
) -> None:
    items, at = [], 0
    for n, (gap, length) in enumerate(gaps):
        items.append(MmItem(f"h{n}", at + gap, length))
        at += gap + length
    blocks = (at + tail) // block_size
    expected, first = [], 0
    for b in range(blocks):
        keys, first = vllm_gen_mm_extra_hash_keys(
            items, b * block_size, (b + 1) * block_size, first
        )
        expected.append(keys)
    assert mm_block_keys(items, block_size, blocks) == expected

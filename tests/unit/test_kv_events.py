"""The KV event model (shared/kv_events.py): both engine encodings, genmesh's NATS form,
the snapshot page and the router's block keys."""

from __future__ import annotations

import msgpack
import pytest

from genmesh.shared.envelope import TokenIds
from genmesh.shared.kv_events import (
    ROOT_SEED,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    KvEventError,
    KvEventsMessage,
    KvSnapshotPage,
    block_keys,
    decode_engine_batch,
    encode_engine_batch,
    stored_keys,
)

pytestmark = pytest.mark.unit

STORED = BlockStored([11, 12], None, TokenIds(range(32)), 16)
BATCH = KvEventBatch(1.5, [STORED, BlockRemoved([11]), AllBlocksCleared()])


@pytest.mark.parametrize("array_like", [True, False])
def test_engine_batches_round_trip_in_both_encodings(array_like: bool) -> None:
    assert decode_engine_batch(encode_engine_batch(BATCH, array_like=array_like)) == BATCH


def test_sglang_array_form_is_read_as_sglang_writes_it() -> None:
    # sglang/srt/disaggregation/kv_events.py: array_like structs, tag first, BlockStored
    # ending at lora_id and BlockRemoved at its hashes.
    payload = msgpack.packb(
        [2.0, [["BlockStored", [1], 7, list(range(4)), 4, None], ["BlockRemoved", [1]]]]
    )
    batch = decode_engine_batch(payload)
    assert batch.events == [BlockStored([1], 7, TokenIds(range(4)), 4), BlockRemoved([1])]


def test_newer_vllm_map_form_with_bytes_hashes_and_extra_keys() -> None:
    # vllm/distributed/kv_events.py (sha256 block hashes are bytes; extra_keys per block).
    h = b"\x01" * 32
    payload = msgpack.packb(
        {
            "ts": 3.0,
            "events": [
                {
                    "type": "BlockStored",
                    "block_hashes": [h],
                    "parent_block_hash": None,
                    "token_ids": [5, 6],
                    "block_size": 2,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "extra_keys": [["img-1"]],
                    "group_idx": 0,
                }
            ],
            "data_parallel_rank": 0,
        },
        use_bin_type=True,
    )
    (event,) = decode_engine_batch(payload).events
    assert isinstance(event, BlockStored)
    assert event.block_hashes == [h]
    assert event.extra_keys == [("img-1",)]
    assert event.medium == "GPU"


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\xc1", "not msgpack"),
        (msgpack.packb(5), "an array or a map"),
        (msgpack.packb([1.0, [["BlockMoved"]]]), "unknown KV cache event 'BlockMoved'"),
        (msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2, 3], 2, None]]]), "3 token ids"),
        (msgpack.packb([1.0, [["BlockRemoved", [1.5]]]]), "integer or bytes"),
        (msgpack.packb([1.0, [["BlockRemoved", [1, True]]]]), "integer or bytes, got True"),
    ],
)
def test_bad_engine_batches_say_why(payload: bytes, reason: str) -> None:
    with pytest.raises(KvEventError, match=reason):
        decode_engine_batch(payload)


def test_nats_message_round_trips_through_msgpack() -> None:
    message = KvEventsMessage("w1", 3, 1.5, BATCH.events)
    wire = msgpack.unpackb(msgpack.packb(message.to_wire(), use_bin_type=True))
    assert wire["events"][0]["tokens"] == TokenIds(range(32)).tobytes()
    assert KvEventsMessage.from_wire(wire) == message


def test_nats_message_refuses_a_seq_below_one() -> None:
    with pytest.raises(KvEventError, match="seq"):
        KvEventsMessage.from_wire({"worker": "w", "seq": 0, "ts": 1.0, "events": []})


def test_snapshot_page_round_trips_and_holds_only_stored_events() -> None:
    page = KvSnapshotPage("w1", "s1", 9, 0, 1, [STORED])
    assert KvSnapshotPage.from_wire(page.to_wire()) == page
    bad = page.to_wire() | {"events": [{"type": "cleared"}]}
    with pytest.raises(KvEventError, match="only stored"):
        KvSnapshotPage.from_wire(bad)


def test_block_keys_chain_over_the_whole_prefix() -> None:
    a = block_keys(TokenIds([1] * 16 + [2] * 16 + [3] * 5), 16)
    b = block_keys(TokenIds([9] * 16 + [2] * 16), 16)
    assert len(a) == 2  # the partial block has no key
    assert a[1] != b[1]  # same block, different prefix
    assert block_keys(TokenIds([1] * 16 + [2] * 16), 16) == a


def test_extra_keys_change_a_block_key_and_only_from_that_block() -> None:
    tokens = TokenIds(range(48))
    plain = block_keys(tokens, 16)
    image = block_keys(tokens, 16, [None, ("img-1",), None])
    assert image[0] == plain[0]
    assert image[1] != plain[1]
    assert image[2] != plain[2]
    assert block_keys(tokens, 16, [None, ("img-2",), None])[1] != image[1]


def test_stored_keys_continue_from_the_parent_key() -> None:
    tokens = TokenIds(range(32))
    whole = block_keys(tokens, 16)
    assert stored_keys(BlockStored([1], None, TokenIds(range(16)), 16)) == whole[:1]
    assert stored_keys(BlockStored([2], 1, TokenIds(range(16, 32)), 16), whole[0]) == whole[1:]
    assert block_keys(tokens, 16, parent=ROOT_SEED) == whole


def test_a_cache_salt_keys_every_block_apart_from_the_first_on() -> None:
    from genmesh.shared.envelope import Envelope, Routing
    from genmesh.shared.kv_events import request_block_keys

    tokens = list(range(40))
    plain = request_block_keys(Envelope("a", TokenIds(tokens)), 16)
    salted = request_block_keys(
        Envelope("b", TokenIds(tokens), routing=Routing(cache_salt="s")), 16
    )
    assert plain == block_keys(TokenIds(tokens), 16)
    assert len(salted) == 2
    assert salted[0] != plain[0]
    assert salted[1] != plain[1]  # chained: the salt reaches every later block
    assert salted == block_keys(TokenIds(tokens), 16, [("s",)])


def test_vllm_positional_form_goes_on_past_lora_id_as_vllm_0_20_sends_it() -> None:
    # vllm/distributed/kv_events.py before #42892: array_like structs with omit_defaults,
    # so medium and lora_name (no defaults) always follow lora_id, then extra_keys.
    stored = BlockStored([11, 12], 10, TokenIds(range(8)), 4, medium="GPU")
    batch = KvEventBatch(2.5, [stored, BlockRemoved([11], "GPU")], 0)
    raw = msgpack.unpackb(encode_engine_batch(batch, array_like=True, vllm=True))
    assert raw == [
        2.5,
        [
            ["BlockStored", [11, 12], 10, list(range(8)), 4, None, "GPU", None, [None, None]],
            ["BlockRemoved", [11], "GPU"],
        ],
        0,
    ]
    decoded = decode_engine_batch(encode_engine_batch(batch, array_like=True, vllm=True))
    assert decoded.events[0] == BlockStored(
        [11, 12], 10, TokenIds(range(8)), 4, extra_keys=[None, None], medium="GPU"
    )


def test_map_form_keeps_the_batch_itself_positional() -> None:
    # vLLM #42892 made the events maps; EventBatch stays array_like.
    raw = msgpack.unpackb(
        encode_engine_batch(KvEventBatch(1.0, [AllBlocksCleared()], 0), array_like=False)
    )
    assert raw == [1.0, [{"type": "AllBlocksCleared"}], 0]

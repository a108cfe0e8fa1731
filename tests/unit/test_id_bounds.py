"""Bounds on what a sender can make a worker hold: ID lengths, the tombstone store, and
frames the NATS server would refuse (issue 15, items 1 and 2; docs/limits.md)."""

from __future__ import annotations

import gc
import sys
import time
from typing import Any

import pytest
from nats.errors import MaxPayloadError

from genmesh.codecs import get_codec
from genmesh.services.worker.tombstones import TOMBSTONE_MAX_BYTES, Tombstones
from genmesh.shared.bus import PayloadTooLarge, check_fits
from genmesh.shared.envelope import Envelope, EnvelopeError, peek_id
from genmesh.shared.ids import MAX_CLIENT_ID_BYTES, MAX_ID_BYTES, id_problem

pytestmark = pytest.mark.unit


def wire(**fields: Any) -> dict[str, Any]:
    return {"v": 1, "id": "r1", "token_ids": [1, 2]} | fields


# ---------------------------------------------------------------- ID lengths


def test_ids_up_to_the_bound_are_taken() -> None:
    longest = "x" * MAX_ID_BYTES
    assert id_problem(longest, MAX_ID_BYTES) is None
    assert Envelope.from_wire(wire(id=longest)).id == longest
    # Bytes, not characters: 128 two-byte characters are 256 bytes.
    assert Envelope.from_wire(wire(id="é" * 128)).id == "é" * 128


@pytest.mark.parametrize(
    ("request_id", "message"),
    [
        ("x" * (MAX_ID_BYTES + 1), "id: at most 256 bytes, got 257 characters"),
        ("é" * 129, "id: at most 256 bytes, got 258"),
        ("x" * 1_000_000, "id: at most 256 bytes, got 1000000 characters"),
        ("a\ud800b", "id: must be valid Unicode (it holds a lone surrogate)"),
    ],
)
def test_a_bad_envelope_id_is_refused_without_echoing_it(request_id: str, message: str) -> None:
    with pytest.raises(EnvelopeError) as refused:
        Envelope.from_wire(wire(id=request_id))
    assert str(refused.value) == message
    # The refusal's `err` frame carries `id: null`, not an ID that cannot be sent back.
    assert peek_id(wire(id=request_id)) is None


def test_client_ids_have_their_own_larger_bound() -> None:
    longest = "c" * MAX_CLIENT_ID_BYTES
    assert Envelope.from_wire(wire(client_id=longest)).client_id == longest
    with pytest.raises(EnvelopeError) as refused:
        Envelope.from_wire(wire(client_id=longest + "c"))
    assert str(refused.value) == "client_id: at most 1024 bytes, got 1025 characters"


def test_a_prefill_stage_parent_is_an_id_too() -> None:
    disagg = {"stage": "prefill", "parent": "p" * (MAX_ID_BYTES + 1)}
    with pytest.raises(EnvelopeError) as refused:
        Envelope.from_wire(wire(disagg=disagg))
    assert str(refused.value) == "disagg.parent: at most 256 bytes, got 257 characters"


def test_refusals_do_not_echo_long_values() -> None:
    """A refusal's message names the field, and at most 40 characters of the value."""
    with pytest.raises(EnvelopeError) as refused:
        Envelope.from_wire(wire(v="9" * 100_000))
    assert len(str(refused.value)) < 100
    with pytest.raises(EnvelopeError) as refused:
        Envelope.from_wire(wire(disagg={"stage": "s" * 100_000, "parent": "p"}))
    assert len(str(refused.value)) < 100


# ---------------------------------------------------------------- tombstones


def test_tombstones_are_bounded_by_count() -> None:
    store = Tombstones(max_count=3)
    for rid in ("a", "b", "c", "d"):
        store.add(rid)
    assert "a" not in store  # the oldest went first
    assert [rid in store for rid in ("b", "c", "d")] == [True, True, True]
    assert len(store) == 3
    assert store.bytes == 3


def test_tombstones_are_bounded_by_bytes() -> None:
    store = Tombstones(max_bytes=1000)
    for i in range(10):
        store.add(f"{i}" * 256)
    assert len(store) == 3  # 3 x 256 <= 1000 < 4 x 256
    assert store.bytes == 768
    assert "9" * 256 in store
    assert "6" * 256 not in store


def test_the_default_byte_bound_holds_for_the_longest_ids() -> None:
    store = Tombstones()
    for i in range(20_000):
        store.add(f"{i:0256d}")
    assert store.bytes <= TOMBSTONE_MAX_BYTES
    assert len(store) == TOMBSTONE_MAX_BYTES // MAX_ID_BYTES


def test_a_repeated_cancel_is_counted_once() -> None:
    store = Tombstones()
    store.add("abc")
    store.add("abc")
    assert (len(store), store.bytes) == (1, 3)


def test_tombstones_expire_and_give_their_memory_back() -> None:
    store = Tombstones(ttl_s=0.05)
    for i in range(50_000):
        store.add(f"{i:032x}")
    full = sys.getsizeof(store._ids)
    time.sleep(0.06)
    store.prune()
    gc.collect()
    assert (len(store), store.bytes) == (0, 0)
    # The table a burst grew is gone with it (a dict never shrinks by deletions).
    assert sys.getsizeof(store._ids) < full / 100


# ---------------------------------------------------------------- what the server takes


def test_headers_count_against_the_max_payload() -> None:
    headers = {"genmesh-codec": "json"}
    wire_headers = b"NATS/1.0\r\ngenmesh-codec: json\r\n\r\n"
    limit = 1000
    check_fits(limit, b"x" * (limit - len(wire_headers)), headers)
    with pytest.raises(PayloadTooLarge) as refused:
        check_fits(limit, b"x" * (limit - len(wire_headers) + 1), headers)
    assert str(refused.value) == "a message of 1001 bytes exceeds the server's max_payload of 1000"
    assert isinstance(refused.value, MaxPayloadError)  # what nats-py raises for the payload
    check_fits(limit, b"x" * limit, None)


def test_the_largest_ack_is_a_few_hundred_bytes() -> None:
    """With IDs bounded, the largest `ack` is a few hundred bytes: far below any
    max_payload a mesh runs with (the default is 1 MiB)."""
    ack = {"t": "ack", "id": "x" * MAX_ID_BYTES, "seq": 2**31, "worker": "w" * 64}
    ack["dispatch"] = "d" * 32
    for name in ("msgpack", "json"):
        assert len(get_codec(name).encode(ack)) < 512

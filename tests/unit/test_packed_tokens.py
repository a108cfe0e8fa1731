"""The packed prompt: `TokenIds` in memory, one bin of little-endian int32 on msgpack."""

from __future__ import annotations

import copy
import functools
import json
import struct
from array import array
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel, Field, ValidationError, field_validator

from genmesh.client import request
from genmesh.codecs import CodecError, get_codec
from genmesh.codecs import int32 as packing
from genmesh.engines.mock import advance, advance_all, initial_state
from genmesh.formats.base import RequestRejected
from genmesh.formats.sglang import request as sglang_request
from genmesh.formats.vllm import VllmFormat
from genmesh.formats.vllm.schema import GenerateRequest
from genmesh.records.hashing import int32le
from genmesh.shared.envelope import MAX_TOKEN_ID, Envelope, EnvelopeError, TokenIds

pytestmark = pytest.mark.unit

token_ids = st.lists(st.integers(min_value=0, max_value=MAX_TOKEN_ID), min_size=1, max_size=64)


def wire(token_ids: Any) -> dict[str, Any]:
    return {"v": 1, "id": "r", "token_ids": token_ids}


def refusal(token_ids: Any) -> str:
    with pytest.raises(EnvelopeError) as err:
        Envelope.from_wire(wire(token_ids))
    return str(err.value)


@given(token_ids)
def test_msgpack_carries_the_prompt_as_one_little_endian_bin(ids: list[int]) -> None:
    codec = get_codec("msgpack")
    data = codec.encode(request(ids).to_wire())
    raw = msgpack.unpackb(data)["token_ids"]
    assert raw == struct.pack(f"<{len(ids)}i", *ids)
    back = Envelope.from_wire(codec.decode(data))
    assert isinstance(back.token_ids, TokenIds)
    assert back.token_ids == ids


@given(token_ids)
def test_json_carries_the_prompt_as_a_list(ids: list[int]) -> None:
    codec = get_codec("json")
    data = codec.encode(request(ids).to_wire())
    decoded = codec.decode(data)
    assert decoded["token_ids"] == ids
    assert Envelope.from_wire(decoded).token_ids == ids


@pytest.mark.parametrize("codec", ["msgpack", "json"])
def test_a_list_is_still_accepted(codec: str) -> None:
    c = get_codec(codec)
    env = Envelope.from_wire(c.decode(c.encode(wire([3, 1, 4]))))
    assert isinstance(env.token_ids, TokenIds)
    assert env.token_ids == [3, 1, 4]


def test_bad_bins_are_refused_in_the_style_of_bad_lists() -> None:
    assert refusal(b"\x01\x00\x00") == (
        "token_ids: a bin of little-endian int32 must be a multiple of 4 bytes long, got 3 bytes"
    )
    assert refusal(struct.pack("<3i", 5, -7, 9)) == (
        "token_ids[1]: expected a token id in [0, 2^31), got -7"
    )
    assert refusal(struct.pack("<i", -(2**31))) == (
        "token_ids[0]: expected a token id in [0, 2^31), got -2147483648"
    )
    assert refusal(b"") == "token_ids: must not be empty"
    # The list form keeps its words.
    assert refusal([1, -4]) == "token_ids[1]: expected a token id in [0, 2^31), got -4"
    assert refusal([1, True]) == "token_ids[1]: expected a token id in [0, 2^31), got True"
    assert refusal("1 2") == "token_ids: expected a list of token ids, got str"


def test_the_largest_token_id_crosses_as_a_bin() -> None:
    env = Envelope.from_wire(wire(struct.pack("<2i", 0, MAX_TOKEN_ID)))
    assert env.token_ids == [0, MAX_TOKEN_ID]


def test_token_ids_behave_as_the_list_they_replace() -> None:
    ids = TokenIds([1, 2, 3])
    assert ids == [1, 2, 3]
    assert ids != [1, 2]
    assert ids == array("i", [1, 2, 3])
    # (what migration does: the prompt plus the delivered tokens)
    joined, prefixed = ids + [4], [0] + ids  # noqa: RUF005
    assert joined == [1, 2, 3, 4]
    assert isinstance(joined, TokenIds)
    assert prefixed == [0, 1, 2, 3]
    assert ids == TokenIds([1, 2, 3])
    assert isinstance(copy.deepcopy(Envelope(id="r", token_ids=ids)).token_ids, TokenIds)
    assert isinstance(copy.copy(ids), TokenIds)
    # Built from a list (formats of other packages, tests), an envelope holds TokenIds.
    assert isinstance(Envelope(id="r", token_ids=[5, 6]).token_ids, TokenIds)  # type: ignore[arg-type]


def test_mesh_client_requests_take_any_sequence_and_check_it() -> None:
    assert request(range(3)).token_ids == [0, 1, 2]
    assert request((7, 8)).token_ids == [7, 8]
    with pytest.raises(EnvelopeError, match=r"token_ids\[1\]: expected a token id"):
        request([1, -2])


def test_the_msgpack_codec_packs_token_arrays_only() -> None:
    with pytest.raises(CodecError, match="can not serialize 'array' object"):
        get_codec("msgpack").encode({"x": array("q", [1])})
    with pytest.raises(CodecError, match="not JSON serializable"):
        get_codec("json").encode({"x": array("q", [1])})


def test_a_big_endian_host_swaps_on_the_way_in_and_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Faked on this host: with `big_endian` set, the native bytes are swapped both ways."""
    ids = TokenIds([1, 0x01020304])
    native = ids.tobytes()
    assert packing.to_le_bytes(ids) == native  # this host is little-endian
    monkeypatch.setattr(packing, "big_endian", True)
    swapped = packing.to_le_bytes(ids)
    assert swapped == b"\x00\x00\x00\x01\x01\x02\x03\x04"
    assert ids.tobytes() == native  # the array itself is left alone
    assert packing.from_le_bytes(swapped, TokenIds()) == [1, 0x01020304]
    # The top bytes are then the first of every four.
    assert packing.first_high(TokenIds([0x80, 0])) == 0


@given(st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=40))
def test_first_high(ids: list[int]) -> None:
    expected = next((i for i, t in enumerate(ids) if t > MAX_TOKEN_ID), None)
    assert packing.first_high(TokenIds(ids)) == expected


@pytest.mark.parametrize("limit", [1, 2, 255, 256, 257, 1000, 65536, 151_936, 2**24 + 5, 2**31 - 1])
def test_all_below_is_exact_at_the_boundary(limit: int) -> None:
    assert packing.all_below(TokenIds(), limit)
    assert packing.all_below(TokenIds([0, limit - 1]), limit)
    assert not packing.all_below(TokenIds([0, limit]), limit)
    assert not packing.all_below(TokenIds([limit - 1, MAX_TOKEN_ID]), limit)


@given(token_ids, st.integers(min_value=1, max_value=MAX_TOKEN_ID))
def test_all_below(ids: list[int], limit: int) -> None:
    assert packing.all_below(TokenIds(ids), limit) == (max(ids) < limit)


@given(token_ids, st.integers(min_value=0, max_value=2**64 - 1))
def test_the_mock_state_over_the_bytes_is_the_state_token_by_token(
    ids: list[int], seed: int
) -> None:
    start = initial_state(seed)
    assert advance_all(start, TokenIds(ids)) == functools.reduce(advance, ids, start)


def test_records_hash_the_array_bytes_as_they_hashed_a_list() -> None:
    assert int32le(TokenIds([1, 256])) == int32le([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"


# ---------------------------------------------------------------- the formats pack once


def sglang_bind(body: dict[str, Any]) -> Any:
    return sglang_request.bind(sglang_request.parse(json.dumps(body).encode()), {})


def sglang_refusal(body: dict[str, Any]) -> str:
    with pytest.raises(RequestRejected) as info:
        sglang_bind(body)
    return str(info.value.body)


def test_sglang_prompts_are_token_ids_shared_by_their_samples() -> None:
    bound = sglang_bind({"input_ids": [[1, True], [3]], "sampling_params": {"n": 2}})
    prompts = [env.token_ids for env in bound.items]
    assert all(isinstance(p, TokenIds) for p in prompts)
    assert prompts == [[1, 1], [1, 1], [3], [3]]
    assert prompts[0] is prompts[1]  # one array per prompt, not per sample


def test_sglang_names_the_first_bad_token_beyond_int32() -> None:
    # int64 is what the schema takes; the first id outside [0, 2^31) is named.
    assert "input_ids[1]: token id 1099511627776 is out of range" in sglang_refusal(
        {"input_ids": [1, 2**40, -1]}
    )
    assert "input_ids[1]: token id -1099511627776 is out of range" in sglang_refusal(
        {"input_ids": [5, -(2**40)]}
    )
    assert "input_ids[0][2]: token id -3 is out of range" in sglang_refusal(
        {"input_ids": [[0, 2**31 - 1, -3]]}
    )
    assert "contains non-int64 element" in sglang_refusal({"input_ids": [1, 2**63]})


def test_vllm_prompts_are_token_ids() -> None:
    fmt = VllmFormat()
    body = {"token_ids": [4, 5, 6], "sampling_params": {"n": 2}}
    bound = fmt.bind(fmt.parse(json.dumps(body).encode()), {"content-type": "application/json"})
    assert all(isinstance(env.token_ids, TokenIds) for env in bound.items)
    assert bound.items[0].token_ids == [4, 5, 6]


class VllmDeclaration(BaseModel):
    """`token_ids` exactly as vLLM declares it: what the fast path must agree with."""

    token_ids: list[int] = Field(min_length=1)

    @field_validator("token_ids")
    @classmethod
    def validate_token_ids(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("token_ids must not contain negative values")
        return v


def vllm_outcome(model: type[BaseModel], token_ids: Any) -> Any:
    """The validated ids as a list, or the errors pydantic reports (without the exception
    objects in their context, which compare by identity)."""
    try:
        validated = model.model_validate({"token_ids": token_ids, "sampling_params": {}})
    except ValidationError as exc:
        return exc.errors(include_url=False, include_context=False)
    value = validated.token_ids  # type: ignore[attr-defined]
    return ("ok", list(value), type(value) is TokenIds)


VLLM_EDGES = [
    [1, 2, 3],
    [0, MAX_TOKEN_ID],
    [True, False, 5],  # booleans are 1 and 0, in pydantic's lax mode and in the array
    [1.0, 2],  # integral floats: pydantic's
    [1, 2.5],
    ["3", 4],
    [2**31],  # a token id no more, but an int: the format refuses it after the schema
    [2**32],
    [2**70],
    [-1],
    [3, -(2**40)],
    [[1, 2]],
    [1, None],
    [],
    None,
    "1,2",
    {"a": 1},
]


@pytest.mark.parametrize("ids", VLLM_EDGES, ids=repr)
def test_vllm_schema_agrees_with_vllms_declaration(ids: Any) -> None:
    fast = vllm_outcome(GenerateRequest, ids)
    reference = vllm_outcome(VllmDeclaration, ids)
    if isinstance(reference, tuple):
        assert fast[:2] == reference[:2]
    else:
        assert fast == reference


def test_vllm_packs_plain_token_ids_in_c_and_leaves_the_rest_to_pydantic() -> None:
    assert vllm_outcome(GenerateRequest, [1, True, MAX_TOKEN_ID])[2] is True
    for ids in ([1.0, 2], ["3"], [2**31], [2**40]):
        assert vllm_outcome(GenerateRequest, ids)[2] is False


@given(
    st.lists(
        st.one_of(
            st.integers(min_value=-3, max_value=2**33),
            st.booleans(),
            st.floats(allow_nan=False, allow_infinity=False, width=16),
            st.sampled_from(["7", "x", None]),
        ),
        max_size=6,
    )
)
def test_vllm_schema_agrees_with_vllms_declaration_on_mixed_lists(ids: list[Any]) -> None:
    fast = vllm_outcome(GenerateRequest, ids)
    reference = vllm_outcome(VllmDeclaration, ids)
    assert (fast[:2] if isinstance(fast, tuple) else fast) == (
        reference[:2] if isinstance(reference, tuple) else reference
    )


@pytest.mark.parametrize(
    ("ids", "packed"), [([True, 2], [1, 2]), ([1.0, 2], [1, 2]), (["3", 4], [3, 4])]
)
def test_vllm_binds_a_coerced_prompt_as_its_ints(ids: list[Any], packed: list[int]) -> None:
    fmt = VllmFormat()
    body = {"token_ids": ids, "sampling_params": {}}
    bound = fmt.bind(fmt.parse(json.dumps(body).encode()), {"content-type": "application/json"})
    assert isinstance(bound.items[0].token_ids, TokenIds)
    assert bound.items[0].token_ids == packed

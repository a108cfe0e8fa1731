"""The `b64zstd` client codec for the SGLang format: requests, records, joiner laws."""

from __future__ import annotations

import base64
import copy
import itertools
import struct
import time
from typing import Any

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from genmesh.formats.base import RequestRejected
from genmesh.formats.catalog import ConfigError, installed_client_codecs, load_generate_formats
from genmesh.formats.client_codec import ClientCodec, ClientCodecError, CodecFormat
from genmesh.formats.merge import fold
from genmesh.formats.sglang import SglangFormat
from genmesh.shared.envelope import TokenIds
from genmesh_b64zstd import B64ZstdClientCodec, decode_int32, encode_int32

pytestmark = pytest.mark.unit

codec = B64ZstdClientCodec()
int32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
token = st.integers(min_value=0, max_value=2**31 - 1)


def by_hand(values: list[int]) -> str:
    """base64(zstd(int32 LE)) made independently of the package."""
    raw = struct.pack(f"<{len(values)}i", *values)
    return base64.b64encode(zstandard.ZstdCompressor(level=3).compress(raw)).decode()


def experts_b64(values: list[int]) -> str:
    """What the SGLang format sends: Base64 of little-endian int32, no zstd."""
    return base64.b64encode(struct.pack(f"<{len(values)}i", *values)).decode()


def experts_of(text: str) -> list[int]:
    raw = zstandard.ZstdDecompressor().decompress(base64.b64decode(text, validate=True))
    return list(struct.unpack(f"<{len(raw) // 4}i", raw))


# ---------------------------------------------------------------- int32 arrays


@settings(max_examples=300, deadline=None)
@given(st.lists(int32, max_size=300))
def test_int32_round_trip_and_layout(values: list[int]) -> None:
    text = encode_int32(values)
    assert text.isascii()
    assert text == by_hand(values)
    frame = base64.b64decode(text, validate=True)
    assert zstandard.get_frame_parameters(frame).content_size == 4 * len(values)
    assert decode_int32(text) == values
    assert decode_int32(by_hand(values)) == values


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(int32, max_size=40), min_size=1, max_size=8))
def test_join_of_encodings_is_the_encoding_of_the_join(parts: list[list[int]]) -> None:
    joined = [v for part in parts for v in part]
    assert codec.join([encode_int32(p) for p in parts]) == encode_int32(joined)
    # and associativity, which is what folding relies on
    if len(parts) >= 2:
        left = codec.join([encode_int32(p) for p in parts[:-1]])
        assert codec.join([left, encode_int32(parts[-1])]) == encode_int32(joined)


def test_joiners_cover_both_fields() -> None:
    assert set(codec.joiners) == {"output_ids", "meta_info.routed_experts"}


# ---------------------------------------------------------------- requests


def test_input_ids_string_is_decoded() -> None:
    request = {"input_ids": encode_int32([1, 2, 3]), "sampling_params": {"max_new_tokens": 4}}
    original = copy.deepcopy(request)
    decoded = codec.decode_request(request)
    assert decoded == {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}
    assert request == original  # the caller's object is left alone


def test_batch_of_strings_and_mixed_batches() -> None:
    strings = {"input_ids": [encode_int32([1, 2]), encode_int32([3])]}
    assert codec.decode_request(strings)["input_ids"] == [[1, 2], [3]]
    mixed = {"input_ids": [encode_int32([1, 2]), [3, 4]]}
    assert codec.decode_request(mixed)["input_ids"] == [[1, 2], [3, 4]]


def test_token_ids_decode_packed_and_negatives_as_a_list() -> None:
    # Token ids come out as the packed prompt the format would have made of a list; a
    # negative int32 as the list of values, for the format to name it as it names a list's.
    top = 2**31 - 1
    assert type(codec.decode_request({"input_ids": encode_int32([0, 7, top])})["input_ids"]) is (
        TokenIds
    )
    batch = codec.decode_request({"input_ids": [encode_int32([1]), encode_int32([2, -3])]})
    assert [type(row) for row in batch["input_ids"]] == [TokenIds, list]
    assert batch["input_ids"] == [[1], [2, -3]]


@given(st.lists(int32, max_size=50))
def test_decoded_prompts_equal_the_values_encoded(values: list[int]) -> None:
    assert codec.decode_request({"input_ids": encode_int32(values)})["input_ids"] == values


def test_the_format_takes_the_decoded_array_as_it_is() -> None:
    fmt = wrapped()
    decoded = codec.decode_request({"input_ids": encode_int32([5, 6, 7])})["input_ids"]
    body = {"input_ids": encode_int32([5, 6, 7]), "sampling_params": {"n": 2}}
    prompts = [item.token_ids for item in fmt.bind(body, {}).items]
    assert all(type(p) is TokenIds for p in prompts)
    assert prompts == [decoded, decoded]
    assert prompts[0] is prompts[1]  # one array for the prompt, not a copy per sample


@pytest.mark.parametrize(
    "request_",
    [
        {"input_ids": [1, 2, 3]},
        {"input_ids": [[1, 2], [3]]},
        {"input_ids": [1, "2"]},  # a string among token IDs: the format's type error
        {"input_ids": ["AAAA", 5]},
        {"input_ids": []},
        {"input_ids": 5},
        {"text": "hi"},
        {},
        [1, 2],
        "a string body",
        None,
    ],
)
def test_plain_requests_pass_untouched(request_: Any) -> None:
    assert codec.decode_request(request_) is request_


@pytest.mark.parametrize(
    ("ids", "where", "why"),
    [
        ("not base64!", "input_ids", "not valid Base64"),
        ("AAEC", "input_ids", "not a zstd frame"),
        ("€", "input_ids", "not valid Base64"),
        (by_hand([1])[:-2], "input_ids", "not valid Base64"),
        (
            base64.b64encode(zstandard.ZstdCompressor().compress(b"\1\0\0")).decode(),
            "input_ids",
            "3 bytes is not a whole number of little-endian int32 values",
        ),
        ([encode_int32([1]), "nope!"], "input_ids[1]", "not valid Base64"),
        ([[1], [2], "AAAA"], "input_ids[2]", "not a zstd frame"),
    ],
)
def test_bad_input_ids_name_the_field(ids: Any, where: str, why: str) -> None:
    with pytest.raises(ClientCodecError) as info:
        codec.decode_request({"input_ids": ids})
    message = str(info.value)
    assert message.startswith(f"{where}: expected Base64 of zstd-compressed little-endian int32")
    assert why in message


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.text(max_size=80),
        st.binary(max_size=60).map(lambda b: base64.b64encode(b).decode()),
        st.binary(max_size=60).map(
            lambda b: base64.b64encode(zstandard.ZstdCompressor().compress(b)).decode()
        ),
    ),
    st.booleans(),
)
def test_any_string_decodes_or_raises_client_codec_error(text: str, batch: bool) -> None:
    ids: Any = [[1], text] if batch else text
    message = ""
    try:
        decoded = codec.decode_request({"input_ids": ids})
    except ClientCodecError as exc:  # anything else escapes and fails the test
        message = str(exc)
    if message:
        assert message.startswith("input_ids[1]: " if batch else "input_ids: ")
    else:
        values = decoded["input_ids"][1] if batch else decoded["input_ids"]
        assert all(-(2**31) <= v < 2**31 for v in values)


def test_a_zstd_bomb_in_input_ids_is_refused() -> None:
    bomb = base64.b64encode(zstandard.ZstdCompressor().compress(b"\0" * 5000)).decode()
    small = B64ZstdClientCodec(max_decoded_bytes=4096)
    with pytest.raises(ClientCodecError, match="more than the limit of 4096"):
        small.decode_request({"input_ids": bomb})


# ---------------------------------------------------------------- through the SGLang format


def wrapped() -> CodecFormat:
    return CodecFormat(SglangFormat(), codec)


def test_the_catalog_wraps_sglang() -> None:
    assert isinstance(installed_client_codecs()["b64zstd"], ClientCodec)
    # The /generate format comes first; other installed formats may follow on their paths.
    fmt = load_generate_formats("sglang+b64zstd", env={})[0]
    assert fmt.name == "sglang+b64zstd"
    assert {(r.method, r.path) for r in fmt.routes} >= {("POST", "/generate")}
    assert isinstance(fmt, CodecFormat)
    # The codec's joiners fold an encoded answer; a plain one folds as plain SGLang's.
    encoded = fmt.exchange(fmt.bind({"input_ids": encode_int32([1, 2])}, {}), "id", 0.0)
    assert encoded.joiners is not None
    assert encoded.joiners["output_ids"] == fmt.codec.joiners["output_ids"]
    assert encoded.joiners["meta_info.routed_experts"] == fmt.codec.joiners["output_ids"]
    plain = fmt.exchange(fmt.bind({"input_ids": [1, 2]}, {}), "id", 0.0)
    assert plain.joiners is None
    assert fmt.joiners is SglangFormat.joiners


def test_the_catalog_refuses_unknown_pairs() -> None:
    with pytest.raises(ConfigError, match=r"unknown client codec 'zip'.*b64zstd"):
        load_generate_formats("sglang+zip", env={})


def test_bind_decodes_before_the_format_validates() -> None:
    fmt = wrapped()
    body = {"input_ids": [encode_int32([5, 6, 7]), [8]], "sampling_params": {"max_new_tokens": 2}}
    bound = fmt.bind(fmt.parse(__import__("json").dumps(body).encode()), {})
    assert [item.token_ids for item in bound.items] == [[5, 6, 7], [8]]
    assert all(item.format == "sglang" for item in bound.items)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ("%%%", "b64zstd: input_ids: expected Base64 of zstd-compressed little-endian int32"),
        ([encode_int32([1]), "%%%"], "b64zstd: input_ids[1]: expected Base64"),
    ],
)
def test_bad_input_is_a_400_in_sglang_shape(ids: Any, message: str) -> None:
    with pytest.raises(RequestRejected) as info:
        wrapped().bind({"input_ids": ids}, {})
    assert info.value.status == 400
    assert set(info.value.body) == {"error"}
    assert info.value.body["error"]["message"].startswith(message)


def test_decoded_ids_are_still_validated_by_the_format() -> None:
    with pytest.raises(RequestRejected) as info:
        wrapped().bind({"input_ids": encode_int32([1, -5])}, {})
    assert "input_ids[1]: token id -5 is out of range" in info.value.message
    with pytest.raises(RequestRejected) as info:
        wrapped().bind({"input_ids": encode_int32([])}, {})
    assert "input_ids cannot be empty" in info.value.message


# ---------------------------------------------------------------- records


def test_encode_record_encodes_both_fields_and_nothing_else() -> None:
    record = {
        "output_ids": [10, 20, 2**31 - 1],
        "meta_info": {
            "id": "abc",
            "finish_reason": None,
            "routed_experts": experts_b64([1, 2, 3, 4]),
            "completion_tokens": 3,
        },
    }
    original = copy.deepcopy(record)
    out = codec.encode_record(record)
    assert record == original
    assert list(out) == list(record)
    assert list(out["meta_info"]) == list(record["meta_info"])
    assert out["output_ids"] == by_hand([10, 20, 2**31 - 1])
    assert experts_of(out["meta_info"]["routed_experts"]) == [1, 2, 3, 4]
    assert out["meta_info"]["routed_experts"] == by_hand([1, 2, 3, 4])
    rest = {k: v for k, v in out["meta_info"].items() if k != "routed_experts"}
    assert rest == {"id": "abc", "finish_reason": None, "completion_tokens": 3}


def test_encode_record_without_experts() -> None:
    out = codec.encode_record({"output_ids": [], "meta_info": {"id": "x"}})
    assert out == {"output_ids": by_hand([]), "meta_info": {"id": "x"}}


def frames_for(chunks: list[list[int]], rows_per_token: int, prompt_rows: int) -> list[Any]:
    """Reply frames of one generation: `out` for every chunk but the last, then `end`."""
    frames: list[Any] = [{"t": "ack", "id": "r", "seq": 0, "worker": "w", "dispatch": "d"}]
    for i, chunk in enumerate(chunks):
        frame: dict[str, Any] = {"t": "out", "id": "r", "seq": i + 1, "tokens": chunk}
        rows = [[t % 97 + k for k in range(rows_per_token)] for t in chunk]
        if i == 0:
            frame["cached_tokens"] = 0
            rows = [[p, p + 1][:rows_per_token] for p in range(prompt_rows)] + rows
        frame["routed_experts"] = rows
        frames.append(frame)
    frames[-1]["t"] = "end"
    frames[-1]["finish"] = {"reason": "length"}
    frames[-1]["usage"] = {}
    return frames


@st.composite
def streams(draw: st.DrawFn) -> tuple[list[list[int]], bool]:
    tokens = draw(st.lists(token, max_size=60))
    cuts = sorted(draw(st.lists(st.integers(0, len(tokens)), max_size=8)))
    bounds = [0, *cuts, len(tokens)]
    chunks = [tokens[a:b] for a, b in itertools.pairwise(bounds)]
    return chunks, draw(st.booleans())


@settings(max_examples=200, deadline=None)
@given(streams())
def test_folding_encoded_records_equals_encoding_the_fold(case: Any) -> None:
    chunks, experts = case
    inner = SglangFormat()
    fmt = wrapped()
    body: dict[str, Any] = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 100}}
    if experts:
        body["return_routed_experts"] = True
    bound = inner.bind(body, {})
    exchange = inner.exchange(bound, "public", time.monotonic())
    frames = frames_for(chunks, rows_per_token=2, prompt_rows=3)
    plain = [exchange.render(0, f) for f in frames if f["t"] in ("out", "end")]
    encoded = [codec.encode_record(r) for r in plain]

    plain_fold = fold(plain, inner.merge_rules, inner.joiners)
    # The joiners the frontend folds an encoded answer with: its exchange's.
    encoded_bound = fmt.bind({**body, "input_ids": encode_int32([1, 2, 3])}, {})
    joiners = fmt.exchange(encoded_bound, "public", time.monotonic()).joiners
    encoded_fold = fold(encoded, fmt.merge_rules, joiners)
    assert encoded_fold == codec.encode_record(plain_fold)
    assert list(encoded_fold) == list(plain_fold)

    tokens = [t for chunk in chunks for t in chunk]
    assert decode_int32(encoded_fold["output_ids"]) == tokens
    if experts:
        expected = experts_b64([v for f in frames[1:] for row in f["routed_experts"] for v in row])
        assert plain_fold["meta_info"]["routed_experts"] == expected
        assert encoded_fold["meta_info"]["routed_experts"] == by_hand(
            [v for f in frames[1:] for row in f["routed_experts"] for v in row]
        )
    else:
        assert "routed_experts" not in encoded_fold["meta_info"]


@pytest.mark.parametrize(
    ("ids", "encoded"),
    [
        (encode_int32([1]), True),
        ([encode_int32([1]), [2]], True),
        ([1], False),
        ([[1], [2]], False),
        ([1, "x"], True),  # refused by the format, which names the string
        (None, False),
    ],
)
def test_the_answer_mirrors_how_the_prompt_came(ids: Any, encoded: bool) -> None:
    assert codec.encodes_answer({"input_ids": ids}) is encoded


def test_a_plain_request_is_answered_by_sglangs_own_exchange() -> None:
    fmt = wrapped()
    bound = fmt.bind({"input_ids": [1, 2, 3], "return_routed_experts": True}, {})
    exchange = fmt.exchange(bound, "public", time.monotonic())
    frames = frames_for([[4, 5], [6]], rows_per_token=2, prompt_rows=3)
    records = [exchange.render(0, f) for f in frames if f["t"] in ("out", "end")]
    assert [r["output_ids"] for r in records] == [[4, 5], [6]]
    raw = base64.b64decode(records[1]["meta_info"]["routed_experts"], validate=True)
    assert struct.unpack("<2i", raw) == (6 % 97, 6 % 97 + 1)  # SGLang's Base64, not zstd


def test_the_wrapped_exchange_renders_encoded_records() -> None:
    fmt = wrapped()
    bound = fmt.bind({"input_ids": encode_int32([1, 2, 3]), "return_routed_experts": True}, {})
    exchange = fmt.exchange(bound, "public", time.monotonic())
    frames = frames_for([[4, 5], [6]], rows_per_token=2, prompt_rows=3)
    records = [exchange.render(0, f) for f in frames if f["t"] in ("out", "end")]
    assert [decode_int32(r["output_ids"]) for r in records] == [[4, 5], [6]]
    assert experts_of(records[1]["meta_info"]["routed_experts"]) == [6 % 97, 6 % 97 + 1]
    assert exchange.sse(0, records[0]) == [records[0]]

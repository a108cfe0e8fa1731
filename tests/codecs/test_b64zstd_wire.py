"""The `b64zstd` bus codec (package `codecs/b64zstd`): layout, round trips, garbage, bombs."""

from __future__ import annotations

import base64
import re
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import entry_points
from typing import Any

import msgpack
import pytest
import zstandard
from hypothesis import example, given, settings
from hypothesis import strategies as st

from genmesh.codecs import Codec, CodecError, available_codecs, get_codec
from genmesh.codecs.builtin import MsgpackCodec
from genmesh_b64zstd import B64ZstdCodec
from tests.equality import same

pytestmark = pytest.mark.unit

BASE64_TEXT = re.compile(rb"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?")
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
    | st.binary(max_size=64)
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(), inner, max_size=6),
    max_leaves=40,
)


def wire(obj: Any, **zstd_options: Any) -> bytes:
    """A b64zstd body made by hand, independently of the package."""
    packed = msgpack.packb(obj, use_bin_type=True)
    return base64.b64encode(zstandard.ZstdCompressor(**zstd_options).compress(packed))


codec = B64ZstdCodec()

# ---------------------------------------------------------------- layout and round trips


@settings(max_examples=300, deadline=None)
@given(values)
@example({"t": "out", "id": "x", "seq": 1, "tokens": [1, 2**31 - 1], "logprobs": [-0.0, 1e308]})
@example("")
def test_round_trip_and_layout(value: Any) -> None:
    data = codec.encode(value)
    assert isinstance(data, bytes)
    assert BASE64_TEXT.fullmatch(data), data  # ASCII Base64 text, padded, no line breaks
    frame = base64.b64decode(data, validate=True)
    assert frame.startswith(ZSTD_MAGIC)
    params = zstandard.get_frame_parameters(frame)
    packed = msgpack.packb(value, use_bin_type=True)
    assert params.content_size == len(packed)  # declared in the frame header
    assert not params.has_checksum
    assert params.dict_id == 0
    assert zstandard.ZstdDecompressor().decompress(frame) == packed  # exactly msgpack's bytes
    assert same(codec.decode(data), MsgpackCodec().decode(packed))
    # Encoding is deterministic (level 3, one frame): same object, same bytes.
    assert codec.encode(value) == data


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"level": 19},
        {"level": -5},
        {"write_checksum": True},
        {"write_content_size": False},
    ],
)
def test_decodes_frames_from_other_zstd_encoders(options: dict[str, Any]) -> None:
    obj = {"t": "out", "tokens": list(range(500)), "note": "é" * 100}
    assert codec.decode(wire(obj, **options)) == obj


def test_decodes_a_streamed_frame_without_content_size() -> None:
    packed = msgpack.packb({"tokens": list(range(100_000))}, use_bin_type=True)
    cobj = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    frame = cobj.compress(packed) + cobj.flush()
    assert zstandard.frame_content_size(frame) == -1
    assert codec.decode(base64.b64encode(frame)) == {"tokens": list(range(100_000))}


def test_whitespace_in_the_base64_is_ignored() -> None:
    """Line-wrapped Base64 (`base64` without -w0) still decodes."""
    data = codec.encode({"token_ids": list(range(200))})
    wrapped = b"\n".join(data[i : i + 76] for i in range(0, len(data), 76)) + b"\r\n"
    assert codec.decode(wrapped) == {"token_ids": list(range(200))}


def test_level_is_a_parameter() -> None:
    obj = {"tokens": list(range(1000))}
    fast, best = B64ZstdCodec(level=1), B64ZstdCodec(level=19)
    assert codec.decode(fast.encode(obj)) == codec.decode(best.encode(obj)) == obj
    assert len(best.encode(obj)) <= len(fast.encode(obj))


def test_what_msgpack_cannot_carry_is_a_codec_error() -> None:
    with pytest.raises(CodecError):
        codec.encode({"x": object()})
    with pytest.raises(CodecError):
        codec.encode(2**64)


# ---------------------------------------------------------------- garbage and bombs


def decode_outcome(data: bytes) -> str:
    try:
        codec.decode(data)
    except CodecError as exc:
        return f"error: {exc}"
    return "ok"


def zstd_of(payload: bytes) -> bytes:
    return base64.b64encode(zstandard.ZstdCompressor().compress(payload))


garbage = st.one_of(
    st.binary(max_size=200),  # anything at all
    st.binary(max_size=200).map(base64.b64encode),  # valid Base64 of garbage
    st.binary(max_size=200).map(lambda b: base64.b64encode(ZSTD_MAGIC + b)),  # zstd-ish
    st.binary(max_size=200).map(zstd_of),  # a valid frame of garbage msgpack
    st.binary(min_size=1, max_size=200).map(
        lambda b: base64.b64encode(zstandard.ZstdCompressor().compress(b"\x91\x01") + b)
    ),  # a valid frame, then trailing bytes
    st.text(max_size=100).map(lambda s: s.encode()),  # any UTF-8 text
)


@settings(max_examples=500, deadline=None)
@given(garbage)
@example(b"")
@example(b"====")
@example(b"KLUv/Q==")  # the zstd magic number alone
@example(b"\xff\xfe")
@example("KLUv/QBYAQAA é".encode())
def test_garbage_raises_codec_error_only(data: bytes) -> None:
    # Any other exception escapes and fails the test.
    decode_outcome(data)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "not a zstd frame"),
        (b"not base64!", "not valid Base64"),
        (b"KLUv/Q", "not valid Base64"),  # missing padding
        ("KLUv/Q€".encode(), "not valid Base64"),
        (base64.b64encode(b"hello world"), "not a zstd frame"),
        (zstd_of(b"\xc1"), "not valid msgpack"),  # 0xc1 is never used in msgpack
        (zstd_of(b"\x92\x01"), "not valid msgpack"),  # a truncated array
        (
            base64.b64encode(zstandard.ZstdCompressor().compress(b"\x01") * 2),
            "unused data",
        ),  # two frames
    ],
)
def test_garbage_messages(data: bytes, message: str) -> None:
    with pytest.raises(CodecError, match=message):
        codec.decode(data)


def test_truncated_frames_are_codec_errors() -> None:
    frame = base64.b64decode(codec.encode({"tokens": list(range(300))}))
    for cut in range(len(frame)):
        outcome = decode_outcome(base64.b64encode(frame[:cut]))
        assert outcome.startswith("error: "), cut


def test_bomb_with_declared_size_is_refused_before_allocating() -> None:
    small = B64ZstdCodec(max_decoded_bytes=1000)
    ok = msgpack.packb("a" * 900)
    assert small.decode(zstd_of(ok)) == "a" * 900
    with pytest.raises(CodecError, match="declares 1203 bytes, more than the limit of 1000"):
        small.decode(zstd_of(msgpack.packb("a" * 1200)))
    # A header that lies (claims 2**40 bytes) is refused from the header alone.
    header = bytearray(zstandard.ZstdCompressor().compress(b"x" * 300))
    liar = bytes(header[:4]) + b"\xe0" + struct.pack("<Q", 2**40) + bytes(header[6:])
    with pytest.raises(CodecError, match="more than the limit"):
        codec.decode(base64.b64encode(liar))


def test_bomb_without_declared_size_stops_at_the_limit() -> None:
    cobj = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    frame = cobj.compress(msgpack.packb(b"\0" * (70 * 1024 * 1024))) + cobj.flush()
    assert len(frame) < 10_000  # a 7,000:1 bomb
    with pytest.raises(CodecError, match="decompresses to more than 67108864 bytes"):
        codec.decode(base64.b64encode(frame))
    cobj = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    frame = cobj.compress(msgpack.packb("a" * 5000)) + cobj.flush()
    with pytest.raises(CodecError, match="more than 1000 bytes"):
        B64ZstdCodec(max_decoded_bytes=1000).decode(base64.b64encode(frame))


def test_a_frame_that_lies_about_an_empty_content_is_refused() -> None:
    empty = zstandard.ZstdCompressor().compress(b"")
    assert zstandard.frame_content_size(empty) == 0
    with pytest.raises(CodecError, match="declared size of 0"):
        codec.decode(base64.b64encode(empty + b"\x91\x01"))


# ---------------------------------------------------------------- registry and threads


def test_entry_points_are_installed() -> None:
    assert "b64zstd" in available_codecs()
    found = get_codec("b64zstd")
    assert isinstance(found, Codec)
    assert isinstance(found, B64ZstdCodec)
    assert found.name == "b64zstd"
    names = {ep.name: ep.value for ep in entry_points(group="genmesh.codecs")}
    assert names["b64zstd"] == "genmesh_b64zstd:B64ZstdCodec"
    clients = {ep.name: ep.value for ep in entry_points(group="genmesh.client_codecs")}
    assert clients["b64zstd"] == "genmesh_b64zstd:B64ZstdClientCodec"


def test_one_codec_is_safe_from_many_threads() -> None:
    shared = get_codec("b64zstd")
    barrier = threading.Barrier(8)

    def work(n: int) -> bool:
        barrier.wait()
        for i in range(200):
            obj = {"seq": i, "tokens": list(range(n, n + i))}
            if shared.decode(shared.encode(obj)) != obj:
                return False
        return True

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(work, range(8)))

"""Base64 and zstd primitives shared by the wire codec and the client codec.

zstd contexts are not thread-safe and are costly to create (each holds its own working
memory), so every thread (and so every event loop) keeps one compressor per level and one
decompressor, reused for every message.
"""

from __future__ import annotations

import base64
import binascii
import sys
import threading
from array import array

import zstandard

DEFAULT_LEVEL = 3
# The largest decompressed size accepted: more is treated as a zstd bomb. NATS caps a
# message at 64 MiB, and genmesh messages compress by a few times at most in practice.
DEFAULT_MAX_DECODED_BYTES = 64 * 1024 * 1024

# Without a declared content size: the first output buffer tried (grown to the limit).
_FIRST_GUESS = 64 * 1024
# zstandard's message when the output buffer is full before the frame ends.
_TOO_SMALL = "did not decompress full frame"

_WHITESPACE = b" \t\r\n\v\f"
_LITTLE_ENDIAN = sys.byteorder == "little"

assert array("i").itemsize == 4, "int32 arrays need a 4-byte C int"


class DecodeError(ValueError):
    """Text or bytes that do not decode; the message says which step failed."""


class _PerThread(threading.local):
    def __init__(self) -> None:
        self.compressors: dict[int, zstandard.ZstdCompressor] = {}
        self.decompressor = zstandard.ZstdDecompressor()


_local = _PerThread()


def compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's compressor for `level`: content size in the header, no checksum."""
    cctx = _local.compressors.get(level)
    if cctx is None:
        cctx = _local.compressors[level] = zstandard.ZstdCompressor(
            level=level, write_content_size=True, write_checksum=False, write_dict_id=False
        )
    return cctx


def compress(data: bytes, level: int = DEFAULT_LEVEL) -> bytes:
    """One zstd frame holding `data`."""
    return compressor(level).compress(data)


def decompress(data: bytes, limit: int = DEFAULT_MAX_DECODED_BYTES) -> bytes:
    """The content of exactly one zstd frame (nothing may follow it), at most `limit` bytes."""
    try:
        size = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise DecodeError(f"not a zstd frame ({exc})") from None
    if size > limit:
        raise DecodeError(f"zstd frame declares {size} bytes, more than the limit of {limit}")
    dctx = _local.decompressor
    try:
        if size > 0:
            # The declared size is allocated once; zstd fails if the frame disagrees.
            return dctx.decompress(data, allow_extra_data=False)
        if size == 0:
            # decompress() answers b"" from the header alone; make zstd read the frame.
            dobj = dctx.decompressobj(read_across_frames=False)
            if dobj.decompress(data) or not dobj.eof or dobj.unused_data:
                raise DecodeError("zstd frame does not match its declared size of 0 bytes")
            return b""
        # No content size in the header (a streaming encoder). The output buffer is
        # allocated up front, so try a small one before the limit.
        first = min(limit, max(_FIRST_GUESS, 32 * len(data)))
        try:
            return dctx.decompress(data, max_output_size=first, allow_extra_data=False)
        except zstandard.ZstdError as exc:
            if first == limit or _TOO_SMALL not in str(exc):
                raise
        return dctx.decompress(data, max_output_size=limit, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        message = str(exc)
        if size < 0 and _TOO_SMALL in message:
            raise DecodeError(f"zstd frame decompresses to more than {limit} bytes") from None
        raise DecodeError(f"not a valid zstd frame ({message})") from None


def b64encode(data: bytes) -> bytes:
    """RFC 4648 standard Base64 with padding, no line breaks."""
    return base64.b64encode(data)


def b64decode(text: str | bytes) -> bytes:
    """Strict standard Base64 (padding required); ASCII whitespace is ignored."""
    if isinstance(text, str):
        try:
            raw = text.encode("ascii")
        except UnicodeEncodeError:
            raise DecodeError("not valid Base64 (non-ASCII characters)") from None
    else:
        raw = text
    if any(c in raw for c in _WHITESPACE):
        raw = raw.translate(None, _WHITESPACE)
    try:
        return base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise DecodeError(f"not valid Base64 ({exc})") from None


def pack_int32(values: list[int]) -> bytes:
    """Little-endian int32."""
    try:
        packed = array("i", values)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"not a list of int32 values: {exc}") from None
    if not _LITTLE_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def unpack_int32(data: bytes) -> list[int]:
    """Little-endian int32 values; the length must be a multiple of 4."""
    if len(data) % 4:
        raise DecodeError(f"{len(data)} bytes is not a whole number of little-endian int32 values")
    values = array("i")
    values.frombytes(data)
    if not _LITTLE_ENDIAN:
        values.byteswap()
    return values.tolist()

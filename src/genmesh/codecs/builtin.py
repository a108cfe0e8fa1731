"""The two codecs every service understands."""

from __future__ import annotations

import json
from array import array
from typing import Any

import msgpack

from genmesh.codecs import CodecError
from genmesh.codecs.int32 import TOKENS, to_le_bytes


def _packed(obj: Any) -> bytes:
    """msgpack's hook for what it cannot pack itself: a token array, as one bin of its
    little-endian int32 bytes (called only for such objects: free for everything else)."""
    if isinstance(obj, array) and obj.typecode == TOKENS:
        return to_le_bytes(obj)
    raise TypeError(f"can not serialize {type(obj).__name__!r} object")


def _listed(obj: Any) -> list[int]:
    """json's hook: a token array is a JSON list of ints (JSON has no bytes)."""
    if isinstance(obj, array) and obj.typecode == TOKENS:
        return obj.tolist()
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


class MsgpackCodec:
    """msgpack maps with field names; the default on the bus. Token arrays go as bin."""

    name = "msgpack"

    def encode(self, obj: Any) -> bytes:
        try:
            return msgpack.packb(obj, use_bin_type=True, default=_packed)  # type: ignore[no-any-return]
        except (TypeError, ValueError, OverflowError) as exc:
            raise CodecError(f"msgpack cannot encode: {exc}") from exc

    def decode(self, data: bytes) -> Any:
        try:
            return msgpack.unpackb(data, raw=False)
        except Exception as exc:  # msgpack raises a zoo of types on garbage
            raise CodecError(f"not valid msgpack: {exc}") from exc


class JsonCodec:
    """UTF-8 JSON, for clients in any language and for natscli users."""

    name = "json"

    def encode(self, obj: Any) -> bytes:
        try:
            # allow_nan=False: NaN and Infinity are not JSON; engines clamp logprobs instead.
            return json.dumps(
                obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False, default=_listed
            ).encode()
        except (TypeError, ValueError) as exc:
            raise CodecError(f"json cannot encode: {exc}") from exc

    def decode(self, data: bytes) -> Any:
        try:
            return json.loads(data)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise CodecError(f"not valid JSON: {exc}") from exc

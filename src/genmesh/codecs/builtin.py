"""The two codecs every service understands."""

from __future__ import annotations

import json
from typing import Any

import msgpack

from genmesh.codecs import CodecError


class MsgpackCodec:
    """msgpack maps with field names; the default on the bus."""

    name = "msgpack"

    def encode(self, obj: Any) -> bytes:
        try:
            return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]
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
                obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False
            ).encode()
        except (TypeError, ValueError) as exc:
            raise CodecError(f"json cannot encode: {exc}") from exc

    def decode(self, data: bytes) -> Any:
        try:
            return json.loads(data)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise CodecError(f"not valid JSON: {exc}") from exc

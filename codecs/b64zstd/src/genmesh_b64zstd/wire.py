"""The `b64zstd` bus codec: Base64 text of zstd-compressed msgpack.

A message body is `base64(zstd(msgpack(obj)))`, ASCII only, so a frame survives any
text-only carrier; msgpack is exactly what the built-in `msgpack` codec writes and reads.
"""

from __future__ import annotations

from typing import Any

from genmesh.codecs import CodecError
from genmesh.codecs.builtin import MsgpackCodec
from genmesh_b64zstd import _zstd


class B64ZstdCodec:
    name = "b64zstd"

    def __init__(
        self,
        level: int = _zstd.DEFAULT_LEVEL,
        max_decoded_bytes: int = _zstd.DEFAULT_MAX_DECODED_BYTES,
    ) -> None:
        self.level = level
        self.max_decoded_bytes = max_decoded_bytes
        self._msgpack = MsgpackCodec()

    def encode(self, obj: Any) -> bytes:
        packed = self._msgpack.encode(obj)  # CodecError if msgpack cannot carry obj
        return _zstd.b64encode(_zstd.compress(packed, self.level))

    def decode(self, data: bytes) -> Any:
        try:
            packed = _zstd.decompress(_zstd.b64decode(data), self.max_decoded_bytes)
        except _zstd.DecodeError as exc:
            raise CodecError(f"not valid b64zstd: {exc}") from None
        return self._msgpack.decode(packed)  # CodecError: "not valid msgpack: ..."

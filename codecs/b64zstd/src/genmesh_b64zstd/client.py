"""The `b64zstd` client codec for the SGLang `/generate` format.

Integer arrays travel as `base64(zstd(int32 little-endian))`:

- request `input_ids`: one such string, or (a batch) a list whose items are such strings
  or plain lists; plain lists of ints still work and are left alone, as is anything else
  (the format rejects it in its own words). A string decodes straight into the packed
  prompt (`TokenIds`, the array the format would have packed a list into), so a long
  prompt makes no Python int per token;
- record `output_ids`: encoded;
- record `meta_info.routed_experts`: the SGLang format already sends Base64 of
  little-endian int32; the codec compresses the bytes and re-encodes them.

The answer mirrors the request: records are encoded when some prompt came encoded, and
left as the SGLang format renders them when every prompt was a plain list
(`encodes_answer`), so a client that never sent Base64 never has to decode it.

Both record fields are `delta`s: two chunks join by decode, concatenate, encode, so the
unary body is the encoding of the whole sequence (zstd at a fixed level is deterministic:
joining encodings equals encoding the join).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from genmesh.codecs.int32 import first_high, from_le_bytes
from genmesh.formats.base import Record
from genmesh.formats.client_codec import ClientCodecError
from genmesh.formats.merge import Joiner
from genmesh.shared.envelope import TokenIds
from genmesh_b64zstd import _zstd

OUTPUT_IDS = "output_ids"
ROUTED_EXPERTS = "meta_info.routed_experts"


def encode_int32(values: list[int], level: int = _zstd.DEFAULT_LEVEL) -> str:
    """Base64 of zstd-compressed little-endian int32."""
    return _zstd.b64encode(_zstd.compress(_zstd.pack_int32(values), level)).decode("ascii")


def decode_int32(text: str, limit: int = _zstd.DEFAULT_MAX_DECODED_BYTES) -> list[int]:
    """The inverse of `encode_int32`; raises `ValueError` (a `DecodeError`) on bad input."""
    return _zstd.unpack_int32(_zstd.decompress(_zstd.b64decode(text), limit))


class B64ZstdClientCodec:
    name = "b64zstd"
    formats = frozenset({"sglang"})

    def __init__(
        self,
        level: int = _zstd.DEFAULT_LEVEL,
        max_decoded_bytes: int = _zstd.DEFAULT_MAX_DECODED_BYTES,
    ) -> None:
        self.level = level
        self.max_decoded_bytes = max_decoded_bytes
        self.joiners: Mapping[str, Joiner] = {OUTPUT_IDS: self.join, ROUTED_EXPERTS: self.join}

    # ------------------------------------------------------------------ requests

    def _ids(self, value: str, where: str) -> TokenIds | list[int]:
        """A prompt, decoded: as TokenIds (packed, no Python int per token) when every
        value is a token id, which the format takes as it is; else as the list of int32
        values, so the format names a negative one as it names it in a plain list."""
        try:
            data = _zstd.decompress(_zstd.b64decode(value), self.max_decoded_bytes)
            if len(data) % 4 == 0:
                packed = from_le_bytes(data, TokenIds())
                if first_high(packed) is None:  # no negative int32
                    return packed
            return _zstd.unpack_int32(data)  # which also refuses a partial int32
        except _zstd.DecodeError as exc:
            raise ClientCodecError(
                f"{where}: expected Base64 of zstd-compressed little-endian int32: {exc}"
            ) from None

    def decode_request(self, request: Any) -> Any:
        if not isinstance(request, dict):
            return request  # the format rejects it in its own words
        ids = request.get("input_ids")
        if isinstance(ids, str):
            return {**request, "input_ids": self._ids(ids, "input_ids")}
        # A batch: every item a prompt (string or list). A string among token IDs is left
        # to the format, which names it as a bad integer.
        if (
            isinstance(ids, list)
            and any(isinstance(item, str) for item in ids)
            and all(isinstance(item, str | list) for item in ids)
        ):
            decoded = [
                self._ids(item, f"input_ids[{i}]") if isinstance(item, str) else item
                for i, item in enumerate(ids)
            ]
            return {**request, "input_ids": decoded}
        return request

    def encodes_answer(self, request: Any) -> bool:
        if not isinstance(request, dict):
            return False
        ids = request.get("input_ids")
        if isinstance(ids, list):
            return any(isinstance(item, str) for item in ids)
        return isinstance(ids, str)

    # ------------------------------------------------------------------ records

    def _bytes(self, text: str) -> bytes:
        return _zstd.decompress(_zstd.b64decode(text), self.max_decoded_bytes)

    def _encode_bytes(self, data: bytes) -> str:
        return _zstd.b64encode(_zstd.compress(data, self.level)).decode("ascii")

    def encode_record(self, record: Record) -> Record:
        out = dict(record)  # same key order; the inner format's record is left alone
        ids = out.get("output_ids")
        if isinstance(ids, list):
            out["output_ids"] = self._encode_bytes(_zstd.pack_int32(ids))
        meta = out.get("meta_info")
        if isinstance(meta, dict):
            experts = meta.get("routed_experts")
            if isinstance(experts, str):
                raw = _zstd.b64decode(experts)  # the SGLang format's plain Base64
                out["meta_info"] = {**meta, "routed_experts": self._encode_bytes(raw)}
        return out

    def join(self, pieces: list[Any]) -> str:
        """Decode each piece, concatenate the int32 bytes, encode once."""
        return self._encode_bytes(b"".join(self._bytes(piece) for piece in pieces))

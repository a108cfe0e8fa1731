"""Base64+zstd for genmesh.

- `B64ZstdCodec`: the bus codec `b64zstd` (entry-point group `genmesh.codecs`).
- `B64ZstdClientCodec`: the client codec `b64zstd` for the SGLang format (entry-point group
  `genmesh.client_codecs`), selected with `GENMESH_GENERATE_FORMAT=sglang+b64zstd`.
"""

from __future__ import annotations

from genmesh_b64zstd.client import B64ZstdClientCodec, decode_int32, encode_int32
from genmesh_b64zstd.wire import B64ZstdCodec

__all__ = ["B64ZstdClientCodec", "B64ZstdCodec", "decode_int32", "encode_int32"]

"""Hashes of token sequences in request records, the same on every run and machine.

Token IDs are serialised as little-endian signed 32-bit integers (every token ID the mesh
accepts is in [0, 2^31)). Hashes are BLAKE2b with an 8-byte digest, written as 16 lower-case
hex digits.

- Prompt block hashes: the prompt is cut into blocks of `block_size` tokens (the last block
  may be shorter); block `i`'s hash is `blake2b(h[i-1] + bytes(block i))`, with no
  predecessor for block 0, so each hash names the whole prefix up to the end of its block
  (what a prefix cache keys on).
- Output hash: `blake2b(bytes(all output tokens))`, one digest over the whole sequence, so
  it does not depend on the block size.
"""

from __future__ import annotations

from collections.abc import Sequence
from hashlib import blake2b

from genmesh.codecs.int32 import to_le_bytes

ALGORITHM = "blake2b-64/int32le"
DEFAULT_BLOCK_SIZE = 64
DIGEST_SIZE = 8


def int32le(token_ids: Sequence[int]) -> bytes:
    """The token IDs as little-endian int32 bytes (a prompt's token array in one C pass)."""
    return to_le_bytes(token_ids)


def block_hashes(token_ids: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE) -> list[str]:
    """Chained hashes of the blocks of `token_ids` (a shorter last block included)."""
    data = int32le(token_ids)
    step = block_size * 4
    hashes: list[str] = []
    previous = b""
    for offset in range(0, len(data), step):
        digest = blake2b(previous + data[offset : offset + step], digest_size=DIGEST_SIZE)
        previous = digest.digest()
        hashes.append(digest.hexdigest())
    return hashes


def output_hash(token_ids: Sequence[int]) -> str:
    """One hash of a whole token sequence (the empty sequence has one too)."""
    return blake2b(int32le(token_ids), digest_size=DIGEST_SIZE).hexdigest()

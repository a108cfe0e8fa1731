"""Token arrays and their packed form: little-endian int32 bytes.

In memory a prompt is an `array` of unsigned 4-byte C ints (`TOKENS`, the host's byte
order); on the bus msgpack carries it as one bin of its little-endian bytes (protocol.md,
`token_ids`), and request records hash the same bytes. Token IDs are in [0, 2^31), where
int32 and uint32 share their bytes. This module is the one place that knows the byte
order, so every hop converts a prompt in C, never one Python int per token.

Why unsigned: `array` packs a list into an unsigned type about three times faster than
into a signed one (`I` converts each int directly, `i` through argument parsing), and
refuses negatives while it does so; what is left, ids of 2^31 and above, is one bit per
entry that `first_high` finds in C.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Any, TypeVar

# The typecode of a 4-byte unsigned C int (`I` on every platform CPython supports).
TOKENS = next(code for code in "IHL" if array(code).itemsize == 4)
# The host's order differs from the wire's: swap on the way in and out. A module variable,
# read at each call, so tests can fake a big-endian host on a little-endian one.
big_endian = sys.byteorder != "little"
A = TypeVar("A", bound="array[Any]")


def packed(values: Sequence[int]) -> array[int]:
    """`values` as a `TOKENS` array: itself if it is one (no copy), else packed in C."""
    if isinstance(values, array) and values.typecode == TOKENS:
        return values
    return array(TOKENS, values)


def to_le_bytes(values: Sequence[int]) -> bytes:
    """`values` (best a `TOKENS` array: no copy) as little-endian 4-byte ints."""
    values = packed(values)
    if big_endian:
        values = array(TOKENS, values)
        values.byteswap()
    return values.tobytes()


def from_le_bytes(data: bytes, values: A) -> A:
    """`values` (an empty `TOKENS` array) filled from little-endian 4-byte `data` (its
    length a multiple of 4)."""
    values.frombytes(data)
    if big_endian:
        values.byteswap()
    return values


def first_high(values: Sequence[int]) -> int | None:
    """The index of the first entry of `values` (best a `TOKENS` array) with its top bit
    set (2^31 or more; a negative int32 on the wire), or None.

    In C: the top bytes (every 4th byte of the native bytes) are all ASCII exactly when
    no entry has its top bit set; only an array with such an entry is searched."""
    data = packed(values).tobytes()
    top = data[0::4] if big_endian else data[3::4]
    if top.isascii():
        return None
    return next(i for i, byte in enumerate(top) if byte >= 0x80)


def all_below(values: Sequence[int], limit: int) -> bool:
    """Whether every entry of `values` (best a `TOKENS` array) is below `limit` (>= 1).

    In C for the common case: with `limit`'s top set bit in byte k, an array whose bytes
    above k are all zero and whose bytes k are all below `limit`'s byte k is below
    `limit`. An array with an entry close to `limit` or above it is settled by `max()`."""
    data = to_le_bytes(values)
    k = (limit.bit_length() - 1) // 8
    high_bytes_zero = all(data[j::4].count(0) == len(values) for j in range(k + 1, 4))
    if high_bytes_zero and not data[k::4].translate(None, bytes(range(limit >> 8 * k))):
        return True
    return not values or max(values) < limit

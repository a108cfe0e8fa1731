"""Token arrays and their packed form: little-endian int32 bytes.

In memory a prompt is an `array` of C ints (`TOKENS`, 4 bytes each, the host's byte order);
on the bus msgpack carries it as one bin of its little-endian bytes (protocol.md,
`token_ids`), and request records hash the same bytes. This module is the one place that
knows the byte order, so every hop converts a prompt in C, never one Python int per token.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Any, TypeVar

# The typecode of a 4-byte C int (`i` on every platform CPython supports; checked anyway).
TOKENS = next(code for code in "ihl" if array(code).itemsize == 4)
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
    """`values` (best a `TOKENS` array: no copy) as little-endian int32 bytes."""
    values = packed(values)
    if big_endian:
        values = array(TOKENS, values)
        values.byteswap()
    return values.tobytes()


def from_le_bytes(data: bytes, values: A) -> A:
    """`values` (an empty `TOKENS` array) filled from little-endian int32 `data` (its
    length a multiple of 4)."""
    values.frombytes(data)
    if big_endian:
        values.byteswap()
    return values


def first_negative(values: Sequence[int]) -> int | None:
    """The index of the first negative entry of `values` (best a `TOKENS` array), or None.

    In C: a negative int32 is one whose most significant byte has its high bit set, so
    the sign bytes (every 4th byte of the native bytes) are all ASCII exactly when no
    entry is negative; only an array with a negative entry is searched."""
    data = packed(values).tobytes()
    signs = data[0::4] if big_endian else data[3::4]
    if signs.isascii():
        return None
    return next(i for i, sign in enumerate(signs) if sign >= 0x80)


def all_below(values: Sequence[int], limit: int) -> bool:
    """Whether every entry of `values` (non-negative ints, best a `TOKENS` array) is below
    `limit` (>= 1).

    In C for the common case: with `limit`'s top set bit in byte k, an array whose bytes
    above k are all zero and whose bytes k are all below `limit`'s byte k is below
    `limit`. An array with an entry close to `limit` or above it is settled by `max()`."""
    data = to_le_bytes(values)
    k = (limit.bit_length() - 1) // 8
    high_bytes_zero = all(not data[j::4].strip(b"\0") for j in range(k + 1, 4))
    if high_bytes_zero and not data[k::4].translate(None, bytes(range(limit >> 8 * k))):
        return True
    return not values or max(values) < limit

"""formats/fastapi.py reads a body exactly as FastAPI's `json.loads` would, fast path or not."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from genmesh.formats.fastapi import BodyError, read_json

pytestmark = pytest.mark.unit

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text()
)
_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=20,
)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@settings(max_examples=300, deadline=None)
@given(_json)
def test_reads_every_document_as_json_loads_does(value: Any) -> None:
    raw = json.dumps(value).encode()
    assert _same(read_json(raw), json.loads(raw))


@pytest.mark.parametrize(
    "raw",
    [b"NaN", b'{"a": Infinity}', b"[1e400]", b'"\\ud800"', b"18446744073709551616",
     b"[-9223372036854775809]", b'{"a":1,"a":2}', b"0.123456789012345678901"],
)  # fmt: skip
def test_what_strict_json_parsers_refuse_or_change_reads_as_fastapi_reads_it(raw: bytes) -> None:
    assert _same(read_json(raw), json.loads(raw))


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        (b"", {"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}),
        (
            b'{"a": }',
            {
                "type": "json_invalid",
                "loc": ("body", 6),
                "msg": "JSON decode error",
                "input": {},
                "ctx": {"error": "Expecting value"},
            },
        ),
        (b"\xff", None),
    ],
)
def test_refusals_are_fastapis(raw: bytes, error: dict[str, Any] | None) -> None:
    with pytest.raises(BodyError) as caught:
        read_json(raw)
    assert caught.value.errors == (None if error is None else [error])

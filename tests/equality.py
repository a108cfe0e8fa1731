"""Strict equality for codec round trips."""

from __future__ import annotations

import math
from typing import Any


def same(a: Any, b: Any) -> bool:
    """Equality that tells bool from int from float, -0.0 from 0.0, and keeps key order."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    return bool(a == b)

"""Checks every format needs on native payloads it forwards."""

from __future__ import annotations

from typing import Any

INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1


def oversized_int(value: Any) -> tuple[str, int] | None:
    """The first integer the bus cannot carry (msgpack holds 64 bits) and its path."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict):
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(node))
        elif (
            isinstance(node, int)
            and not isinstance(node, bool)
            and not INT64_MIN <= node <= UINT64_MAX
        ):
            return path, node
    return None

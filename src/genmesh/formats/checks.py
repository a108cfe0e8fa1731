"""Checks every format needs on native payloads it forwards."""

from __future__ import annotations

import logging
from collections.abc import Iterable
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


_log = logging.getLogger("genmesh.formats")
# (format, field) pairs already reported: an unknown field is logged once per process, not
# once per request (a router adding one to every body would flood the log otherwise).
_reported_unknown: set[tuple[str, str]] = set()


def note_unknown_fields(format_name: str, names: Iterable[str]) -> None:
    """Log, once per name, fields the real server ignores because it does not know them."""
    for name in names:
        key = (format_name, name)
        if key not in _reported_unknown:
            _reported_unknown.add(key)
            _log.info("%s: ignoring unknown request field %r, as the server does", *key)

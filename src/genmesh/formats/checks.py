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


class IgnoredFields:
    """Logs the request fields a format ignores because the real server does not know them:
    once per name and process, not once per request (a router that adds a field to every
    body would flood the log otherwise). Clients choose the names, so the set remembered is
    bounded; past the bound a new name is logged with every request that sends it."""

    def __init__(self, log: logging.Logger, message: str, level: int, limit: int = 1024) -> None:
        self.log = log
        self.message = message  # one `%s`: the names
        self.level = level
        self.limit = limit
        self.seen: set[str] = set()

    def note(self, names: Iterable[str], prefix: str = "") -> None:
        new = sorted(name for n in names if (name := prefix + n) not in self.seen)
        if not new:
            return
        if len(self.seen) < self.limit:
            self.seen.update(new)
        self.log.log(self.level, self.message, new)

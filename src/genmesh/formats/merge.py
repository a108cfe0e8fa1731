"""One generic merger: fold a stream of native response chunks into the unary body.

Each response field has a rule, named by its dotted path (`meta_info.completion_tokens`):

- `delta`: each chunk carries new items; concatenate (lists and strings).
- `attempt`: a running total within one worker attempt; after a migration the earlier
  attempts' final values are added.
- `prompt`: a property of the original prompt; the first attempt's value stands (later
  attempts see a prompt that includes replayed output).
- `last`: the last value wins (finish reasons, IDs, latencies). The default.

Maps are merged key by key, recursively; the key order is the order of first appearance.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any


class Rule(StrEnum):
    DELTA = "delta"
    ATTEMPT = "attempt"
    PROMPT = "prompt"
    LAST = "last"


class Merger:
    def __init__(self, rules: Mapping[str, Rule]) -> None:
        self.rules = rules
        # Paths with rules below them: maps found there are merged key by key, not replaced.
        self._parents = {
            ".".join(path.split(".")[:i]) + "."
            for path in rules
            for i in range(1, len(path.split(".")))
        }
        self._body: dict[str, Any] = {}
        # For `attempt` fields: path -> {attempt: last value}.
        self._attempts: dict[str, dict[int, Any]] = {}

    def add(self, chunk: Mapping[str, Any], attempt: int = 0) -> None:
        self._merge(self._body, chunk, "", attempt)

    def _merge(
        self, acc: dict[str, Any], chunk: Mapping[str, Any], prefix: str, attempt: int
    ) -> None:
        for key, value in chunk.items():
            path = prefix + key
            rule = self.rules.get(path, Rule.LAST)
            if rule is Rule.LAST and isinstance(value, Mapping) and path + "." in self._parents:
                nested = acc.get(key)
                if not isinstance(nested, dict):
                    nested = acc[key] = {}
                self._merge(nested, value, path + ".", attempt)
            elif rule is Rule.DELTA:
                if key in acc and acc[key] is not None and value is not None:
                    acc[key] = acc[key] + value
                elif value is not None or key not in acc:
                    acc[key] = list(value) if isinstance(value, list) else value
            elif rule is Rule.ATTEMPT:
                self._attempts.setdefault(path, {})[attempt] = value
                acc[key] = None  # placeholder keeps the key order; filled in result()
            elif rule is Rule.PROMPT:
                if key not in acc:
                    acc[key] = value
            else:
                acc[key] = value

    def result(self) -> dict[str, Any]:
        for path, by_attempt in self._attempts.items():
            values = [v for _, v in sorted(by_attempt.items()) if v is not None]
            total: Any = None
            for value in values:
                total = value if total is None else total + value
            node = self._body
            *parents, leaf = path.split(".")
            for part in parents:
                node = node[part]
            node[leaf] = total
        return self._body


def fold(chunks: list[Mapping[str, Any]], rules: Mapping[str, Rule]) -> dict[str, Any]:
    merger = Merger(rules)
    for chunk in chunks:
        merger.add(chunk)
    return merger.result()

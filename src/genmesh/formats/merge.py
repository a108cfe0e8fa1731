"""One generic merger: fold a stream of native response chunks into the unary body.

Each response field has a rule, named by its dotted path (`meta_info.completion_tokens`):

- `delta`: each chunk carries new items; the pieces are joined (lists concatenated,
  strings joined, or the field's own joiner: a client codec that sends Base64 joins by
  decode-concatenate-encode).
- `attempt`: a running total within one worker attempt; after a migration the earlier
  attempts' final values are added.
- `prompt`: a property of the original prompt; the first attempt's last non-null value
  stands (later attempts see a prompt that includes replayed output).
- `last`: the last value wins (finish reasons, IDs, latencies). The default.

Maps are merged key by key, recursively; the key order is the order of first appearance.
Pieces are joined once, at the end, so folding n chunks costs O(n).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Any

Joiner = Callable[[list[Any]], Any]


class Rule(StrEnum):
    DELTA = "delta"
    ATTEMPT = "attempt"
    PROMPT = "prompt"
    LAST = "last"


def concat(pieces: list[Any]) -> Any:
    """The default joiner: concatenated lists, or joined strings."""
    if all(isinstance(p, str) for p in pieces):
        return "".join(pieces)
    out: list[Any] = []
    for piece in pieces:
        out.extend(piece)
    return out


class Merger:
    def __init__(
        self, rules: Mapping[str, Rule], joiners: Mapping[str, Joiner] | None = None
    ) -> None:
        self.rules = rules
        self.joiners = joiners or {}
        # Paths with rules below them: maps found there are merged key by key, not replaced.
        self._parents = {
            ".".join(path.split(".")[:i]) + "."
            for path in rules
            for i in range(1, len(path.split(".")))
        }
        self._body: dict[str, Any] = {}
        # Values kept aside until result(): placeholders hold their place in the key order.
        self._pieces: dict[str, list[Any]] = {}
        self._attempts: dict[str, dict[int, Any]] = {}
        # For `prompt` fields: the attempt whose values stand (the first seen).
        self._prompt_attempt: dict[str, int] = {}

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
                pieces = self._pieces.setdefault(path, [])
                if value is not None:
                    pieces.append(value)
                acc.setdefault(key, None)
            elif rule is Rule.ATTEMPT:
                self._attempts.setdefault(path, {})[attempt] = value
                acc.setdefault(key, None)
            elif rule is Rule.PROMPT:
                # The first attempt's last value: an engine may report it late in that
                # attempt, while later attempts describe a prompt with replayed output.
                first_attempt = self._prompt_attempt.setdefault(path, attempt) == attempt
                if first_attempt and (value is not None or key not in acc):
                    acc[key] = value
            else:
                acc[key] = value

    def result(self) -> dict[str, Any]:
        for path, pieces in self._pieces.items():
            joiner = self.joiners.get(path, concat)
            self._set(path, joiner(pieces) if pieces else None)
        for path, by_attempt in self._attempts.items():
            total: Any = None
            for _, value in sorted(by_attempt.items()):
                if value is not None:
                    total = value if total is None else total + value
            self._set(path, total)
        return self._body

    def _set(self, path: str, value: Any) -> None:
        node = self._body
        *parents, leaf = path.split(".")
        for part in parents:
            child = node.get(part)
            if not isinstance(child, dict):
                return  # a later chunk replaced the whole map: its last value stands
            node = child
        node[leaf] = value


class Rebaser:
    """The streaming side of the same rules: makes each record of a migrated request say
    what an uninterrupted run would have said (for SSE, where records go out one by one).

    `attempt` fields get the earlier attempts' final values added; `prompt` fields keep
    the first attempt's values; `delta` and `last` fields pass unchanged.
    """

    def __init__(self, rules: Mapping[str, Rule]) -> None:
        # (path, its parent keys, its leaf key, rule), split once: rebase runs per token.
        self.rules = [
            (path, *_split(path), rule)
            for path, rule in rules.items()
            if rule in (Rule.ATTEMPT, Rule.PROMPT)
        ]
        self._attempt: int | None = None
        self._first: int | None = None
        self._base: dict[str, Any] = {}  # attempt fields: total of the attempts before
        self._last: dict[str, Any] = {}  # attempt fields: last value of this attempt
        self._prompt: dict[str, Any] = {}  # prompt fields: the first attempt's values

    def rebase(self, record: dict[str, Any], attempt: int = 0) -> dict[str, Any]:
        if self._first is None:
            self._first = attempt
        if attempt != self._attempt:
            for path, value in self._last.items():
                if value is not None:
                    base = self._base.get(path)
                    self._base[path] = value if base is None else base + value
            self._last = {}
            self._attempt = attempt
        if not self.rules:
            return record
        # The first attempt's records are what they say (there is nothing before them to
        # add, no earlier prompt to restore): only noted, so no copy is needed.
        first = attempt == self._first
        out = record if first else _copy_maps(record)
        for path, parents, leaf, rule in self.rules:
            node: Any = out
            for part in parents:
                node = node.get(part) if isinstance(node, dict) else None
            if not isinstance(node, dict) or leaf not in node:
                continue
            value = node[leaf]
            if rule is Rule.ATTEMPT:
                self._last[path] = value
                base = self._base.get(path)
                if value is not None and base is not None:
                    node[leaf] = base + value
            elif first:
                if value is not None:
                    self._prompt[path] = value
            elif path in self._prompt:
                node[leaf] = self._prompt[path]
        return out


def _split(path: str) -> tuple[list[str], str]:
    *parents, leaf = path.split(".")
    return parents, leaf


def _copy_maps(record: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the maps of `record` (values shared): rebasing must not touch the input."""
    return {k: _copy_maps(v) if isinstance(v, Mapping) else v for k, v in record.items()}


def fold(
    chunks: list[Mapping[str, Any]],
    rules: Mapping[str, Rule],
    joiners: Mapping[str, Joiner] | None = None,
) -> dict[str, Any]:
    merger = Merger(rules, joiners)
    for chunk in chunks:
        merger.add(chunk)
    return merger.result()

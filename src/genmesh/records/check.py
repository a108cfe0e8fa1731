"""`genmesh trace check FILE...`: are these request records whole and consistent?

Reads `.jsonl` and `.jsonl.gz` files (a `PATH.jsonl.gz` that does not exist stands for its
segments `PATH.<n>.jsonl.gz`), checks every record against the schema, that record IDs and
private IDs are unique, that each record's totals, attempts and hashes agree with its
items, and, for payload records, that the prompt block hashes and output hashes match the
recorded token IDs. Prints counts by status, error type and format.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import sys
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from io import BufferedIOBase
from pathlib import Path
from typing import Any, TypeGuard

import orjson

from genmesh.records import SCHEMA
from genmesh.records.hashing import ALGORITHM, block_hashes, output_hash
from genmesh.records.sinks import gz_stem, segment_paths

HASH = re.compile(r"^[0-9a-f]{16}$")
MAX_SHOWN = 20


def expand(paths: Iterable[str | Path]) -> tuple[list[Path], list[str]]:
    """The files behind `paths` (segments for a `.jsonl.gz` stem), and what is missing."""
    files: list[Path] = []
    missing: list[str] = []
    for raw in paths:
        path = Path(raw)
        if path.is_file():
            files.append(path)
            continue
        stem = gz_stem(path)
        segments = segment_paths(stem) if stem is not None else []
        if segments:
            files.extend(segments)
        else:
            missing.append(str(raw))
    return files, missing


def read_records(
    paths: Iterable[str | Path], problems: list[str] | None = None
) -> Iterator[tuple[str, Any]]:
    """(`file:line`, record) for every line of every file; unreadable lines and files are
    added to `problems` (or raise ValueError when it is None)."""

    def problem(message: str) -> None:
        if problems is None:
            raise ValueError(message)
        problems.append(message)

    files, missing = expand(paths)
    for name in missing:
        problem(
            f"{name}: no such file (nor segments {name[:-9]}.<n>.jsonl.gz)"
            if name.endswith(".jsonl.gz")
            else f"{name}: no such file"
        )
    for path in files:
        line_no = 0
        try:
            with _open(path) as lines:
                for line_no, line in enumerate(lines, 1):
                    if not line.strip():
                        continue
                    try:
                        yield f"{path}:{line_no}", orjson.loads(line)
                    except orjson.JSONDecodeError as exc:
                        problem(f"{path}:{line_no}: not JSON ({exc})")
        except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
            problem(f"{path}: unreadable after line {line_no} (not closed cleanly?): {exc}")
        except OSError as exc:
            problem(f"{path}: {exc}")


def _open(path: Path) -> BufferedIOBase:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")
    return path.open("rb")


@dataclass
class Summary:
    files: int = 0
    records: int = 0
    items: int = 0
    payload_records: int = 0
    migrations: int = 0
    migrated_requests: int = 0
    output_tokens: int = 0
    by_status: Counter[str] = field(default_factory=Counter)
    by_error_type: Counter[str] = field(default_factory=Counter)
    by_format: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "files": self.files,
            "records": self.records,
            "items": self.items,
            "payload_records": self.payload_records,
            "migrations": self.migrations,
            "migrated_requests": self.migrated_requests,
            "output_tokens": self.output_tokens,
            "by_status": dict(sorted(self.by_status.items())),
            "by_error_type": dict(sorted(self.by_error_type.items())),
            "by_format": dict(sorted(self.by_format.items())),
            "problems": self.problems,
        }


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: Any) -> TypeGuard[int | float]:
    return (isinstance(value, int | float)) and not isinstance(value, bool)


def _opt_str(value: Any) -> bool:
    return value is None or isinstance(value, str)


TOP_FIELDS: dict[str, Any] = {
    "schema": lambda v: v == SCHEMA,
    "event_time_unix_ms": _is_int,
    "record_id": lambda v: isinstance(v, str) and bool(v),
    "namespace": _opt_str,
    "public_id": _opt_str,
    "client_id": _opt_str,
    "format": lambda v: isinstance(v, str),
    "method": lambda v: isinstance(v, str),
    "endpoint": lambda v: isinstance(v, str),
    "stream": lambda v: isinstance(v, bool),
    "status": _is_int,
    "error_type": _opt_str,
    "timings": lambda v: isinstance(v, dict),
    "totals": lambda v: isinstance(v, dict),
    "hashing": lambda v: isinstance(v, dict),
    "items": lambda v: isinstance(v, list),
}
ITEM_FIELDS: dict[str, Any] = {
    "index": _is_int,
    "private_id": lambda v: isinstance(v, str) and bool(v),
    "client_id": _opt_str,
    "prompt_tokens": lambda v: _is_int(v) and v >= 0,
    "prompt_block_hashes": lambda v: (
        isinstance(v, list) and all(isinstance(h, str) and HASH.match(h) for h in v)
    ),
    "workers": lambda v: isinstance(v, list) and all(isinstance(w, str) for w in v),
    "attempts": lambda v: isinstance(v, list) and bool(v) and all(isinstance(a, dict) for a in v),
    "output_tokens": lambda v: _is_int(v) and v >= 0,
    "output_hash": lambda v: isinstance(v, str) and bool(HASH.match(v)),
    "finish_reason": _opt_str,
    "error_type": _opt_str,
    "cached_tokens": lambda v: v is None or (_is_int(v) and v >= 0),
}


class Checker:
    def __init__(self, expect: int | None = None) -> None:
        self.expect = expect
        self.summary = Summary()
        self.record_ids: set[str] = set()
        self.private_ids: set[str] = set()

    def problem(self, where: str, message: str) -> None:
        self.summary.problems.append(f"{where}: {message}")

    def run(self, paths: Iterable[str | Path]) -> Summary:
        paths = list(paths)
        self.summary.files = len(expand(paths)[0])
        for where, record in read_records(paths, self.summary.problems):
            self.record(where, record)
        if self.expect is not None and self.summary.records != self.expect:
            self.summary.problems.append(
                f"expected {self.expect} records, found {self.summary.records}"
            )
        return self.summary

    def record(self, where: str, record: Any) -> None:
        s = self.summary
        s.records += 1
        if not isinstance(record, dict):
            self.problem(where, "a record must be a JSON object")
            return
        bad = [name for name, valid in TOP_FIELDS.items() if not valid(record.get(name))]
        missing = [name for name in TOP_FIELDS if name not in record]
        if missing:
            self.problem(where, f"missing fields: {', '.join(missing)}")
            return
        if bad:
            self.problem(where, f"invalid fields: {', '.join(bad)}")
            return
        where = f"{where} ({record['record_id']})"
        if record["record_id"] in self.record_ids:
            self.problem(where, "duplicate record_id")
        self.record_ids.add(record["record_id"])
        error_type = record["error_type"]
        s.by_status[str(record["status"])] += 1
        s.by_error_type[error_type or "ok"] += 1
        s.by_format[record["format"]] += 1
        hashing = record["hashing"]
        block_size = hashing.get("block_size")
        if hashing.get("algorithm") != ALGORITHM or not _is_int(block_size) or block_size < 1:
            self.problem(where, f"unknown hashing {hashing}")
            return
        items = record["items"]
        payload = record.get("payload")
        payload_items = None
        if payload is not None:
            s.payload_records += 1
            payload_items = self.payload(where, payload, len(items))
        totals = Counter[str]()
        for position, item in enumerate(items):
            self.item(f"{where} item {position}", position, item, block_size, error_type, totals)
            if payload_items is not None and isinstance(item, dict):
                self.item_payload(
                    f"{where} item {position}", item, payload_items[position], block_size
                )
        s.items += len(items)
        s.migrations += totals["migrations"]
        s.migrated_requests += bool(totals["migrations"])
        s.output_tokens += totals["output_tokens"]
        self.totals(where, record["totals"], totals, len(items))
        self.timings(where, record["timings"], totals["output_tokens"])
        if error_type is None and (totals["unfinished"] or not items):
            self.problem(where, "no error_type, but not every item finished")
        if record["status"] == 200 and not items:
            self.problem(where, "status 200 without items")

    def item(
        self,
        where: str,
        position: int,
        item: Any,
        block_size: int,
        error_type: str | None,
        totals: Counter[str],
    ) -> None:
        if not isinstance(item, dict):
            self.problem(where, "an item must be a JSON object")
            return
        bad = [name for name, valid in ITEM_FIELDS.items() if not valid(item.get(name))]
        missing = [name for name in ITEM_FIELDS if name not in item]
        if missing or bad:
            self.problem(where, f"missing or invalid fields: {', '.join(missing or bad)}")
            return
        if item["index"] != position:
            self.problem(where, f"index {item['index']} out of order")
        if item["private_id"] in self.private_ids:
            self.problem(where, f"duplicate private_id {item['private_id']}")
        self.private_ids.add(item["private_id"])
        blocks = math.ceil(item["prompt_tokens"] / block_size)
        if len(item["prompt_block_hashes"]) != blocks:
            self.problem(
                where,
                f"{len(item['prompt_block_hashes'])} prompt block hashes for "
                f"{item['prompt_tokens']} tokens in blocks of {block_size}",
            )
        if (item["finish_reason"] is None) == (item["error_type"] is None):
            self.problem(where, "exactly one of finish_reason and error_type must be set")
        attempts = item["attempts"]
        numbers = [a.get("attempt") for a in attempts]
        if (
            not all(_is_int(n) for n in numbers)
            or numbers[0] != 1
            or numbers != sorted(set(numbers))
        ):
            self.problem(where, f"attempt numbers {numbers}")
        produced = [a.get("output_tokens") for a in attempts]
        if not all(_is_int(n) and n >= 0 for n in produced):
            self.problem(where, "attempts need output_tokens")
        elif sum(produced) != item["output_tokens"]:
            self.problem(
                where,
                f"attempts produced {sum(produced)} tokens, item says {item['output_tokens']}",
            )
        for attempt in attempts[:-1]:
            if not isinstance(attempt.get("migration_reason"), str):
                self.problem(where, f"attempt {attempt.get('attempt')} ended without a reason")
        workers = [a.get("worker") for a in attempts if a.get("worker") is not None]
        if item["workers"] != list(dict.fromkeys(workers)):
            self.problem(where, f"workers {item['workers']} do not match attempts {workers}")
        totals["input_tokens"] += item["prompt_tokens"]
        totals["output_tokens"] += item["output_tokens"]
        totals["cached_tokens"] += item["cached_tokens"] or 0
        totals["attempts"] += len(attempts)
        totals["migrations"] += len(attempts) - 1
        totals["unfinished"] += item["finish_reason"] is None

    def payload(self, where: str, payload: Any, count: int) -> list[dict[str, Any]] | None:
        if not isinstance(payload, dict):
            self.problem(where, "payload must be an object")
            return None
        if not isinstance(payload.get("body", payload.get("body_base64")), str):
            self.problem(where, "payload without body")
        if not isinstance(payload.get("headers"), dict):
            self.problem(where, "payload without headers")
        items = payload.get("items")
        if (
            not isinstance(items, list)
            or len(items) != count
            or not all(isinstance(i, dict) for i in items)
        ):
            self.problem(where, "payload items do not match the record's items")
            return None
        return items

    def item_payload(
        self, where: str, item: dict[str, Any], payload: dict[str, Any], block_size: int
    ) -> None:
        prompt = payload.get("prompt_token_ids")
        output = payload.get("output_token_ids")
        if not isinstance(prompt, list) or not isinstance(output, list):
            self.problem(where, "payload needs prompt_token_ids and output_token_ids")
            return
        if not _token_list(prompt) or not _token_list(output):
            self.problem(where, "payload token ids must be integers in [0, 2^31)")
            return
        if len(prompt) != item.get("prompt_tokens"):
            self.problem(
                where,
                f"payload prompt has {len(prompt)} tokens, item says {item.get('prompt_tokens')}",
            )
        if block_hashes(prompt, block_size) != item.get("prompt_block_hashes"):
            self.problem(where, "prompt block hashes do not match the payload's prompt")
        if len(output) != item.get("output_tokens"):
            self.problem(
                where,
                f"payload output has {len(output)} tokens, item says {item.get('output_tokens')}",
            )
        if output_hash(output) != item.get("output_hash"):
            self.problem(where, "output hash does not match the payload's output tokens")

    def totals(self, where: str, totals: dict[str, Any], counted: Counter[str], n: int) -> None:
        expected = {
            "items": n,
            "input_tokens": counted["input_tokens"],
            "output_tokens": counted["output_tokens"],
            "cached_tokens": counted["cached_tokens"],
            "attempts": counted["attempts"],
            "migrations": counted["migrations"],
        }
        wrong = {k: totals.get(k) for k, v in expected.items() if totals.get(k) != v}
        if wrong:
            self.problem(where, f"totals {wrong} do not add up to the items' {expected}")

    def timings(self, where: str, timings: dict[str, Any], output_tokens: int) -> None:
        received, first, end = (
            timings.get("received_unix_ms"),
            timings.get("first_token_ms"),
            timings.get("end_ms"),
        )
        if not _is_int(received) or not _is_num(end) or end < 0:
            self.problem(where, f"timings {timings}")
            return
        if first is None:
            if output_tokens:
                self.problem(where, "output tokens but no first_token_ms")
        elif not _is_num(first) or not 0 <= first <= end:
            self.problem(where, f"first_token_ms {first} not within [0, end_ms {end}]")


def _token_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_int(t) and 0 <= t < 2**31 for t in value)


def check(paths: Iterable[str | Path], *, expect: int | None = None) -> Summary:
    return Checker(expect).run(paths)


def render(summary: Summary) -> str:
    def counts(counter: Counter[str]) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(counter.items())) or "-"

    lines = [
        f"{summary.records} records ({summary.items} generations) in {summary.files} file(s); "
        f"{summary.payload_records} with payload",
        f"  by status:     {counts(summary.by_status)}",
        f"  by error type: {counts(summary.by_error_type)}",
        f"  by format:     {counts(summary.by_format)}",
        f"  migrations:    {summary.migrations} in {summary.migrated_requests} requests; "
        f"{summary.output_tokens} output tokens",
    ]
    if summary.problems:
        lines.append(f"{len(summary.problems)} problem(s):")
        lines += [f"  {p}" for p in summary.problems[:MAX_SHOWN]]
        if len(summary.problems) > MAX_SHOWN:
            lines.append(f"  ... and {len(summary.problems) - MAX_SHOWN} more")
    else:
        lines.append("OK")
    return "\n".join(lines)


def main_check(files: list[str], *, expect: int | None = None, as_json: bool = False) -> int:
    summary = check(files, expect=expect)
    if as_json:
        print(json.dumps(summary.as_json(), indent=2))
    else:
        print(render(summary))
    sys.stdout.flush()
    return 0 if summary.ok else 1

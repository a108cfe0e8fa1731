"""`genmesh trace replay FILE... --url URL`: send recorded requests again, compare outputs.

Every payload record's body goes to the same method and endpoint on URL, with the request
headers it was recorded with (`Content-Type`, `X-Request-Id`, `X-Request-Timeout`,
`X-data-parallel-rank`). The answer's generated token IDs are read back per generation
(SGLang and vLLM shapes, unary and SSE, the b64zstd client codec if it is installed) and
hashed as the records hash them:

- a generation that finished when recorded must come back with the same output hash
  (deterministic engines do; sampling without a seed does not);
- one that did not (the client went away, a fault, another item failed) must come back
  with the recorded tokens as a prefix of the new output;
- a request refused before dispatch with 400/404/422/501 must be refused the same way;
  other refusals (413: its body was not kept; 503 not ready; a client that left before
  its body arrived) are skipped.

Records without a payload are skipped: they hold no prompt.
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from genmesh.records.check import read_records
from genmesh.records.hashing import output_hash

DETERMINISTIC_REFUSALS = frozenset({400, 404, 422, 501})
MAX_SHOWN = 20


class ReplayError(Exception):
    pass


@dataclass
class Outcome:
    kind: str  # match | prefix | same_status | skipped | mismatch | error
    detail: str = ""


@dataclass
class ReplaySummary:
    records: int = 0
    counts: Counter[str] = field(default_factory=Counter)
    mismatches: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # unreadable input
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not (self.mismatches or self.errors or self.problems)

    def as_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "records": self.records,
            **{k: self.counts[k] for k in ("match", "prefix", "same_status", "skipped")},
            "mismatch": len(self.mismatches),
            "error": len(self.errors),
            "mismatches": self.mismatches,
            "errors": self.errors,
            "problems": self.problems,
            "seconds": round(self.seconds, 3),
        }


def _ids(value: Any) -> list[int]:
    if isinstance(value, list):
        return value
    if isinstance(value, str):  # the b64zstd client codec's integer arrays
        try:
            from genmesh_b64zstd.client import decode_int32
        except ImportError as exc:
            raise ReplayError("encoded output_ids, but genmesh-b64zstd is not installed") from exc
        return decode_int32(value)
    if value is None:
        return []
    raise ReplayError(f"unexpected output ids {str(value)[:60]!r}")


def _events(raw: bytes) -> list[Any]:
    events = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            event = orjson.loads(line[6:])
            if isinstance(event, dict) and ("error" in event or event.get("object") == "error"):
                raise ReplayError(f"in-band error: {line[6:200].decode(errors='replace')}")
            events.append(event)
    return events


def outputs(fmt: str, stream: bool, raw: bytes) -> dict[int, list[int]]:
    """Generated token IDs per item index, from a response body."""
    base = fmt.partition("+")[0]
    out: dict[int, list[int]] = {}
    events = _events(raw) if stream else [orjson.loads(raw)]
    for event in events:
        if base == "vllm" or (isinstance(event, dict) and "choices" in event):
            for choice in event.get("choices") or []:
                out.setdefault(choice.get("index", 0), []).extend(_ids(choice.get("token_ids")))
        elif stream:
            out.setdefault(event.get("index", 0), []).extend(_ids(event.get("output_ids")))
        else:
            answers = event if isinstance(event, list) else [event]
            for index, answer in enumerate(answers):
                out[index] = list(_ids(answer.get("output_ids")))
    return out


async def replay_one(
    session: aiohttp.ClientSession, url: str, record: dict[str, Any], timeout_s: float
) -> Outcome:
    payload = record.get("payload")
    if not isinstance(payload, dict):
        return Outcome("skipped", "no payload")
    items = record.get("items") or []
    status = record.get("status")
    if not items and status not in DETERMINISTIC_REFUSALS:
        return Outcome("skipped", f"refused with {status} before dispatch")
    if "body_base64" in payload:
        body = base64.b64decode(payload["body_base64"])
    else:
        body = str(payload.get("body", "")).encode()
    headers = dict(payload.get("headers") or {})
    skip = () if any(k.lower() == "content-type" for k in headers) else ("Content-Type",)
    try:
        async with session.request(
            record["method"],
            url.rstrip("/") + record["endpoint"],
            data=body,
            headers=headers,
            skip_auto_headers=skip,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as response:
            got_status = response.status
            raw = await response.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Outcome("error", f"request failed: {exc!r}")
    if not items:
        if got_status == status:
            return Outcome("same_status")
        return Outcome("mismatch", f"recorded status {status}, replayed {got_status}")
    complete = record.get("error_type") is None
    if got_status != 200:
        if not complete and got_status == status:
            return Outcome("same_status")
        return Outcome("error", f"HTTP {got_status}: {raw[:200].decode(errors='replace')}")
    try:
        got = outputs(str(record.get("format")), bool(record.get("stream")), raw)
    except (ReplayError, ValueError, AttributeError, TypeError) as exc:
        if not complete:  # it failed when recorded too
            return Outcome("prefix", f"failed again: {exc}")
        return Outcome("error", f"unreadable answer: {exc}")
    recorded_outputs = payload.get("items") or []
    partial = False
    for index, item in enumerate(items):
        tokens = got.get(index, [])
        if item.get("finish_reason") is not None:
            if output_hash(tokens) != item.get("output_hash"):
                return Outcome(
                    "mismatch",
                    f"item {index}: output hash {output_hash(tokens)} != recorded "
                    f"{item.get('output_hash')} ({len(tokens)} vs {item.get('output_tokens')} "
                    "tokens)",
                )
            continue
        partial = True
        recorded = (
            recorded_outputs[index].get("output_token_ids")
            if index < len(recorded_outputs)
            else None
        )
        if not isinstance(recorded, list):
            continue
        if tokens[: len(recorded)] != recorded:
            return Outcome(
                "mismatch",
                f"item {index}: the recorded {len(recorded)} tokens of an unfinished "
                "generation are not a prefix of the replayed output",
            )
    return Outcome("prefix" if partial else "match")


class Progress:
    """A one-line progress bar on stderr (a line per 10% when stderr is not a terminal)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled and total > 0
        self.tty = sys.stderr.isatty()
        self.started = time.monotonic()
        self.shown_at = 0.0
        self.shown_tenth = -1

    def update(self, done: int, bad: int, final: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        tenth = done * 10 // self.total
        if self.tty:
            if not final and now - self.shown_at < 0.1:
                return
        elif tenth == self.shown_tenth:
            return
        self.shown_at, self.shown_tenth = now, tenth
        width = 30
        filled = width * done // self.total
        rate = done / max(now - self.started, 1e-9)
        line = (
            f"replay [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} "
            f"{rate:.1f} req/s, {bad} mismatched or failed"
        )
        if self.tty:
            sys.stderr.write("\r" + line + ("\n" if final else ""))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


async def replay(
    paths: list[str | Path],
    url: str,
    *,
    concurrency: int = 8,
    timeout_s: float = 120.0,
    progress: bool = True,
) -> ReplaySummary:
    summary = ReplaySummary()
    records = [
        record for _, record in read_records(paths, summary.problems) if isinstance(record, dict)
    ]
    summary.records = len(records)
    bar = Progress(len(records), progress)
    started = time.monotonic()
    queue = iter(enumerate(records))
    done = 0

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal done
        for _, record in queue:
            try:
                outcome = await replay_one(session, url, record, timeout_s)
            except Exception as exc:  # a malformed record, say
                outcome = Outcome("error", f"{type(exc).__name__}: {exc}")
            summary.counts[outcome.kind] += 1
            name = record.get("record_id") or record.get("public_id")
            if outcome.kind == "mismatch":
                summary.mismatches.append(f"{name}: {outcome.detail}")
            elif outcome.kind == "error":
                summary.errors.append(f"{name}: {outcome.detail}")
            done += 1
            bar.update(done, len(summary.mismatches) + len(summary.errors))

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    bar.update(done, len(summary.mismatches) + len(summary.errors), final=True)
    summary.seconds = time.monotonic() - started
    return summary


def render(summary: ReplaySummary) -> str:
    c = summary.counts
    lines = [
        f"replayed {summary.records} records in {summary.seconds:.1f}s: {c['match']} matched, "
        f"{c['prefix']} prefix-matched (unfinished when recorded), {c['same_status']} refused "
        f"alike, {c['skipped']} skipped, {len(summary.mismatches)} mismatched, "
        f"{len(summary.errors)} failed"
    ]
    for title, entries in (
        ("unreadable", summary.problems),
        ("mismatches", summary.mismatches),
        ("errors", summary.errors),
    ):
        if entries:
            lines.append(f"{title}:")
            lines += [f"  {e}" for e in entries[:MAX_SHOWN]]
            if len(entries) > MAX_SHOWN:
                lines.append(f"  ... and {len(entries) - MAX_SHOWN} more")
    lines.append("OK" if summary.ok else "FAILED")
    return "\n".join(lines)


def main_replay(
    files: list[str],
    *,
    url: str,
    concurrency: int = 8,
    timeout_s: float = 120.0,
    as_json: bool = False,
    progress: bool = True,
) -> int:
    summary = asyncio.run(
        replay(
            list(files),
            url,
            concurrency=concurrency,
            timeout_s=timeout_s,
            progress=progress,
        )
    )
    print(json.dumps(summary.as_json(), indent=2) if as_json else render(summary))
    sys.stdout.flush()
    return 0 if summary.ok else 1

"""The request-records observer: exactly one record per HTTP generate request.

The frontend's handler feeds every observer (`services/frontend/observers.py`): `request` at
arrival, `dispatched` once the items have their private IDs, `frame` for every reply frame
(the client's `mig` frames included) and `finished` exactly once, however the request ends:
answered, refused, failed in-band, cancelled by a client that went away. The record is built
and handed to the sinks in `finished`; per frame this only appends token IDs.

The schema is in `docs/observability.md` ("Request records").
"""

from __future__ import annotations

import itertools
import logging
import math
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client

from genmesh.records import SCHEMA
from genmesh.records.hashing import ALGORITHM, DEFAULT_BLOCK_SIZE, block_hashes, output_hash
from genmesh.records.sinks import DEFAULT_ROLL_MB, FileSink, NatsSink, Record, Sink, dump
from genmesh.services.frontend.observers import RequestInfo
from genmesh.shared.envelope import Envelope
from genmesh.shared.frames import Frame
from genmesh.shared.migration import attempt_id
from genmesh.shared.settings import from_env, non_negative_float, option, positive_int

log = logging.getLogger(__name__)

# Request headers a format may read, kept in payload records so that a replay sends them.
REPLAY_HEADERS = ("content-type", "x-request-id", "x-request-timeout", "x-data-parallel-rank")
CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class RecordsConfig:
    """`genmesh frontend --request-trace*` / `GENMESH_REQUEST_TRACE*`."""

    path: str | None = option(
        None,
        flag="--request-trace",
        help="write one trace record per request to this file: PATH.jsonl (appended) or "
        "PATH.jsonl.gz (segments PATH.<n>.jsonl.gz that roll)",
    )
    payload: bool = option(
        False,
        flag="--request-trace-payload",
        help="records also hold the request body and the prompt and output token ids",
    )
    nats: bool = option(
        False, flag="--request-trace-nats", help="publish each record on genmesh.<ns>.trace"
    )
    roll_mb: float = option(
        DEFAULT_ROLL_MB,
        flag="--request-trace-roll-mb",
        parse=non_negative_float,
        help=".jsonl.gz: start a new segment after this many MiB of JSON; 0 = no limit",
    )
    roll_lines: int = option(
        0,
        flag="--request-trace-roll-lines",
        help=".jsonl.gz: start a new segment after this many records; 0 = no limit",
    )
    block_size: int = option(
        DEFAULT_BLOCK_SIZE,
        flag="--request-trace-block-size",
        parse=positive_int,
        help="tokens per prompt block hash in the records",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.path) or self.nats


class RequestRecords:
    """An `Observer` that writes one record per request to its sinks."""

    def __init__(
        self,
        sinks: list[Sink],
        *,
        payload: bool = False,
        block_size: int = DEFAULT_BLOCK_SIZE,
        namespace: str | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"request records: block size must be >= 1, got {block_size}")
        self.sinks = sinks
        self.payload = payload
        self.block_size = block_size
        self.namespace = namespace
        self.hashing = {"algorithm": ALGORITHM, "block_size": block_size}
        # Record IDs: 80 random bits naming this frontend's run, then a counter.
        self._ids = itertools.count()
        self._id_prefix = secrets.token_hex(10)
        self.emitted = 0
        self.failed = 0

    @classmethod
    def from_config(
        cls,
        config: RecordsConfig,
        *,
        nc: Client | None = None,
        subject: str | None = None,
        namespace: str | None = None,
    ) -> RequestRecords:
        sinks: list[Sink] = []
        if config.path:
            sinks.append(
                FileSink(
                    config.path,
                    roll_bytes=int(config.roll_mb * 1024 * 1024),
                    roll_lines=config.roll_lines,
                )
            )
        if config.nats:
            if nc is None or subject is None:
                raise ValueError("request records: the NATS sink needs a NATS connection")
            sinks.append(NatsSink(nc, subject))
        return cls(sinks, payload=config.payload, block_size=config.block_size, namespace=namespace)

    def request(self, info: RequestInfo) -> RequestRecording:
        return RequestRecording(self, info)

    async def start(self) -> None:
        started: list[Sink] = []
        try:
            for sink in self.sinks:
                await sink.start()
                started.append(sink)
        except BaseException:
            for sink in started:
                await sink.close()
            raise
        log.info(
            "request records: %s%s",
            ", ".join(s.name for s in self.sinks) or "no sink",
            " (with payloads)" if self.payload else "",
        )

    async def close(self) -> None:
        for sink in self.sinks:
            try:
                await sink.close()
            except Exception:
                log.exception("request records: closing %s failed", sink.name)

    def record_id(self) -> str:
        return f"{self._id_prefix}{next(self._ids):012x}"

    def emit(self, record: Record) -> None:
        line = dump(record)
        self.emitted += 1
        for sink in self.sinks:
            sink.emit(line)


class _Item:
    """What one generation's frames said."""

    __slots__ = ("attempts", "cached", "envelope", "error", "finish", "tokens")

    def __init__(self, envelope: Envelope) -> None:
        self.envelope = envelope
        self.tokens: list[int] = []
        # One per dispatch attempt: [attempt, worker, dispatch, first token index, reason]
        self.attempts: list[list[Any]] = [[1, None, None, 0, None]]
        self.cached: int | None = None
        self.finish: str | None = None
        self.error: tuple[str, str] | None = None  # (code, message)


class RequestRecording:
    """The `RequestObserver` of one request."""

    __slots__ = ("first_token", "info", "items", "owner")

    def __init__(self, owner: RequestRecords, info: RequestInfo) -> None:
        self.owner = owner
        self.info = info
        self.items: list[_Item] = []
        self.first_token: float | None = None

    def dispatched(self, info: RequestInfo) -> None:
        self.items = [_Item(envelope) for envelope in info.items]

    def frame(self, index: int, frame: Frame) -> None:
        try:
            item = self.items[index]
            kind = frame["t"]
            if kind == "out" or kind == "end":
                tokens = frame.get("tokens")
                if tokens:
                    item.tokens.extend(tokens)
                    if self.first_token is None:
                        self.first_token = time.monotonic()
                if item.cached is None and len(item.attempts) == 1:
                    cached = frame.get("cached_tokens")
                    if cached is None and kind == "end":
                        cached = (frame.get("usage") or {}).get("cached_tokens")
                    if isinstance(cached, int):
                        item.cached = cached
                if kind == "end":
                    finish = frame.get("finish")
                    reason = finish.get("reason") if isinstance(finish, dict) else None
                    item.finish = reason if isinstance(reason, str) else "unknown"
            elif kind == "ack":
                attempt = item.attempts[-1]
                attempt[1] = frame.get("worker")
                attempt[2] = frame.get("dispatch")
            elif kind == "err":
                item.error = (str(frame.get("code")), str(frame.get("message") or ""))
            elif kind == "mig":
                item.attempts[-1][4] = str(frame.get("reason") or "")
                attempt_no = frame.get("attempt")
                number = attempt_no if isinstance(attempt_no, int) else len(item.attempts) + 1
                item.attempts.append([number, None, None, len(item.tokens), None])
        except Exception:  # a record must never break a request
            log.exception("request records: frame of item %d not recorded", index)

    def finished(self, status: int, error_type: str | None) -> None:
        try:
            self.owner.emit(self.record(status, error_type))
        except Exception:
            self.owner.failed += 1
            log.exception("request records: no record for request %s", self.info.public_id)

    def record(self, status: int, error_type: str | None) -> Record:
        now = time.monotonic()
        info = self.info
        owner = self.owner
        payload = owner.payload
        hashes_of: dict[int, list[str]] = {}  # n > 1 samples share their prompt's list
        items: list[Record] = []
        payload_items: list[Record] = []
        total_in = total_out = total_cached = total_attempts = 0
        for index, item in enumerate(self.items):
            envelope = item.envelope
            prompt = envelope.token_ids
            hashes = hashes_of.get(id(prompt))
            if hashes is None:
                hashes = hashes_of[id(prompt)] = block_hashes(prompt, owner.block_size)
            tokens = item.tokens
            attempts = []
            workers: list[str] = []
            for i, (number, worker, dispatch, start, reason) in enumerate(item.attempts):
                end = item.attempts[i + 1][3] if i + 1 < len(item.attempts) else len(tokens)
                attempt: Record = {
                    "attempt": number,
                    "private_id": attempt_id(envelope.id, number),
                    "worker": worker,
                    "dispatch": dispatch,
                    "output_tokens": end - start,
                }
                if reason is not None:
                    attempt["migration_reason"] = reason
                attempts.append(attempt)
                if worker is not None and worker not in workers:
                    workers.append(worker)
            if item.finish is not None:
                item_error, message = None, None
            elif item.error is not None:
                item_error, message = item.error
            else:  # the handler closed its stream: client gone, another item failed, ...
                item_error, message = CANCELLED, None
            entry: Record = {
                "index": index,
                "private_id": envelope.id,
                "client_id": envelope.client_id,
                "prompt_tokens": len(prompt),
                "prompt_block_hashes": hashes,
                "workers": workers,
                "attempts": attempts,
                "output_tokens": len(tokens),
                "output_hash": output_hash(tokens),
                "finish_reason": item.finish,
                "error_type": item_error,
                "cached_tokens": item.cached,
            }
            if message:
                entry["error_message"] = message
            items.append(entry)
            if payload:
                payload_items.append({"prompt_token_ids": prompt, "output_token_ids": tokens})
            total_in += len(prompt)
            total_out += len(tokens)
            total_cached += item.cached or 0
            total_attempts += len(attempts)
        record: Record = {
            "schema": SCHEMA,
            "event_time_unix_ms": int(time.time() * 1000),
            "record_id": owner.record_id(),
            "namespace": owner.namespace,
            "public_id": info.public_id,
            "client_id": info.client_id,
            "format": info.format,
            "method": info.method,
            "endpoint": info.endpoint,
            "stream": info.stream,
            "status": status,
            "error_type": error_type,
            "timings": {
                "received_unix_ms": math.floor(info.received_unix * 1000),
                "first_token_ms": _ms(self.first_token, info.received_at),
                "end_ms": _ms(now, info.received_at),
            },
            "totals": {
                "items": len(items),
                "input_tokens": total_in,
                "output_tokens": total_out,
                "cached_tokens": total_cached,
                "attempts": total_attempts,
                "migrations": total_attempts - len(items),
            },
            "hashing": owner.hashing,
            "items": items,
        }
        if payload:
            record["payload"] = {
                **_body(info.body),
                "headers": _headers(info.headers),
                "items": payload_items,
            }
        return record


def _ms(at: float | None, since: float) -> float | None:
    return None if at is None else round((at - since) * 1000, 3)


def _body(body: bytes) -> Record:
    try:
        return {"body": body.decode()}
    except UnicodeDecodeError:
        import base64

        return {"body_base64": base64.b64encode(body).decode()}


def _headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    if not headers:
        return {}
    return {name: value for name in REPLAY_HEADERS if (value := headers.get(name)) is not None}


def config_from_env(environ: Mapping[str, str] | None = None) -> RecordsConfig:
    """The configuration from GENMESH_REQUEST_TRACE* (for embedders): the same
    declarations `genmesh frontend --request-trace*` reads."""
    return from_env(RecordsConfig, environ)

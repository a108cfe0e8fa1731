"""The request-records observer: exactly one record per HTTP generate request.

The frontend's handler feeds every observer (`services/frontend/observers.py`): `request` at
arrival, `dispatched` once the items have their private IDs, `frame` for every reply frame
(the client's `mig` frames included) and `finished` exactly once, however the request ends:
answered, refused, failed in-band, cancelled by a client that went away. The record is built
and handed to the sinks in `finished`; per frame this only appends token IDs.

The schema is in `docs/observability.md` ("Request records").
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import secrets
import time
from collections.abc import Mapping

from nats.aio.client import Client

from genmesh.client import MIG, ClientFrame
from genmesh.client.migration import attempt_id
from genmesh.records import SCHEMA
from genmesh.records.config import RecordsConfig
from genmesh.records.hashing import ALGORITHM, DEFAULT_BLOCK_SIZE, block_hashes, output_hash
from genmesh.records.sinks import FileSink, NatsSink, Record, Sink, dump
from genmesh.services.frontend.observers import RequestInfo
from genmesh.shared import frames
from genmesh.shared.envelope import Envelope

log = logging.getLogger(__name__)

# Request headers a format may read, kept in payload records so that a replay sends them.
REPLAY_HEADERS = ("content-type", "x-request-id", "x-request-timeout", "x-data-parallel-rank")
CANCELLED = "cancelled"


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
        async with contextlib.AsyncExitStack() as started:  # closed if a later one fails
            for sink in self.sinks:
                await sink.start()
                started.push_async_callback(sink.close)
            started.pop_all()
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


class _Attempt:
    """One dispatch of a generation, as its record lists it."""

    __slots__ = ("dispatch", "first_token", "number", "reason", "worker")

    def __init__(self, number: int, first_token: int) -> None:
        self.number = number
        self.worker: str | None = None  # from its ack
        self.dispatch: str | None = None
        self.first_token = first_token  # index of its first token in the generation's
        self.reason: str | None = None  # why it failed, if the generation moved on


class _Item:
    """What one generation's frames said."""

    __slots__ = ("attempts", "cached", "envelope", "summary")

    def __init__(self, envelope: Envelope) -> None:
        self.envelope = envelope
        self.summary = frames.Summary(keep_tokens=True)
        self.attempts = [_Attempt(1, 0)]
        # The prompt-cache figure of the first attempt (later ones see a longer prompt),
        # fixed at the first migration.
        self.cached: int | None = None

    @property
    def cached_tokens(self) -> int | None:
        return self.summary.cached_tokens if len(self.attempts) == 1 else self.cached

    def entry(self, index: int, hashes: list[str]) -> Record:
        """This generation's entry in the record's `items`."""
        envelope, summary = self.envelope, self.summary
        tokens = summary.token_ids or []
        error_type: str | None = None
        message: str | None = None
        finish = (summary.finish_reason or "unknown") if summary.finished else None
        if finish is None and summary.error is not None:
            error_type = str(summary.error.get("code"))
            message = str(summary.error.get("message") or "")
        elif finish is None:  # the handler closed its stream: client gone, another item failed
            error_type = CANCELLED
        entry: Record = {
            "index": index,
            "private_id": envelope.id,
            "client_id": envelope.client_id,
            "prompt_tokens": len(envelope.token_ids),
            "prompt_block_hashes": hashes,
            "workers": list(dict.fromkeys(a.worker for a in self.attempts if a.worker)),
            "attempts": self._attempt_entries(len(tokens)),
            "output_tokens": len(tokens),
            "output_hash": output_hash(tokens),
            "finish_reason": finish,
            "error_type": error_type,
            "cached_tokens": self.cached_tokens,
        }
        if message:
            entry["error_message"] = message
        return entry

    def _attempt_entries(self, tokens: int) -> list[Record]:
        entries = []
        for i, attempt in enumerate(self.attempts):
            following = self.attempts[i + 1] if i + 1 < len(self.attempts) else None
            end = tokens if following is None else following.first_token
            entry: Record = {
                "attempt": attempt.number,
                "private_id": attempt_id(self.envelope.id, attempt.number),
                "worker": attempt.worker,
                "dispatch": attempt.dispatch,
                "output_tokens": end - attempt.first_token,
            }
            if attempt.reason is not None:
                entry["migration_reason"] = attempt.reason
            entries.append(entry)
        return entries


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

    def frame(self, index: int, frame: ClientFrame) -> None:
        try:
            item = self.items[index]
            if frame["t"] == MIG:
                if len(item.attempts) == 1:
                    item.cached = item.summary.cached_tokens
                item.attempts[-1].reason = frame["message"]
                item.attempts.append(_Attempt(frame["attempt"], item.summary.tokens))
                return
            if item.summary.add(frame) and self.first_token is None:
                self.first_token = time.monotonic()
            if frame["t"] == frames.ACK:
                item.attempts[-1].worker = item.summary.worker
                item.attempts[-1].dispatch = item.summary.dispatch
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
        hashes_of: dict[int, list[str]] = {}  # n > 1 samples share their prompt's list
        items: list[Record] = []
        for index, item in enumerate(self.items):
            prompt = item.envelope.token_ids
            hashes = hashes_of.get(id(prompt))
            if hashes is None:
                hashes = hashes_of[id(prompt)] = block_hashes(prompt, owner.block_size)
            items.append(item.entry(index, hashes))
        attempts = sum(len(entry["attempts"]) for entry in items)
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
                "input_tokens": sum(entry["prompt_tokens"] for entry in items),
                "output_tokens": sum(entry["output_tokens"] for entry in items),
                "cached_tokens": sum(entry["cached_tokens"] or 0 for entry in items),
                "attempts": attempts,
                "migrations": attempts - len(items),
            },
            "hashing": owner.hashing,
            "items": items,
        }
        if owner.payload:
            record["payload"] = {
                **_body(info.body),
                "headers": _headers(info.headers),
                "items": [
                    {
                        "prompt_token_ids": item.envelope.token_ids.tolist(),
                        "output_token_ids": item.summary.token_ids or [],
                    }
                    for item in self.items
                ],
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

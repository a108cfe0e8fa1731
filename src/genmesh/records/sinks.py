"""Where request records go: a JSONL file (plain, or gzip segments that roll) and NATS.

`emit` runs on the event loop for every finished request and only queues the record, a
line of JSON (serialised once for every sink, and bytes, so that a queue of records costs
the garbage collector nothing). A background task each sink owns writes the queue in
batches (every `flush_interval_s`, or at once when `batch_size` records wait): the file
sink compresses and writes in a thread (`asyncio.to_thread`), the NATS sink publishes.
`close` writes whatever is queued and then closes the output, so a frontend that stops
cleanly loses no record.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import logging
import os
import re
from abc import ABC, abstractmethod
from io import BufferedIOBase
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from genmesh.records.config import DEFAULT_ROLL_MB

if TYPE_CHECKING:
    from nats.aio.client import Client

log = logging.getLogger(__name__)

Record = dict[str, Any]
Line = bytes  # one record: JSON and a newline

GZ_SUFFIX = ".jsonl.gz"
GZ_LEVEL = 3  # half the CPU of gzip's default 6, for files about 10 % larger


class Sink(ABC):
    """Queues records on the event loop; a background task writes them in batches."""

    name = "sink"

    def __init__(self, *, flush_interval_s: float = 0.5, batch_size: int = 512) -> None:
        self.flush_interval_s = flush_interval_s
        self.batch_size = batch_size
        self.written = 0
        self.dropped = 0
        self._pending: list[Line] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._closed = False

    def emit(self, record: Line) -> None:
        if self._closed:
            self.dropped += 1
            log.warning("request record %s arrived after its sink closed; dropped", self.name)
            return
        self._pending.append(record)
        if len(self._pending) >= self.batch_size:
            self._wake.set()

    async def start(self) -> None:
        await self._open()
        self._task = asyncio.create_task(self._run(), name=f"request records: {self.name}")

    async def close(self) -> None:
        """Write every queued record, then close the output."""
        if self._closed:
            return
        self._closing = True
        self._wake.set()
        try:
            if self._task is not None:
                await self._task
        finally:
            self._closed = True
            await self._close_output()
        log.info(
            "request records (%s): %d written, %d dropped", self.name, self.written, self.dropped
        )

    async def _run(self) -> None:
        while True:
            if not self._pending and not self._closing:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.flush_interval_s):
                        await self._wake.wait()
            self._wake.clear()
            batch, self._pending = self._pending, []
            if batch:
                try:
                    written = await self._write(batch)
                except Exception:
                    log.exception("request records (%s): could not write a batch", self.name)
                    written = 0
                self.written += written
                self.dropped += len(batch) - written
            if self._closing and not self._pending:
                return

    async def _open(self) -> None:  # noqa: B027 - optional
        """Prepare the output (fail here, at start-up, on a bad configuration)."""

    @abstractmethod
    async def _write(self, batch: list[Line]) -> int:
        """Write a batch; return how many records were written."""

    async def _close_output(self) -> None:  # noqa: B027 - optional
        """Flush and close the output."""


def dump(record: Record) -> Line:
    """A record as one line of JSON (raises orjson.JSONEncodeError)."""
    return orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)


def gz_stem(path: str | Path) -> str | None:
    """For a `.jsonl.gz` (or `.gz`) path, the stem its segments are named after."""
    text = str(path)
    if text.endswith(GZ_SUFFIX):
        return text[: -len(GZ_SUFFIX)]
    if text.endswith(".gz"):
        return text[:-3]
    return None


def segment_path(stem: str, index: int) -> Path:
    return Path(f"{stem}.{index}{GZ_SUFFIX}")


def segment_index(path: Path) -> int:
    """`n` of a segment `<stem>.<n>.jsonl.gz`."""
    return int(path.name[: -len(GZ_SUFFIX)].rsplit(".", 1)[1])


def segment_paths(stem: str) -> list[Path]:
    """The existing segments `<stem>.<n>.jsonl.gz`, in order of `n`."""
    directory = Path(stem).parent
    pattern = re.compile(re.escape(Path(stem).name) + r"\.(\d+)" + re.escape(GZ_SUFFIX) + "$")
    found: list[tuple[int, Path]] = []
    with contextlib.suppress(FileNotFoundError):
        for entry in directory.iterdir():
            match = pattern.match(entry.name)
            if match:
                found.append((int(match.group(1)), entry))
    return [p for _, p in sorted(found)]


class FileSink(Sink):
    """JSON lines in a file. A `.jsonl.gz` path (or any `.gz`) writes gzip segments
    `<stem>.<n>.jsonl.gz`, numbered on from the segments already there, rolling to the next
    after `roll_bytes` of uncompressed JSON or `roll_lines` records (0 = no limit); any other
    path is one plain file, appended to."""

    def __init__(
        self,
        path: str | Path,
        *,
        roll_bytes: int = int(DEFAULT_ROLL_MB * 1024 * 1024),
        roll_lines: int = 0,
        flush_interval_s: float = 0.5,
        batch_size: int = 512,
    ) -> None:
        super().__init__(flush_interval_s=flush_interval_s, batch_size=batch_size)
        self.path = Path(path)
        self.stem = gz_stem(path)
        self.name = f"file {path}"
        self.roll_bytes = roll_bytes
        self.roll_lines = roll_lines
        self.segment = -1
        self._out: BufferedIOBase | None = None
        self._raw: BufferedIOBase | None = None
        self._bytes = 0
        self._lines = 0

    async def _open(self) -> None:
        await asyncio.to_thread(self._open_sync)

    def _open_sync(self) -> None:
        if self.stem is None:
            self._out = self.path.open("ab")
            return
        directory = self.path.parent
        if not directory.is_dir():
            raise FileNotFoundError(f"request records: no directory {str(directory)!r}")
        if not os.access(directory, os.W_OK):
            raise PermissionError(f"request records: cannot write to {str(directory)!r}")
        existing = segment_paths(self.stem)
        self.segment = segment_index(existing[-1]) if existing else -1
        # The first segment is created with the first record.

    def _next_segment(self) -> BufferedIOBase:
        self._close_segment()
        assert self.stem is not None
        self.segment += 1
        self._raw = segment_path(self.stem, self.segment).open("xb")
        self._out = gzip.GzipFile(fileobj=self._raw, mode="wb", compresslevel=GZ_LEVEL)
        self._bytes = self._lines = 0
        return self._out

    def _close_segment(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None
        if self._raw is not None:
            self._raw.close()
            self._raw = None

    async def _write(self, batch: list[Line]) -> int:
        return await asyncio.to_thread(self._write_sync, batch)

    def _write_sync(self, lines: list[Line]) -> int:
        if self.stem is None:
            assert self._out is not None
            self._out.write(b"".join(lines))
            self._out.flush()
            return len(lines)
        out = self._out
        chunk: list[bytes] = []
        for line in lines:
            if out is None or (
                self._lines
                and (
                    (self.roll_lines and self._lines >= self.roll_lines)
                    or (self.roll_bytes and self._bytes + len(line) > self.roll_bytes)
                )
            ):
                if out is not None and chunk:
                    out.write(b"".join(chunk))
                    chunk = []
                out = self._next_segment()
            chunk.append(line)
            self._lines += 1
            self._bytes += len(line)
        if out is not None:
            if chunk:
                out.write(b"".join(chunk))
            out.flush()  # a sync flush: what is written so far can be read back
        return len(lines)

    async def _close_output(self) -> None:
        await asyncio.to_thread(self._close_sync)

    def _close_sync(self) -> None:
        if self.stem is None:
            if self._out is not None:
                self._out.close()
                self._out = None
            return
        self._close_segment()


class NatsSink(Sink):
    """Publishes each record as JSON on `subject` (`genmesh.<ns>.trace`)."""

    def __init__(
        self, nc: Client, subject: str, *, flush_interval_s: float = 0.1, batch_size: int = 256
    ) -> None:
        super().__init__(flush_interval_s=flush_interval_s, batch_size=batch_size)
        self.nc = nc
        self.subject = subject
        self.name = f"nats {subject}"

    async def _write(self, batch: list[Line]) -> int:
        written = 0
        for line in batch:
            try:
                await self.nc.publish(self.subject, line[:-1])
            except Exception as exc:  # too large for the server, connection closed, ...
                log.error(
                    "request record (%d bytes) not published on %s: %r",
                    len(line),
                    self.subject,
                    exc,
                )
                continue
            written += 1
        return written

    async def _close_output(self) -> None:
        if self.nc.is_connected:
            try:
                from genmesh.shared.bus import flush_in_order  # not for --help's sake

                await flush_in_order(self.nc, timeout=5)
            except Exception as exc:
                log.warning("request records: NATS flush failed: %r", exc)

"""KV events from a real engine's ZMQ publisher (SGLang and vLLM `--kv-events-config`).

Both engines publish with the same `ZmqEventPublisher` (vllm/distributed/kv_events.py,
sglang/srt/disaggregation/kv_events.py): a PUB socket sends each `KVEventBatch` as the
multipart `[topic, seq, payload]`, `seq` an 8-byte big-endian count from 0 per publisher;
an optional ROUTER socket (`replay_endpoint`) answers `[b"", start_seq]` from a DEALER with
`[b"", seq, payload]` for every batch still in its buffer (`buffer_steps`, 10,000 by
default) with seq >= start, then `[b"", -1 (8-byte signed), b""]`.

`ZmqKvEvents` subscribes and hands on decoded batches in the engine's order, starting with
what the replay socket still holds (the engine's history). PUB/SUB drops
messages (a subscriber that joins late, a full queue), so it tracks the engine's seq: a
gap is filled from the replay socket; when that is impossible (no replay endpoint, no
answer, or the buffer no longer holds the missing batches) it hands on an
`AllBlocksCleared` batch, so that routers forget this engine's cache rather than trust a
wrong picture of it, and carries on from what it has. Numbering that starts again (a seq
not above the last one received) means the engine restarted, with an empty cache: the same
clear. A publisher replaced between two of our messages whose seq happens to continue
upwards cannot be told from a gap (the engines' framing has no epoch).

pyzmq is imported when a subscriber starts, so a worker's --help does not load it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from genmesh.shared.kv_events import (
    AllBlocksCleared,
    KvEventBatch,
    KvEventError,
    decode_engine_batch,
)
from genmesh.shared.settings import option

if TYPE_CHECKING:
    import zmq.asyncio

log = logging.getLogger(__name__)

# The replay socket's end-of-replay marker (ZmqEventPublisher.END_SEQ).
END_SEQ = -1
# As the engines' PUB high-water mark: batches the SUB socket queues before dropping.
_RCV_HWM = 100_000


def check_address(flag: str, text: str) -> None:
    """ValueError unless `text` is an address to connect to: the engine binds
    `tcp://*:5557`, a worker connects to `tcp://HOST:5557`. (Checked when the adapter is
    made, not by the option's parser, so that the operator reads why.)"""
    if not text.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"{flag} {text}: a ZMQ address is tcp://HOST:PORT or ipc://PATH")
    if "*" in text:
        raise ValueError(
            f"{flag} {text}: connect to the engine's host, not to * (that is where it binds)"
        )


@dataclass(frozen=True, slots=True)
class ZmqEventsConfig:
    """Where an SGLang/vLLM server publishes its KV events (its `--kv-events-config`)."""

    endpoint: str | None = option(
        None,
        flag="--engine-kv-events",
        help="the engine's KV event publisher (its --kv-events-config endpoint, as "
        "tcp://HOST:5557); unset: the engine's cache is not reported",
    )
    replay_endpoint: str | None = option(
        None,
        flag="--engine-kv-events-replay",
        help="the engine's replay socket (--kv-events-config replay_endpoint, as "
        "tcp://HOST:5558), to fetch missed batches; without it a gap clears the cache view",
    )
    topic: str = option(
        "", flag="--engine-kv-events-topic", help="the publisher's topic (--kv-events-config topic)"
    )
    # Seconds the replay socket may stay silent before a replay counts as failed.
    replay_timeout_s: float = 2.0


def _cleared() -> KvEventBatch:
    return KvEventBatch(time.time(), [AllBlocksCleared()])


class ZmqKvEvents:
    """One engine's KV events over ZMQ; `batches()` iterates them until `close()`."""

    def __init__(self, config: ZmqEventsConfig) -> None:
        if config.endpoint is None:
            raise ValueError("ZmqKvEvents needs the engine's KV event endpoint")
        check_address("--engine-kv-events", config.endpoint)
        if config.replay_endpoint is not None:
            check_address("--engine-kv-events-replay", config.replay_endpoint)
        self.config = config
        self._ctx: zmq.asyncio.Context | None = None
        # The next engine seq to hand on, and the last seq the SUB socket delivered.
        self._expected = 0
        self._last_received = -1

    async def batches(self) -> AsyncGenerator[KvEventBatch, None]:
        """The engine's batches in its order, with an `AllBlocksCleared` batch wherever
        some were lost for good."""
        import zmq
        import zmq.asyncio

        self._expected, self._last_received = 0, -1  # a new subscription knows nothing yet
        self._ctx = ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.rcvhwm = _RCV_HWM
        sub.linger = 0
        sub.setsockopt(zmq.SUBSCRIBE, self.config.topic.encode())
        sub.connect(self.config.endpoint or "")
        try:
            for batch in await self._history():
                yield batch
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    log.warning("KV events: ignoring a message of %d frames", len(frames))
                    continue
                seq = int.from_bytes(frames[1], "big")
                for batch in await self._accept(seq, frames[2]):
                    yield batch
        except (asyncio.CancelledError, zmq.ZMQError):
            # Closing the sockets under a pending receive (or replay) cancels it: that is
            # close() ending the subscription, unless our own task is being cancelled.
            task = asyncio.current_task()
            if self._ctx is not ctx and not (task and task.cancelling()):
                return
            raise
        finally:
            self.close()

    def close(self) -> None:
        """Close the sockets; a running `batches()` ends."""
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    async def _history(self) -> list[KvEventBatch]:
        """What the engine published before we subscribed, as far as its replay socket
        still holds it: a worker that starts (or restarts) beside a running engine learns
        its cache at once, not at the engine's next batch. What the SUB socket then
        delivers again is skipped by its seq."""
        replayed = await self._replay(0) or []
        out: list[KvEventBatch] = []
        if replayed and replayed[0][0] != 0:  # older batches are gone
            out.append(_cleared())
            self._expected = replayed[0][0]
        out.extend(self._in_order(replayed))
        return out

    async def _accept(self, seq: int, payload: bytes) -> list[KvEventBatch]:
        """What to hand on, now that the SUB socket delivered batch `seq`."""
        out: list[KvEventBatch] = []
        if seq <= self._last_received:
            log.warning(
                "KV events from %s start again at seq %d (after %d): the engine restarted; "
                "its cache is reported empty",
                self.config.endpoint,
                seq,
                self._last_received,
            )
            out.append(_cleared())
            self._expected = 0
        self._last_received = seq
        if seq > self._expected:
            out.extend(await self._recover(seq))
        if seq == self._expected:  # else a replay already handed it on
            out.append(self._decode(payload))
            self._expected = seq + 1
        return out

    async def _recover(self, seq: int) -> list[KvEventBatch]:
        """Batches `_expected` up to `seq` went missing: replay them, or report the cache
        cleared and go on from what the replay (or the SUB socket) has."""
        missing = self._expected
        replayed = await self._replay(missing) or []
        out: list[KvEventBatch] = []
        if not replayed or replayed[0][0] != missing:
            log.warning(
                "KV events from %s: batches from seq %d are lost (%s); the engine's cache "
                "is reported cleared until it stores blocks again",
                self.config.endpoint,
                missing,
                "no replay endpoint" if not self.config.replay_endpoint else "not replayed",
            )
            out.append(_cleared())
            self._expected = replayed[0][0] if replayed and replayed[0][0] <= seq else seq
        out.extend(self._in_order(replayed))
        if self._expected < seq:  # the replay stopped short of what the SUB socket has
            out.append(_cleared())
            self._expected = seq
        return out

    def _in_order(self, replayed: list[tuple[int, bytes]]) -> list[KvEventBatch]:
        """The replayed batches that continue from `_expected`, decoded."""
        out: list[KvEventBatch] = []
        for got, payload in replayed:
            if got != self._expected:
                break
            out.append(self._decode(payload))
            self._expected = got + 1
        return out

    async def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """The replay socket's buffered batches from `start` on; None when there is no
        replay socket or it did not answer in time."""
        endpoint = self.config.replay_endpoint
        if endpoint is None or self._ctx is None:
            return None
        import zmq

        # A socket per replay, so a late answer to one that timed out cannot be read as
        # the answer to the next.
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.linger = 0
        dealer.connect(endpoint)
        got: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await dealer.poll(self.config.replay_timeout_s * 1000):
                    log.warning("KV events: the replay socket %s did not answer", endpoint)
                    return None
                frames = await dealer.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    log.warning("KV events: a replay answer of %d frames", len(frames))
                    return None
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq == END_SEQ:
                    return got
                got.append((seq, frames[2]))
        finally:
            dealer.close(linger=0)

    def _decode(self, payload: bytes) -> KvEventBatch:
        try:
            return decode_engine_batch(payload)
        except KvEventError as exc:
            # A batch we cannot read is a batch lost: the picture of the cache is wrong now.
            log.warning("KV events from %s: unreadable batch (%s)", self.config.endpoint, exc)
            return _cleared()

"""KV events from an engine's ZMQ publisher (engines/zmq_events.py), against the testkit's
publisher (testkit/kv_events.py: the engines' `ZmqEventPublisher` framing and replay), over
real TCP sockets: order, gaps filled by replay, and the `AllBlocksCleared` a subscriber
hands on when a gap cannot be filled."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from genmesh.engines import create_engine
from genmesh.engines.http import HttpEngineConfig
from genmesh.engines.mock import MockConfig
from genmesh.engines.sglang import SglangEngine
from genmesh.engines.zmq_events import ZmqEventsConfig, ZmqKvEvents
from genmesh.services.worker.config import WorkerProcessConfig
from genmesh.shared.envelope import TokenIds
from genmesh.shared.kv_events import (
    AllBlocksCleared,
    BlockStored,
    KvEventBatch,
    encode_engine_batch,
)
from genmesh.shared.settings import parse
from genmesh.testkit.kv_events import SglangKvEventsConfig, ZmqEventPublisher
from tests.mesh import free_port

pytestmark = pytest.mark.unit

LOGGER = "genmesh.engines.zmq_events"


def batch(n: int) -> KvEventBatch:
    """Batch number `n`: one stored block whose engine hash is `n`."""
    return KvEventBatch(float(n), [BlockStored([n], None, TokenIds([n] * 4), 4)])


def is_cleared(b: KvEventBatch) -> bool:
    return b.events == [AllBlocksCleared()]


def publisher(**config: object) -> ZmqEventPublisher:
    settings = SglangKvEventsConfig(publisher="zmq", endpoint="tcp://127.0.0.1:*", **config)
    pub = ZmqEventPublisher(settings, encode_engine_batch)
    pub.start()
    return pub


class Subscriber:
    """A subscriber's batches, collected by a task as they come."""

    def __init__(self, pub: ZmqEventPublisher, *, replay: bool = True) -> None:
        self.events = ZmqKvEvents(
            ZmqEventsConfig(
                endpoint=pub.endpoint,
                replay_endpoint=pub.replay_endpoint if replay else None,
                replay_timeout_s=0.5,
            )
        )
        self.got: list[KvEventBatch] = []
        self.arrived = asyncio.Event()
        self._task = asyncio.create_task(self._collect())

    async def _collect(self) -> None:
        async for b in self.events.batches():
            self.got.append(b)
            self.arrived.set()

    async def wait_for(self, count: int) -> list[KvEventBatch]:
        async with asyncio.timeout(10):
            while len(self.got) < count:
                self.arrived.clear()
                await self.arrived.wait()
        return self.got

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


@contextlib.asynccontextmanager
async def joined(
    pub: ZmqEventPublisher, *, replay: bool = True, close: bool = True
) -> AsyncIterator[Subscriber]:
    """A subscriber that has received at least one batch: a SUB socket misses what is
    published before it connects (ZMQ's slow joiner), so batches go out until one
    arrives. The publisher is closed after it unless `close` is False."""
    sub = Subscriber(pub, replay=replay)
    try:
        async with asyncio.timeout(10):
            while not sub.got:
                pub.publish(batch(pub.published))
                await asyncio.sleep(0.02)
        yield sub
    finally:
        await sub.close()
        if close:
            await pub.close()


async def test_a_late_subscriber_gets_every_batch_in_order_from_the_replay() -> None:
    pub = publisher(replay_endpoint="tcp://127.0.0.1:*")
    for n in range(3):  # before anyone listens
        pub.publish(batch(n))
    async with joined(pub) as sub:
        total = pub.published
        for n in range(total, total + 3):
            pub.publish(batch(n))
        got = await sub.wait_for(total + 3)
        await asyncio.sleep(0.1)  # nothing more (no duplicates) arrives
    assert sub.got == [batch(n) for n in range(total + 3)]
    assert got[0] == batch(0)


async def test_a_subscriber_starts_with_the_history_the_replay_socket_holds() -> None:
    pub = publisher(replay_endpoint="tcp://127.0.0.1:*", buffer_steps=2)
    for n in range(3):  # batch 0 is no longer kept
        pub.publish(batch(n))
    sub = Subscriber(pub)
    try:
        got = await sub.wait_for(3)  # without any new batch
    finally:
        await sub.close()
        await pub.close()
    assert is_cleared(got[0])
    assert got[1:] == [batch(1), batch(2)]


async def test_a_gap_is_filled_from_the_replay_socket(caplog: pytest.LogCaptureFixture) -> None:
    pub = publisher(replay_endpoint="tcp://127.0.0.1:*")
    async with joined(pub) as sub:
        start = pub.published
        pub.drop = 2  # the next two never reach the SUB socket
        for n in range(start, start + 3):
            pub.publish(batch(n))
        await sub.wait_for(start + 3)
    assert sub.got[-3:] == [batch(start), batch(start + 1), batch(start + 2)]
    assert not any(is_cleared(b) for b in sub.got)
    assert not [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


async def test_a_gap_without_a_replay_socket_clears_the_cache_view(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pub = publisher()  # no replay_endpoint
    endpoint = pub.endpoint
    async with joined(pub, replay=False) as sub:
        seen = len(sub.got)
        start = pub.published
        pub.drop = 1
        pub.publish(batch(start))
        pub.publish(batch(start + 1))
        await sub.wait_for(seen + 2)
    assert is_cleared(sub.got[seen])
    assert sub.got[seen + 1] == batch(start + 1)
    assert len(sub.got) == seen + 2
    warned = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert (
        f"KV events from {endpoint}: batches from seq {start} are lost (no replay "
        "endpoint); the engine's cache is reported cleared until it stores blocks again"
    ) in warned


async def test_a_gap_the_replay_buffer_no_longer_holds_clears_the_cache_view(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # buffer_steps=2: the replay socket keeps the last two batches only.
    pub = publisher(replay_endpoint="tcp://127.0.0.1:*", buffer_steps=2)
    endpoint = pub.endpoint
    async with joined(pub) as sub:
        seen = len(sub.got)
        start = pub.published
        pub.drop = 3
        for n in range(start, start + 4):
            pub.publish(batch(n))
        await sub.wait_for(seen + 3)
    # Lost for good: start; replayed: start + 2 (start + 1 fell out of the buffer too).
    assert is_cleared(sub.got[seen])
    assert sub.got[seen + 1 :] == [batch(start + 2), batch(start + 3)]
    assert (
        f"KV events from {endpoint}: batches from seq {start} are lost (not replayed); "
        "the engine's cache is reported cleared until it stores blocks again"
    ) in [r.getMessage() for r in caplog.records if r.name == LOGGER]


async def test_numbering_that_starts_again_is_an_engine_restart(tmp_path: Path) -> None:
    # An ipc:// endpoint is bound (the engines' heuristic) and can be bound again by the
    # restarted publisher, which numbers from 0 again.
    config = SglangKvEventsConfig(publisher="zmq", endpoint=f"ipc://{tmp_path}/kv")
    first = ZmqEventPublisher(config, encode_engine_batch)
    first.start()
    async with joined(first, replay=False, close=False) as sub:
        assert first.published > 1  # a restart at 0 goes back
        await first.close()
        second = ZmqEventPublisher(config, encode_engine_batch)
        second.start()
        try:
            seen = len(sub.got)
            async with asyncio.timeout(10):
                while len(sub.got) == seen:  # the SUB socket reconnects on its own
                    second.publish(batch(100 + second.published))
                    await asyncio.sleep(0.05)
        finally:
            await second.close()
    restarted = sub.got[seen:]
    assert is_cleared(restarted[0])
    last = restarted[-1].events[0]
    assert isinstance(last, BlockStored)
    assert last.block_hashes[0] >= 100  # type: ignore[operator]


async def test_a_new_subscription_starts_afresh_from_the_history() -> None:
    # As when a worker's relay stops and starts again on the same adapter.
    pub = publisher(replay_endpoint="tcp://127.0.0.1:*")
    for n in range(3):
        pub.publish(batch(n))
    try:
        for _ in range(2):
            history = [batch(n) for n in range(pub.published)]
            sub = Subscriber(pub)
            try:
                assert await sub.wait_for(len(history)) == history
                async with asyncio.timeout(10):
                    while len(sub.got) == len(history):  # until the SUB socket has joined
                        pub.publish(batch(pub.published))
                        await asyncio.sleep(0.02)
                got = await sub.wait_for(pub.published)
            finally:
                await sub.close()
            # Nothing cleared, nothing twice: what it missed joining came from the replay.
            assert got == [batch(n) for n in range(pub.published)]
    finally:
        await pub.close()


async def test_close_ends_the_iteration_even_while_a_replay_waits() -> None:
    pub = publisher()
    # Nobody answers on this replay address: the subscriber waits there from the start.
    silent = f"tcp://127.0.0.1:{free_port()}"
    events = ZmqKvEvents(
        ZmqEventsConfig(endpoint=pub.endpoint, replay_endpoint=silent, replay_timeout_s=30)
    )
    got: list[KvEventBatch] = []

    async def collect() -> None:
        async for b in events.batches():
            got.append(b)

    task = asyncio.create_task(collect())
    try:
        await asyncio.sleep(0.2)
        assert not task.done()
        events.close()
        await asyncio.wait_for(task, 2)  # ends, without an error, long before 30 s
    finally:
        task.cancel()
        await pub.close()
    assert got == []


async def test_the_adapter_subscribes_when_given_the_endpoint_and_closes_with_it() -> None:
    pub = publisher()
    config = ZmqEventsConfig(endpoint=pub.endpoint)
    engine = SglangEngine(HttpEngineConfig("http://127.0.0.1:1", kv_events=config))
    batches = engine.kv_events()
    assert batches is not None
    got: list[KvEventBatch] = []

    async def collect() -> None:
        async for b in batches:
            got.append(b)

    task = asyncio.create_task(collect())
    try:
        async with asyncio.timeout(10):
            while not got:
                pub.publish(batch(pub.published))
                await asyncio.sleep(0.02)
        await engine.close()  # closes the sockets: the iteration ends
        await asyncio.wait_for(task, 5)
    finally:
        task.cancel()
        await pub.close()
    assert SglangEngine(HttpEngineConfig("http://127.0.0.1:1")).kv_events() is None


def test_the_worker_options_and_their_refusals() -> None:
    config = parse(
        WorkerProcessConfig,
        [
            "--engine", "sglang", "--engine-url", "http://gpu1:30000",
            "--engine-kv-events", "tcp://gpu1:5557",
            "--engine-kv-events-replay", "tcp://gpu1:5558",
            "--engine-kv-events-topic", "kv",
        ],
    )  # fmt: skip
    assert config.kv_events == ZmqEventsConfig("tcp://gpu1:5557", "tcp://gpu1:5558", "kv")
    sglang = "http://gpu1:30000"
    with pytest.raises(ValueError, match=r"^--engine-kv-events ") as bound:
        create_engine("sglang", url=sglang, kv_events=ZmqEventsConfig("tcp://*:5557"))
    assert str(bound.value) == (
        "--engine-kv-events tcp://*:5557: connect to the engine's host, not to * "
        "(that is where it binds)"
    )
    with pytest.raises(ValueError, match=r"^--engine-kv-events-replay ") as scheme:
        create_engine("vllm", url=sglang, kv_events=ZmqEventsConfig("tcp://gpu1:5557", "gpu1:5558"))
    assert str(scheme.value) == (
        "--engine-kv-events-replay gpu1:5558: a ZMQ address is tcp://HOST:PORT or ipc://PATH"
    )
    with pytest.raises(ValueError, match=r"^--engine-kv-events") as mock:
        create_engine("mock", mock=MockConfig(), kv_events=ZmqEventsConfig("tcp://h:5557"))
    assert str(mock.value) == (
        "--engine-kv-events is for an SGLang/vLLM server; the mock engine reports its own cache"
    )

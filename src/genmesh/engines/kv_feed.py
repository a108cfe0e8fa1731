"""An in-process engine's KV events as `Engine.kv_events()` streams them: one batch per
scheduler step, to every subscriber.

vLLM's scheduler takes its block pool's events once per step and publishes them as one
`KVEventBatch` (vllm/v1/core/sched/scheduler.py, `update_from_output`, then
vllm/distributed/kv_events.py `ZmqEventPublisher`); the mock's `BlockPool` hands over each
step's events (`on_step`: a step is an event-loop turn). Like a ZMQ PUB socket, a feed
drops what happens while nobody subscribes.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from genmesh.shared.kv_events import KvEvent, KvEventBatch

if TYPE_CHECKING:
    pass


class KvEventFeed:
    def __init__(self) -> None:
        self._subscribers: set[KvEventSubscription] = set()

    def publish(self, events: list[KvEvent]) -> None:
        """A `BlockPool`'s `on_step`: one step's events, as one batch to every subscriber."""
        if not self._subscribers:
            return
        batch = KvEventBatch(time.time(), events)
        for subscription in self._subscribers:
            subscription.queue.put_nowait(batch)

    def subscribe(self) -> KvEventSubscription:
        """Every batch from now on, until `aclose`."""
        subscription = KvEventSubscription(self._subscribers)
        self._subscribers.add(subscription)
        return subscription


class KvEventSubscription:
    """An async iterator of batches. Its queue is unbounded: a relay takes each batch as
    it comes (publishing on NATS never waits), and a mock's cache changes no faster than
    its requests run."""

    def __init__(self, subscribers: set[KvEventSubscription]) -> None:
        self.queue: asyncio.Queue[KvEventBatch] = asyncio.Queue()
        self._subscribers = subscribers

    def __aiter__(self) -> KvEventSubscription:
        return self

    async def __anext__(self) -> KvEventBatch:
        return await self.queue.get()

    async def aclose(self) -> None:
        self._subscribers.discard(self)

"""The workers' KV events into the `kv` policy's index, in order, resynced after a gap.

`KvSequencer` applies each worker's `KvEventsMessage`s in `seq` order (docs/protocol.md,
"KV events"):

- the next number (last + 1) is applied;
- an older one, or one already applied, is a duplicate and dropped;
- `seq` 1 after later ones: the worker's relay started again (a worker restarted under
  the same `--worker-id`), so its cache is new: cleared, then applied;
- any other number (a gap: messages were lost; or a first message after 1 from a worker
  this router has no state for) starts a resync: the worker's snapshot is fetched
  (`KvSubscriber.snapshot`) in an owned task, at most one per worker, while that worker's
  live messages are buffered; the snapshot replaces what the index held for it, buffered
  messages after the snapshot's `seq` are applied on top, and a gap among them resyncs
  again. A worker that answers no snapshot, twice (a relay without one, or gone), is followed
  from its live messages from then on, its index emptied first: blocks whose parent
  was stored before are skipped (`KvIndex`), so it fills again as it stores.

`KvSubscriber` is the NATS side, one per process routing with `kv` and `--kv-events on`:
it subscribes `genmesh.<ns>.kv.*`, fetches snapshot pages, and forgets a worker that
leaves discovery (index, predictions and sequence state; messages from workers
discovery does not know are ignored, and resync once it does).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from genmesh.codecs import CodecError, UnknownCodecError, get_codec
from genmesh.routing.kv_index import KvIndex
from genmesh.routing.kv_policy import KvPolicy
from genmesh.shared.bus import (
    check_subscriptions,
    codec_headers,
    message_codec,
    unsubscribe_quietly,
)
from genmesh.shared.discovery import WorkerDirectory, WorkerInfo
from genmesh.shared.kv_events import BlockStored, KvEventError, KvEventsMessage, KvSnapshotPage
from genmesh.shared.subjects import Subjects
from genmesh.shared.tasks import TaskOwner

log = logging.getLogger(__name__)

# Seconds to wait for each snapshot page.
SNAPSHOT_PAGE_TIMEOUT_S = 2.0
# Tries at a snapshot before following the worker's live events alone: a second one gets
# past a snapshot that expired between its pages (the relay refuses the page; a new
# snapshot is asked for).
SNAPSHOT_ATTEMPTS = 2

# A worker's cache as of message `seq`, parents first.
Snapshot = tuple[int, list[BlockStored]]
SnapshotSource = Callable[[str], Awaitable[Snapshot]]


@dataclass(slots=True)
class _Feed:
    last: int = 0  # the last message applied (0: none)
    resync: asyncio.Task[None] | None = None
    buffered: list[KvEventsMessage] = field(default_factory=list)


class KvSequencer:
    """Applies workers' KV event messages to `index` in order (see the module's doc)."""

    def __init__(self, index: KvIndex, snapshot: SnapshotSource) -> None:
        self.index = index
        self.snapshot = snapshot
        self._feeds: dict[str, _Feed] = {}
        self._tasks = TaskOwner("kv events")
        self.resyncs = 0
        self.resync_failures = 0

    def receive(self, message: KvEventsMessage) -> None:
        worker = message.worker
        feed = self._feeds.get(worker)
        if feed is None:
            feed = self._feeds[worker] = _Feed()
        if feed.resync is not None:
            feed.buffered.append(message)
        elif message.seq == feed.last + 1:
            self.index.apply(worker, message.events)
            feed.last = message.seq
        elif message.seq == 1:
            log.info("worker %s numbers its KV events from 1 again; its cache is new", worker)
            self.index.clear(worker)
            self.index.apply(worker, message.events)
            feed.last = 1
        elif message.seq > feed.last:
            log.info(
                "worker %s: KV events message %d after %d; resyncing",
                worker,
                message.seq,
                feed.last,
            )
            feed.buffered.append(message)
            feed.resync = self._tasks.spawn(self._resync(worker, feed), name=f"resync {worker}")
        # else: a duplicate, or older than what was applied: nothing to do

    def resyncing(self, worker: str) -> bool:
        feed = self._feeds.get(worker)
        return feed is not None and feed.resync is not None

    def last_applied(self, worker: str) -> int:
        feed = self._feeds.get(worker)
        return 0 if feed is None else feed.last

    def drop(self, worker: str) -> None:
        """Forget `worker`'s sequence (it left); a resync under way is cancelled."""
        feed = self._feeds.pop(worker, None)
        if feed is not None and feed.resync is not None:
            feed.resync.cancel()

    async def close(self) -> None:
        await self._tasks.close()

    async def _resync(self, worker: str, feed: _Feed) -> None:
        try:
            while True:
                self.resyncs += 1
                try:
                    seq, events = await self._fetch(worker)
                except Exception as exc:
                    self.resync_failures += 1
                    log.warning(
                        "worker %s: no KV snapshot (%s); following its live events only",
                        worker,
                        exc or type(exc).__name__,
                    )
                    self.index.clear(worker)
                    self._drain(worker, feed, follow_gaps=True)
                    return
                self.index.clear(worker)
                self.index.apply(worker, events)
                feed.last = seq
                if self._drain(worker, feed, follow_gaps=False):
                    log.info("worker %s: KV index resynced as of message %d", worker, feed.last)
                    return
        finally:
            feed.resync = None

    async def _fetch(self, worker: str) -> Snapshot:
        for _ in range(SNAPSHOT_ATTEMPTS - 1):
            try:
                return await self.snapshot(worker)
            except Exception as exc:
                log.info("worker %s: KV snapshot failed (%s); asking again", worker, exc)
        return await self.snapshot(worker)

    def _drain(self, worker: str, feed: _Feed, *, follow_gaps: bool) -> bool:
        """Apply the buffered messages after `feed.last` in order; False (the rest kept)
        at a gap, unless `follow_gaps`."""
        pending = sorted(feed.buffered, key=lambda m: m.seq)
        feed.buffered = []
        for position, message in enumerate(pending):
            if message.seq <= feed.last:
                continue
            if message.seq != feed.last + 1 and not follow_gaps:
                feed.buffered = pending[position:]
                return False
            self.index.apply(worker, message.events)
            feed.last = message.seq
        return True


class KvSubscriber:
    """The `kv` policy's link to the mesh: KV events in, departures out."""

    def __init__(
        self, nc: Client, subjects: Subjects, directory: WorkerDirectory, policy: KvPolicy
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.directory = directory
        self.policy = policy
        self.sequencer = KvSequencer(policy.index, self.snapshot)
        self.messages = 0  # KV event messages received (from known workers or not)
        self._sub: Subscription | None = None
        self._codec = get_codec(None)

    async def start(self) -> None:
        self.directory.on_change(self._on_directory_change)
        if self.policy.follows_events:
            self._sub = await self.nc.subscribe(self.subjects.kv_events_all, cb=self._on_message)
            await check_subscriptions(self.nc, self._sub)

    async def close(self) -> None:
        await unsubscribe_quietly(self._sub)
        self._sub = None
        await self.sequencer.close()

    def _on_directory_change(self, event: str, worker: WorkerInfo) -> None:
        # A draining worker is out of the directory too: it takes no more requests.
        if event in ("removed", "draining"):
            self.sequencer.drop(worker.id)
            self.policy.forget(worker.id)

    async def _on_message(self, msg: Msg) -> None:
        self.messages += 1
        try:
            message = KvEventsMessage.from_wire(message_codec(msg).decode(msg.data))
        except (UnknownCodecError, CodecError, KvEventError) as exc:
            log.info("ignored unreadable KV events message on %s: %s", msg.subject, exc)
            return
        if message.worker in self.directory.workers:
            self.sequencer.receive(message)

    async def snapshot(self, worker: str) -> Snapshot:
        """`worker`'s cache from its snapshot pages, all of one frozen snapshot."""
        subject = self.subjects.worker_kv_snapshot(worker)
        first = await self._page(subject, None, 0)
        events = list(first.events)
        for page in range(1, first.pages):
            events.extend((await self._page(subject, first.snapshot, page)).events)
        return first.seq, events

    async def _page(self, subject: str, snapshot: str | None, page: int) -> KvSnapshotPage:
        reply = await self.nc.request(
            subject,
            self._codec.encode({"snapshot": snapshot, "page": page}),
            timeout=SNAPSHOT_PAGE_TIMEOUT_S,
            headers=codec_headers(self._codec),
        )
        answer = KvSnapshotPage.from_wire(message_codec(reply).decode(reply.data))
        if answer.page != page or (snapshot is not None and answer.snapshot != snapshot):
            raise KvEventError(f"asked for page {page} of {snapshot}, got {answer.page}")
        return answer


def kv_subscriber(
    policy: object, nc: Client, subjects: Subjects, directory: WorkerDirectory
) -> KvSubscriber | None:
    """The subscriber a process routing with `policy` runs beside it (None: no `kv`)."""
    return KvSubscriber(nc, subjects, directory, policy) if isinstance(policy, KvPolicy) else None


class KvCollector(Collector):
    """The `kv` policy's state as Prometheus metrics (`genmesh_kv_*`), read at scrape time;
    registered by routers and frontends that route with `kv` (docs/observability.md)."""

    def __init__(self, subscriber: KvSubscriber) -> None:
        self.subscriber = subscriber

    def collect(self) -> Iterator[Metric]:
        subscriber = self.subscriber
        index, sequencer = subscriber.policy.index, subscriber.sequencer
        yield GaugeMetricFamily(
            "genmesh_kv_index_blocks",
            "Distinct KV blocks the workers' events say at least one worker holds",
            value=index.keys_held,
        )
        yield GaugeMetricFamily(
            "genmesh_kv_predicted_blocks",
            "Distinct KV blocks predicted cached on workers without KV events",
            value=subscriber.policy.predicted.keys_held,
        )
        for name, text, value in (
            ("messages", "KV event messages received", subscriber.messages),
            ("resyncs", "Snapshots fetched after a gap in a worker's messages", sequencer.resyncs),
            (
                "resync_failures",
                "Resyncs given up (no snapshot twice): the worker followed from live events",
                sequencer.resync_failures,
            ),
            ("orphans", "Stored events skipped: their parent block unknown", index.orphans),
        ):
            yield CounterMetricFamily(f"genmesh_kv_{name}", text, value=value)

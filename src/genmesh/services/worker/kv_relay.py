"""The worker's KV event relay (docs/protocol.md §13): its engine's KV cache events onto
NATS, numbered, and snapshots of the cache for routers that missed some.

Engine-agnostic: it reads `Engine.kv_events()`, which the mock feeds from its own cache
and the SGLang/vLLM adapters from their engine's ZMQ publisher. Each engine batch becomes
one `KvEventsMessage` on `genmesh.<ns>.kv.<wid>`, numbered 1, 2, ... for the life of the
worker process. A message that cannot be sent (NATS is away, its buffer full) is lost but
still numbered, so routers see the gap and resync from the snapshot, which the mirror
keeps whatever NATS does.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from genmesh.codecs import Codec, CodecError, UnknownCodecError, get_codec
from genmesh.services.worker.kv_mirror import KvMirror
from genmesh.shared.bus import codec_headers, message_codec, publish
from genmesh.shared.kv_events import BlockStored, KvEventBatch, KvEventsMessage, KvSnapshotPage
from genmesh.shared.micro import MicroEndpoint
from genmesh.shared.subjects import Subjects

log = logging.getLogger(__name__)

# The estimated encoded size of a snapshot page at most: NATS's default max payload is
# 1 MiB, and a page must stay well below whatever a server is configured with.
PAGE_BYTES = 256 * 1024
# A frozen snapshot is kept this long after its last page was asked for, and at most this
# many at once (the oldest goes first): enough for a few routers resyncing at once.
SNAPSHOT_TTL_S = 30.0
MAX_SNAPSHOTS = 8


class SnapshotRefused(ValueError):
    """A snapshot request this worker cannot answer with a page (the message says why)."""


@dataclass(slots=True)
class _Frozen:
    id: str
    seq: int
    pages: list[list[BlockStored]]
    expires: float


class KvRelay:
    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        worker_id: str,
        events: AsyncIterator[KvEventBatch],
    ) -> None:
        self.nc = nc
        self.worker_id = worker_id
        self.subject = subjects.kv_events(worker_id)
        self.snapshot_subject = subjects.worker_kv_snapshot(worker_id)
        self._events = events
        self._codec = get_codec(None)
        # The last message's number (0: none yet) and the cache as of it.
        self.seq = 0
        self.mirror = KvMirror()
        self._snapshots: OrderedDict[str, _Frozen] = OrderedDict()
        self._latest: _Frozen | None = None
        self._sending = True  # whether the last publish went out (to log changes once)

    async def subscribe(self, micro: MicroEndpoint) -> Subscription:
        """Answer snapshot requests, each counted by `micro` (`$SRV`; the caller
        unsubscribes it)."""
        return await self.nc.subscribe(self.snapshot_subject, cb=micro.counted(self._on_snapshot))

    async def run(self) -> None:
        """Relay every batch of the engine's until cancelled or the engine's stream ends."""
        try:
            async for batch in self._events:
                await self._relay(batch)
            log.warning("worker %s: the engine's KV event stream ended", self.worker_id)
        finally:
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _relay(self, batch: KvEventBatch) -> None:
        # Numbered and mirrored before the first await: a snapshot taken while this
        # message is being sent already holds it, and says so by its seq.
        self.seq += 1
        self.mirror.apply(batch.events)
        message = KvEventsMessage(self.worker_id, self.seq, batch.ts, batch.events)
        try:
            await publish(self.nc, self.subject, self._codec, message.to_wire())
        except Exception as exc:
            if self._sending:
                log.warning(
                    "worker %s: KV events not sent from seq %d on (%s); routers will resync",
                    self.worker_id,
                    self.seq,
                    exc,
                )
            self._sending = False
            return
        if not self._sending:
            log.info("worker %s: KV events sent again from seq %d", self.worker_id, self.seq)
            self._sending = True

    # -- snapshots ---------------------------------------------------------------------

    async def _on_snapshot(self, msg: Msg) -> None:
        if not msg.reply:
            return
        codec: Codec
        try:
            codec = message_codec(msg)
        except UnknownCodecError:
            codec = get_codec("json")  # what any client can read
        try:
            # Pages hold bytes (packed tokens, maybe hashes): JSON cannot carry them.
            data = codec.encode((await self.page(codec.decode(msg.data))).to_wire())
        except (CodecError, SnapshotRefused) as exc:
            data = codec.encode({"worker": self.worker_id, "error": str(exc)})
        await self.nc.publish(msg.reply, data, headers=codec_headers(codec))

    async def page(self, request: Any) -> KvSnapshotPage:
        """The page a request `{"snapshot": null | id, "page": k}` asks for: of a new
        snapshot (the cache as of message `seq`) when `snapshot` is null, else of that
        one, frozen, so that pages read one after another cannot tear."""
        snapshot = request.get("snapshot") if isinstance(request, dict) else None
        page = request.get("page", 0) if isinstance(request, dict) else None
        if (
            not isinstance(request, dict)
            or not (snapshot is None or isinstance(snapshot, str))
            or not isinstance(page, int)
            or isinstance(page, bool)
            or page < 0
        ):
            raise SnapshotRefused(
                'a snapshot request is {"snapshot": null or a snapshot id, "page": an integer >= 0}'
            )
        now = time.monotonic()
        self._forget_expired(now)
        frozen = await self._freeze() if snapshot is None else self._snapshots.get(snapshot)
        if frozen is None:
            raise SnapshotRefused(
                f"no snapshot {snapshot} (expired, or never made here): ask for a new one"
            )
        if page >= len(frozen.pages):
            raise SnapshotRefused(
                f"snapshot {frozen.id} has {len(frozen.pages)} pages; there is no page {page}"
            )
        frozen.expires = now + SNAPSHOT_TTL_S
        self._snapshots.move_to_end(frozen.id)
        return KvSnapshotPage(
            self.worker_id, frozen.id, frozen.seq, page, len(frozen.pages), frozen.pages[page]
        )

    async def _freeze(self) -> _Frozen:
        """A snapshot of the cache as of now; the last one again if nothing happened since
        (routers resyncing together after an outage share one). Paged in a thread: a
        large cache takes a few hundred ms (65,536 blocks: benchmarks/bench_kv_cache.py),
        which the event loop, streaming tokens, must not wait for."""
        latest = self._latest
        if latest is not None and latest.seq == self.seq and latest.id in self._snapshots:
            return latest
        seq, cache = self.seq, self.mirror.copy()
        pages = await asyncio.to_thread(cache.pages, PAGE_BYTES)
        frozen = _Frozen(secrets.token_hex(8), seq, pages, time.monotonic() + SNAPSHOT_TTL_S)
        self._snapshots[frozen.id] = frozen
        while len(self._snapshots) > MAX_SNAPSHOTS:
            self._snapshots.popitem(last=False)
        self._latest = frozen
        return frozen

    def _forget_expired(self, now: float) -> None:
        # Least recently asked first: stop at the first one still alive.
        while self._snapshots:
            oldest = next(iter(self._snapshots.values()))
            if oldest.expires > now:
                break
            del self._snapshots[oldest.id]

"""The live set of workers (and routers), kept from their announcements (`docs/protocol.md`,
"Discovery").

Workers announce a card at start, on every load change (coalesced) and every heartbeat
interval; they publish `leave` when they stop cleanly. A worker whose announcements stop
(SIGKILL, partition) is dropped after `EXPIRY_HEARTBEATS` missed heartbeats. A directory
that starts late asks every worker to announce at once, so it is complete within a round
trip instead of a heartbeat interval. Routers announce their presence the same way, so a
frontend can tell whether anything would route its requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from genmesh.codecs import CodecError, UnknownCodecError, get_codec
from genmesh.shared.bus import (
    check_subscriptions,
    message_codec,
    on_reconnect,
    publish,
    unsubscribe_quietly,
)
from genmesh.shared.cards import (
    DEFAULT_HEARTBEAT_S,
    MAX_COUNT,
    MAX_MESSAGE_BYTES,
    MAX_ROUTERS,
    MAX_WORKERS,
    ROLE_BOTH,
    card_fault,
    presence_fault,
)
from genmesh.shared.engine_info import EngineInfo
from genmesh.shared.subjects import Subjects
from genmesh.shared.tasks import TaskOwner
from genmesh.shared.throttled_log import ThrottledLog

log = logging.getLogger(__name__)

EXPIRY_HEARTBEATS = 3.0


@dataclass(slots=True)
class WorkerInfo:
    id: str
    # Where its requests go: derived from the id (`Subjects.worker_generate`), never the
    # card's `subject`, which anyone who may announce could point anywhere.
    subject: str
    card: dict[str, Any]
    last_seen: float
    inflight: int
    capacity: int
    # Requests this process sent since the worker's last load report: load it cannot see yet.
    sent_since_report: int = 0
    # Requests this process sent that have not ended: known only where the ends are seen
    # (a frontend that routes itself; a router forwards and never sees one end).
    open_here: int = 0
    expires_after: float = field(default=EXPIRY_HEARTBEATS * DEFAULT_HEARTBEAT_S)
    # The card's `engine_info`, parsed when it changes.
    engine_info: EngineInfo | None = None
    # Its last load report's admitted requests the engine has not started yet, and its KV
    # blocks held by running requests out of all it has (None: not announced).
    queued: int = 0
    kv_blocks_used: int | None = None
    kv_blocks_total: int | None = None
    # The prompt blocks of the requests sent since that report (counted only where a KV
    # threshold needs them: routing/busy.py).
    kv_blocks_sent: int = 0

    @property
    def load(self) -> int:
        return self.inflight + self.sent_since_report

    @property
    def full(self) -> bool:
        return self.load >= self.capacity

    @property
    def model(self) -> str | None:
        model = self.card.get("model")
        return model if isinstance(model, str) else None

    @property
    def role(self) -> str:
        """`both`, `prefill` or `decode` (docs/disaggregation.md); `both` if unannounced."""
        role = self.card.get("role")
        return role if isinstance(role, str) else ROLE_BOTH

    @property
    def disagg(self) -> dict[str, Any] | None:
        """The card's `disagg` facts (its engine's P/D `kind`, and what a decode worker
        needs to pair with it); None if the worker cannot take part in P/D."""
        facts = self.card.get("disagg")
        return facts if isinstance(facts, dict) else None

    def serves(self, fmt: str) -> bool:
        formats = self.card.get("formats")
        if not isinstance(formats, list):
            return True
        return "*" in formats or fmt in formats


Listener = Callable[[str, WorkerInfo], None]
# Told after every card a worker announces (its load report), and after membership changes.
ReportListener = Callable[[], None]


class WorkerDirectory:
    def __init__(self, nc: Client, subjects: Subjects) -> None:
        self.nc = nc
        self.subjects = subjects
        self.workers: dict[str, WorkerInfo] = {}
        # Router id -> (last seen, seconds it may stay silent).
        self.routers: dict[str, tuple[float, float]] = {}
        self._listeners: list[Listener] = []
        self._report_listeners: list[ReportListener] = []
        self._sub: Subscription | None = None
        self._tasks = TaskOwner("worker directory")
        # What it ignored and why: garbage is anyone's to send, the log is not.
        self._ignored = ThrottledLog(log)

    def on_change(self, listener: Listener) -> None:
        """Call `listener(event, worker)` on membership changes: "added"; "removed" (it
        expired, or left because its engine is down); "draining" (it left to stop cleanly:
        it still finishes, or hands back, what it runs)."""
        self._listeners.append(listener)

    def on_report(self, listener: ReportListener) -> None:
        """Call `listener()` whenever the workers' loads may have changed: after every
        card (a load report or heartbeat) and every membership change."""
        self._report_listeners.append(listener)

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(self.subjects.discovery, cb=self._on_message)
        await check_subscriptions(self.nc, self._sub)
        await self._query()
        # Back from a NATS outage (which expired everyone): ask again, not a heartbeat later.
        on_reconnect(self.nc, self._query)
        self._tasks.spawn(self._expiry_loop(), name="expiry")

    async def _query(self) -> None:
        if self._sub is not None:  # not after close
            await publish(self.nc, self.subjects.query, get_codec(None), {})

    async def close(self) -> None:
        await unsubscribe_quietly(self._sub)
        self._sub = None
        await self._tasks.close()

    def live(self) -> list[WorkerInfo]:
        return list(self.workers.values())

    def note_sent(self, worker: WorkerInfo) -> None:
        worker.sent_since_report += 1
        worker.open_here += 1

    def note_ended(self, worker: WorkerInfo) -> None:
        if worker.open_here > 0:
            worker.open_here -= 1

    def _emit(self, event: str, worker: WorkerInfo) -> None:
        for listener in self._listeners:
            try:
                listener(event, worker)
            except Exception:
                log.exception("discovery listener failed")

    def _reported(self) -> None:
        for listener in self._report_listeners:
            try:
                listener()
            except Exception:
                log.exception("discovery report listener failed")

    async def _on_message(self, msg: Msg) -> None:
        if msg.subject == self.subjects.query:
            return
        if len(msg.data) > MAX_MESSAGE_BYTES:
            self._ignored.info(
                "ignored a discovery message of %d bytes on %s (the most is %d)",
                len(msg.data),
                msg.subject,
                MAX_MESSAGE_BYTES,
            )
            return
        try:
            obj = message_codec(msg).decode(msg.data)
        except (UnknownCodecError, CodecError) as exc:
            self._ignored.info("ignored unreadable discovery message: %s", exc)
            return
        if not isinstance(obj, dict) or not isinstance(obj.get("id"), str):
            self._ignored.info("ignored discovery message without an id on %s", msg.subject)
            return
        if msg.subject == self.subjects.router_presence:
            self._update_router(obj)
        elif msg.subject == self.subjects.leave:
            gone = self.workers.pop(obj["id"], None)
            if gone is not None:
                draining = obj.get("draining") is True
                log.info("worker %s left%s", gone.id, " to drain" if draining else "")
                self._emit("draining" if draining else "removed", gone)
                self._reported()
        elif msg.subject == self.subjects.announce:
            self._update(obj)

    def _update_router(self, presence: dict[str, Any]) -> None:
        fault = presence_fault(presence)
        if fault is not None:
            self._ignored.info("ignored router presence %.80r: %s", presence["id"], fault)
            return
        rid = presence["id"]
        if presence.get("leaving") is True:
            self.routers.pop(rid, None)
        elif rid not in self.routers and len(self.routers) >= MAX_ROUTERS:
            self._ignored.info(
                "ignored router presence %.80r: %d routers are known, the most a directory keeps",
                rid,
                MAX_ROUTERS,
            )
        else:
            heartbeat = presence.get("heartbeat_s", DEFAULT_HEARTBEAT_S)
            self.routers[rid] = (time.monotonic(), EXPIRY_HEARTBEATS * heartbeat)

    def _update(self, card: dict[str, Any]) -> None:
        fault = card_fault(card)
        if fault is not None:
            self._ignored.info("ignored worker card %.80r: %s", card.get("id"), fault)
            return
        wid: str = card["id"]
        inflight: int = card.get("inflight", 0)
        capacity: int = card.get("capacity", 1)
        heartbeat: float = card.get("heartbeat_s", DEFAULT_HEARTBEAT_S)
        now = time.monotonic()
        worker = self.workers.get(wid)
        if worker is None:
            if len(self.workers) >= MAX_WORKERS:
                self._ignored.info(
                    "ignored worker card %.80r: %d workers are known, the most a directory keeps",
                    wid,
                    MAX_WORKERS,
                )
                return
            subject = self.subjects.worker_generate(wid)
            worker = WorkerInfo(wid, subject, card, now, inflight, capacity)
            self.workers[wid] = worker
            log.info("worker %s joined (%s, model %s)", wid, card.get("engine"), worker.model)
            self._emit("added", worker)
        if worker.engine_info is None or card.get("engine_info") != worker.card.get("engine_info"):
            worker.engine_info = EngineInfo.from_wire(card.get("engine_info"))
        worker.card = card
        worker.last_seen = now
        worker.inflight = inflight
        worker.capacity = capacity
        worker.sent_since_report = 0
        worker.kv_blocks_sent = 0
        worker.expires_after = EXPIRY_HEARTBEATS * heartbeat
        worker.queued = _count(card.get("queued")) or 0
        worker.kv_blocks_used = _count(card.get("kv_blocks_used"))
        worker.kv_blocks_total = _count(card.get("kv_blocks_total"))
        self._reported()

    async def _expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            for rid, (seen, allowed) in list(self.routers.items()):
                if now - seen > allowed:
                    del self.routers[rid]
                    log.warning("router %s went silent; no longer counted", rid)
            for worker in list(self.workers.values()):
                if now - worker.last_seen > worker.expires_after:
                    del self.workers[worker.id]
                    log.warning(
                        "worker %s missed its heartbeats for %.1fs; dropped",
                        worker.id,
                        now - worker.last_seen,
                    )
                    self._emit("removed", worker)
                    self._reported()


def _count(value: object) -> int | None:
    """A card's optional count: an int in [0, 2^53), else None (absent, or from a peer that
    gets it wrong: treated as not announced, never as a refusal of the whole card)."""
    return value if type(value) is int and 0 <= value <= MAX_COUNT else None

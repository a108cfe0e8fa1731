"""The worker: admits requests from NATS, runs them on its engine, streams frames back.

The NATS callbacks only decode, admit and spawn (nats-py runs one callback at a time per
subscription), so a long generation never holds up the next request or a cancel. Decoding
and refusals are the shared endpoint's (`genmesh.shared.endpoint`); what is the worker's
own is admission, the requests it runs, cancels, pings, discovery and the drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections import Counter
from collections.abc import AsyncGenerator, Coroutine
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from genmesh.codecs import Codec, CodecError, UnknownCodecError, get_codec
from genmesh.engines.base import Engine, EngineOutput, disaggregating
from genmesh.engines.execute import execute
from genmesh.services.worker import tracing as worker_tracing
from genmesh.services.worker.admin import ABORTED, AdminHandlers, abort_end_frame
from genmesh.services.worker.config import WorkerConfig
from genmesh.services.worker.disagg import PdDecoder
from genmesh.services.worker.kv_relay import KvRelay
from genmesh.services.worker.tombstones import Tombstones
from genmesh.shared import frames, tracing
from genmesh.shared.bus import (
    PING_NOT_RUNNING,
    PREFILL_HEADER,
    STREAM_TERMINATOR,
    check_fits,
    check_subscriptions,
    codec_headers,
    header,
    message_codec,
    on_publish_denied,
    publish,
    unsubscribe_quietly,
)
from genmesh.shared.cards import ROLE_BOTH, ROLE_DECODE, ROLE_PREFILL
from genmesh.shared.endpoint import EnvelopeEndpoint, Request
from genmesh.shared.envelope import Envelope, prefill_stage_id
from genmesh.shared.errors import ErrorCode, MeshError
from genmesh.shared.ids import MAX_ID_BYTES, id_problem, new_request_id
from genmesh.shared.kv_events import KV_EVENTS_CARD_KEY
from genmesh.shared.lifecycle import Service
from genmesh.shared.micro import MicroEndpoint, MicroService
from genmesh.shared.subjects import Subjects
from genmesh.shared.tasks import TaskOwner, wait_event

log = logging.getLogger(__name__)

# A cancel's reason goes into the `err` frame it ends a request with: at most this many
# characters of it (docs/limits.md), so the frame stays small.
MAX_CANCEL_REASON = 256
# Load changes are announced at most this often, so bursts cost one message.
LOAD_REPORT_MIN_INTERVAL_S = 0.05


@dataclass(slots=True)
class _Active:
    envelope: Envelope
    reply: str
    codec: Codec
    dispatch: str
    seq: int = 0
    last_sent: float = field(default_factory=time.monotonic)
    task: asyncio.Task[None] | None = None
    # Why the task is being cancelled: decides the final frame.
    stop_reason: MeshError | None = None
    # The engine has produced something (until then the request counts as queued).
    started: bool = False
    # Its trace span (None while tracing is off), current in its task.
    span: tracing.FrameSpan | None = None
    # Output tokens sent so far (an abort the worker reports itself counts them).
    tokens: int = 0
    # An abort by client ID reached it (`services/worker/admin.py`).
    abort_requested: bool = False
    # A decode worker's request: the prefill worker the router paired it with.
    prefill_worker: str | None = None
    # The last frame it sent or tried to send (its outcome, for stats and its span).
    last: frames.Frame | None = None
    # The timer that stops it at its deadline, cancelled when it ends.
    deadline_timer: asyncio.TimerHandle | None = None


class Worker(Service):
    def __init__(
        self, nc: Client, subjects: Subjects, engine: Engine, config: WorkerConfig
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.engine = engine
        self.config = config
        self.subject = subjects.worker_generate(config.worker_id)
        self.endpoint = EnvelopeEndpoint(
            nc,
            self.subject,
            self._admit,
            on_reject=self._rejection_span,
            micro_data=lambda: {
                "inflight": self.inflight,
                "max_concurrency": self.config.max_concurrency,
            },
        )
        # Answers `$SRV` (docs/protocol.md, "$SRV (NATS micro)"); endpoints listed as
        # start() subscribes them.
        self.micro = MicroService(
            nc,
            role="worker",
            namespace=subjects.namespace,
            description=f"genmesh worker {config.worker_id} ({engine.name} engine)",
        )
        self._active: dict[str, _Active] = {}
        self.tombstones = Tombstones()
        self._tasks = TaskOwner(f"worker {config.worker_id}")
        # What start() set up, undone in reverse order by stop().
        self._running = contextlib.AsyncExitStack()
        self._load_changed = asyncio.Event()
        self._announcer: asyncio.Task[None] | None = None
        self._started = time.time()
        self._stopping = False
        # Announced only while the engine is healthy: a worker without an engine is no worker.
        self._engine_up = False
        # The card's `stats`; its `rejected` (refused as overloaded) is the endpoint's count.
        self.stats = {"admitted": 0, "completed": 0, "cancelled": 0, "failed": 0}
        # For metrics (services/worker/metrics.py): engine aborts and errors; refusals are
        # the endpoint's `rejections`.
        self.aborts = 0
        self.engine_errors: Counter[str] = Counter()
        # A prefill worker's prefill stages, by outcome (they count in `stats` too).
        self.stage_stats: Counter[str] = Counter()
        self.admin = AdminHandlers(self)
        # Relays the engine's KV cache events, if it publishes any (from start()).
        self.kv_relay: KvRelay | None = None
        # The engine's P/D side, when the role asks for one (start() refuses a role the
        # engine cannot play).
        self.pd = disaggregating(engine) if config.role != ROLE_BOTH else None
        # A decode worker's: has the prefill stages of its requests run (from start()).
        self.pd_decoder: PdDecoder | None = None

    @property
    def worker_id(self) -> str:
        return self.config.worker_id

    @property
    def inflight(self) -> int:
        return len(self._active)

    @property
    def queued(self) -> int:
        """Admitted requests the engine has produced nothing for yet."""
        return sum(not a.started for a in self._active.values())

    @property
    def engine_up(self) -> bool:
        return self._engine_up

    @property
    def rejections(self) -> int:
        """Requests refused before admission, whatever the reason."""
        return sum(self.endpoint.rejections.values())

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        pd = self.pd
        if self.config.role != ROLE_BOTH and pd is None:
            raise ValueError(
                f"the {self.engine.name} engine cannot take part in prefill/decode "
                f"disaggregation (--role {self.config.role})"
            )
        async with contextlib.AsyncExitStack() as stack:
            await self.engine.start()
            stack.push_async_callback(self.engine.close)
            self._engine_up = await self._engine_healthy()
            if not self._engine_up:
                log.warning(
                    "worker %s: waiting for its %s engine", self.worker_id, self.engine.name
                )
            stack.push_async_callback(self._tasks.close)
            if pd is not None:
                await pd.pd_attach(self.nc, self.subjects, self.worker_id, self.micro)
            if pd is not None and self.config.role == ROLE_DECODE:
                self.pd_decoder = PdDecoder(self.nc, self.subjects, pd)
                await self.pd_decoder.start()
                stack.push_async_callback(self.pd_decoder.close)
            on_publish_denied(self.nc, self._on_publish_denied)
            micro = self.micro
            subs = []
            kv_events = self.engine.kv_events()
            if kv_events is not None:
                # Before the first request: every event of the engine's is relayed.
                self.kv_relay = KvRelay(self.nc, self.subjects, self.worker_id, kv_events)
                snapshots = MicroEndpoint("kv_snapshot", self.kv_relay.snapshot_subject)
                subs.append(await self.kv_relay.subscribe(micro.add(snapshots)))
                self._tasks.spawn(self.kv_relay.run(), name="kv events")
            micro.add(self.endpoint.micro)
            subs.append(await self.endpoint.subscribe())
            for name, subject, callback in (
                ("ping", self.subjects.worker_ping(self.worker_id), self._on_ping),
                ("cancel", self.subjects.cancel, self._on_cancel),
                ("abort", self.subjects.abort, self.admin.on_abort),
                ("flush_cache", self.subjects.flush_cache, self.admin.on_flush),
            ):
                counted = micro.add(MicroEndpoint(name, subject)).counted(callback)
                subs.append(await self.nc.subscribe(subject, cb=counted))
            subs.append(await self.nc.subscribe(self.subjects.query, cb=self._on_query))
            stack.push_async_callback(_unsubscribe_all, subs)
            await check_subscriptions(self.nc, *subs)
            micro.metadata |= self._micro_metadata()
            await micro.start()
            stack.push_async_callback(micro.stop)
            # Still subscribed while draining: a request a router forwarded before it saw
            # the leave is refused as retryable (it migrates) rather than meeting no
            # responders.
            stack.push_async_callback(self._drain)
            self._announcer = self._tasks.spawn(self._announce_loop(), name="announce")
            self._tasks.spawn(self._keepalive_loop(), name="keepalive")
            self._tasks.spawn(self._health_loop(), name="engine health")
            self._running = stack.pop_all()
        log.info("worker %s serving %s on %s", self.worker_id, self.engine.name, self.subject)

    async def stop(self) -> None:
        """Drain (see `_drain`), unsubscribe, stop the background tasks, close the engine."""
        if self._stopping:
            return
        self._stopping = True
        await self._running.aclose()

    async def _drain(self) -> None:
        """Leave discovery, stop admitting, let what is in flight finish for up to
        `drain_timeout_s`, then hand the rest back as retryable (they migrate)."""
        self._stopping = True
        if self._announcer is not None:
            # No heartbeat may follow the leave, or routers would take us back.
            self._announcer.cancel()
            await asyncio.gather(self._announcer, return_exceptions=True)
        # Marked as a drain: requesters keep their streams here, which end or come back.
        await self._leave(draining=True)
        running = [a.task for a in self._active.values() if a.task is not None]
        if running:
            log.info(
                "worker %s draining %d requests (up to %gs)",
                self.worker_id,
                len(running),
                self.config.drain_timeout_s,
            )
            await asyncio.wait(running, timeout=self.config.drain_timeout_s)
        handed_back = MeshError(ErrorCode.UNAVAILABLE, "worker is shutting down")
        for active in list(self._active.values()):
            self._stop_request(active, handed_back)
        running = [a.task for a in self._active.values() if a.task is not None]
        if running:
            await asyncio.wait(running, timeout=5.0)

    # ----------------------------------------------------------------- discovery

    def card(self) -> dict[str, Any]:
        # The engine's facts first, so they can never shadow the worker's own fields.
        card = self.engine.describe()
        queued = self.queued
        card |= {
            "v": 1,
            "id": self.worker_id,
            "subject": self.subject,
            "engine": self.engine.name,
            "inflight": self.inflight,
            "running": self.inflight - queued,
            "queued": queued,
            "capacity": self.config.max_concurrency,
            "heartbeat_s": self.config.heartbeat_interval_s,
            "started": self._started,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "stats": self.stats | {"rejected": self.endpoint.rejections[ErrorCode.OVERLOADED]},
        }
        kv = self.engine.kv_usage()
        if kv is not None:
            card["kv_blocks_used"] = kv.used_blocks
            card["kv_blocks_total"] = kv.total_blocks
        if self.kv_relay is not None:
            card[KV_EVENTS_CARD_KEY] = True
        card["role"] = self.config.role
        if self.pd is not None:
            card["disagg"] = {"kind": self.pd.pd_kind, **self.pd.pd_card()}
        return card

    def _micro_metadata(self) -> dict[str, str]:
        """The worker's facts in its `$SRV` metadata (strings only, as the protocol says)."""
        facts = self.engine.describe()
        return {
            "worker_id": self.worker_id,
            "worker_role": self.config.role,
            "engine": self.engine.name,
            "model": str(facts.get("model", "")),
            "format": ",".join(facts.get("formats", ["*"])),
        }

    async def _announce(self) -> None:
        if self._engine_up:
            await publish(self.nc, self.subjects.announce, get_codec(None), self.card())

    async def _engine_healthy(self) -> bool:
        try:
            return await self.engine.healthy()
        except Exception as exc:
            log.warning("engine health check failed: %s", exc)
            return False

    async def _health_loop(self) -> None:
        """Join discovery when the engine is healthy, leave it while it is not."""
        while True:
            interval = self.config.health_interval_s
            await asyncio.sleep(interval if self._engine_up else interval / 2)
            up = await self._engine_healthy()
            if up == self._engine_up or self._stopping:
                continue
            self._engine_up = up
            if up:
                log.info("worker %s: engine is up; joining", self.worker_id)
                self.micro.metadata |= self._micro_metadata()  # the model, once it is known
                self._load_changed.set()
            else:
                log.warning("worker %s: engine is down; leaving discovery", self.worker_id)
                await self._leave()

    async def _leave(self, *, draining: bool = False) -> None:
        leave: dict[str, Any] = {"id": self.worker_id}
        if draining:
            leave["draining"] = True
        try:
            await publish(self.nc, self.subjects.leave, get_codec(None), leave)
        except Exception as exc:  # NATS may already be gone
            log.debug("could not announce leave: %s", exc)

    async def _announce_loop(self) -> None:
        while True:
            # Cleared before publishing: a change during the publish is reported next.
            self._load_changed.clear()
            try:
                await self._announce()
            except Exception as exc:
                log.warning("announce failed: %s", exc)
            if await wait_event(self._load_changed, self.config.heartbeat_interval_s):
                await asyncio.sleep(LOAD_REPORT_MIN_INTERVAL_S)

    async def _on_ping(self, msg: Msg) -> None:
        """Alive; and, if the ping names a request, whether it runs here: a requester that
        heard nothing for a while lost the stream's last frames if it does not."""
        if msg.reply:
            # No request has an id longer than MAX_ID_BYTES: such a ping is not decoded.
            running = not msg.data or (
                len(msg.data) <= MAX_ID_BYTES and msg.data.decode(errors="replace") in self._active
            )
            await self.nc.publish(msg.reply, b"" if running else PING_NOT_RUNNING)

    def _on_publish_denied(self, subject: str) -> None:
        """The server refused a frame of a stream: with `allow_responses`, the right to
        answer a request dies with the connection that received it (after a reconnect to
        another cluster node, say). The stream cannot go on, so stop it: its engine work
        ends and pings answer "not running", so the requester migrates it at once instead
        of waiting out its idle timeout. `subject` is lowercased (nats-py's report)."""
        for active in list(self._active.values()):
            if active.reply.lower() == subject and active.stop_reason is None:
                log.warning(
                    "request %s: the NATS server refuses its replies (a reconnect ended the "
                    "right to answer it); stopping it so that its requester moves it",
                    active.envelope.id,
                )
                self._stop_request(
                    active, MeshError(ErrorCode.UNAVAILABLE, "the stream's replies are refused")
                )

    async def _on_query(self, msg: Msg) -> None:
        if not self._stopping:  # a late announce would undo our leave
            await self._announce()

    # ----------------------------------------------------------------- requests

    def _check_role(self, envelope: Envelope, prefill_worker: str | None) -> None:
        """Refuse what this worker's P/D role does not run (docs/disaggregation.md)."""
        role = self.config.role
        if envelope.disagg is not None and role != ROLE_PREFILL:
            raise MeshError(
                ErrorCode.INVALID_ARGUMENT,
                f"worker {self.worker_id} is not a prefill worker (role {role}); "
                "it runs no prefill stages",
            )
        if envelope.disagg is None and role == ROLE_PREFILL:
            raise MeshError(
                ErrorCode.INVALID_ARGUMENT,
                f"worker {self.worker_id} is a prefill worker: it runs only the prefill "
                "stages of disaggregated requests",
            )
        if prefill_worker is not None and role != ROLE_DECODE:
            raise MeshError(
                ErrorCode.INVALID_ARGUMENT,
                f"worker {self.worker_id} is not a decode worker (role {role}); "
                f"it cannot pair with prefill worker {prefill_worker}",
            )

    def _check_admission(self, envelope: Envelope, prefill_worker: str | None) -> None:
        """Raise the MeshError that refuses `envelope`, if anything does (protocol.md §6.7,
        rows 5-10)."""
        rid = envelope.id
        if self._stopping:
            raise MeshError(ErrorCode.UNAVAILABLE, "worker is shutting down")
        if not self._engine_up:
            raise MeshError(ErrorCode.UNAVAILABLE, f"the {self.engine.name} engine is down")
        if rid in self.tombstones or (
            envelope.disagg is not None and envelope.disagg.parent in self.tombstones
        ):
            raise MeshError(ErrorCode.CANCELLED, "request was cancelled")
        self._check_role(envelope, prefill_worker)
        if rid in self._active:
            raise MeshError(ErrorCode.INVALID_ARGUMENT, f"request id {rid} is already running")
        if len(self._active) >= self.config.max_concurrency:
            raise MeshError(
                ErrorCode.OVERLOADED,
                f"worker {self.worker_id} is at its limit of "
                f"{self.config.max_concurrency} concurrent requests",
            )
        if envelope.deadline is not None and envelope.deadline <= time.time():
            raise MeshError(ErrorCode.DEADLINE_EXCEEDED, "the request's deadline passed")

    async def _admit(self, request: Request) -> None:
        """Admit a request (or raise why not): `ack` at once, then run it in a task."""
        envelope = request.envelope
        prefill_worker = header(request.msg, PREFILL_HEADER)
        self._check_admission(envelope, prefill_worker)
        rid = envelope.id
        active = _Active(envelope, request.reply, request.codec, dispatch=new_request_id())
        active.prefill_worker = prefill_worker
        active.span = worker_tracing.worker_span(
            self.subject,
            envelope,
            self.worker_id,
            self.engine.name,
            active.dispatch,
            prefill_worker,
        )
        self._active[rid] = active
        self.stats["admitted"] += 1
        self._load_changed.set()
        # The task first, the `ack` then: the ack is numbered and queued for sending before
        # the task can run (it starts at the loop's next turn), and an engine that answers
        # at once has its first frame written with the ack, in one send.
        active.task = self._tasks.spawn(self._run(active), name=f"request {rid}")
        # Whenever and however the task ends (even cancelled before it ever ran, when no
        # code of `_run` runs), the request leaves `_active`: a slot is never lost.
        active.task.add_done_callback(lambda _: self._release(active))
        ack = frames.ack(rid, self.worker_id, active.dispatch)
        try:
            await self._send(active, ack)
        except Exception as exc:
            # Nothing can be said to the requester if its ack cannot be (its ack timeout
            # takes over); the engine's work stops at once.
            log.warning("request %s: could not send its ack: %s; dropped", rid, exc)
            active.last = ack
            self._stop_request(active, MeshError(ErrorCode.UNAVAILABLE, "its ack was not sent"))
            return
        if envelope.deadline is not None:
            # The engine's work ends at the deadline even if the requester is gone.
            expired = MeshError(ErrorCode.DEADLINE_EXCEEDED, "the request's deadline passed")
            delay = envelope.deadline - time.time()
            active.deadline_timer = asyncio.get_running_loop().call_later(
                delay, self._stop_request, active, expired
            )

    def _rejection_span(self, rid: str | None, error: MeshError) -> None:
        worker_tracing.worker_rejected(
            self.subject, self.worker_id, self.engine.name, rid, error.code, error.message
        )

    async def _send(self, active: _Active, frame: frames.Frame) -> None:
        # Numbered and encoded before the first await, so concurrent senders (keep-alives)
        # stay in order, and a frame that cannot be encoded or sent does not use up its
        # number.
        frame["seq"] = active.seq
        data = active.codec.encode(frame)
        headers = codec_headers(active.codec)
        check_fits(self.nc.max_payload, data, headers)
        active.seq += 1
        active.last_sent = time.monotonic()
        await self.nc.publish(active.reply, data, headers=headers)

    async def _run(self, active: _Active) -> None:
        """Stream the request's frames; `_release` forgets it once this task is done."""
        rid = active.envelope.id
        if active.span is not None:
            tracing.enter(active.span)  # the engine's client span is its child
        try:
            try:
                # aclosing: a frame that cannot be sent ends the engine's work now, not
                # whenever the garbage collector finalizes the generator.
                generation = execute(active.envelope, self._generation(active))
                async with contextlib.aclosing(generation) as outputs:
                    async for frame in outputs:
                        active.last = frame
                        if not active.started:
                            active.started = True
                            # Queued -> running: routers that hold requests back for busy
                            # workers count queued requests (routing/busy.py).
                            self._load_changed.set()
                        if frame["t"] == frames.OUT or frame["t"] == frames.END:
                            active.tokens += len(frame["tokens"])
                        await self._send(active, frame)
                        if active.span is not None:
                            active.span.frame(frame)
                if active.last is not None and active.last["t"] == frames.ERR:
                    self.engine_errors[active.last["code"]] += 1
            except asyncio.CancelledError:
                self.aborts += 1
                if active.stop_reason is ABORTED:
                    # Aborted by client ID where the engine could not finish it itself:
                    # it ends as the engine ends an aborted request, not as an error.
                    active.last = abort_end_frame(active.envelope, active.tokens, active.started)
                else:
                    reason = active.stop_reason or MeshError(
                        ErrorCode.CANCELLED, "request was cancelled"
                    )
                    active.last = frames.err(rid, 0, reason)
                await self._send(active, active.last)
            await self.nc.publish(active.reply, STREAM_TERMINATOR)
        except CodecError as exc:
            # An engine value the request's codec cannot carry: say so instead of going silent.
            log.error("request %s: frame not encodable: %s", rid, exc)
            error = MeshError(ErrorCode.INTERNAL, f"unencodable frame: {exc}")
            active.last = frames.err(rid, 0, error)
            await self._send(active, active.last)
            await self.nc.publish(active.reply, STREAM_TERMINATOR)
        except Exception as exc:  # NATS trouble: the requester's timeouts take over
            log.warning("request %s: could not send its frames: %s", rid, exc)

    def _release(self, active: _Active) -> None:
        """Forget a request whose task is done: its slot, its deadline timer, its stats
        and span. A task's done callback, so it runs however the task ended."""
        if self._active.get(active.envelope.id) is active:
            del self._active[active.envelope.id]
        if active.deadline_timer is not None:
            active.deadline_timer.cancel()  # it holds the request (and its prompt) until then
        self._load_changed.set()
        outcome = _outcome(active.last)
        self.stats[outcome] += 1
        if outcome == "failed":  # an error of the generate endpoint's, for `$SRV.STATS`
            self.endpoint.micro.failed(_failure(active.last))
        if active.envelope.disagg is not None:
            self.stage_stats[outcome] += 1
        if active.span is not None:
            active.span.end(active.last)

    def _generation(self, active: _Active) -> AsyncGenerator[EngineOutput, None]:
        """The outputs of `active`: a prefill stage's, a disaggregated request's (decode
        here, prefill by its paired worker), or a whole request's."""
        envelope = active.envelope
        if envelope.disagg is not None:
            assert self.pd is not None  # only a prefill worker admits a stage
            return self.pd.prefill(envelope, envelope.disagg.ticket)
        if active.prefill_worker is not None and self.pd_decoder is not None:
            return self.pd_decoder.generate(envelope, active.prefill_worker)
        return self.engine.generate(envelope)

    def active_requests(self) -> list[_Active]:
        return list(self._active.values())

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        self._tasks.spawn(coro, name=name)

    def stop_request(self, active: _Active, reason: MeshError) -> None:
        self._stop_request(active, reason)

    def _stop_request(self, active: _Active, reason: MeshError) -> None:
        if active.task is not None and not active.task.done():
            active.stop_reason = reason
            active.task.cancel()

    async def _on_cancel(self, msg: Msg) -> None:
        try:
            obj = message_codec(msg).decode(msg.data)
        except (UnknownCodecError, CodecError) as exc:
            log.info("ignored unreadable cancel: %s", exc)
            return
        rid = obj.get("id") if isinstance(obj, dict) else None
        if not isinstance(rid, str) or not rid:
            log.info("ignored cancel without an id")
            return
        problem = id_problem(rid, MAX_ID_BYTES)
        if problem is not None:
            # No request can have that id; and a tombstone of it would be a hostile
            # sender's memory to fill.
            log.info("ignored cancel: id: %s", problem)
            return
        # A request's prefill stage is cancelled with it (its id is the parent's + "~p").
        active = self._active.get(rid) or self._active.get(prefill_stage_id(rid))
        if active is not None:
            reason = obj.get("reason")
            message = (
                f"request was cancelled ({str(reason)[:MAX_CANCEL_REASON]})"
                if reason
                else "request was cancelled"
            )
            self._stop_request(active, MeshError(ErrorCode.CANCELLED, message))
            return
        # Possibly a cancel that overtook its request: remember it for a while.
        self.tombstones.add(rid)

    async def _keepalive_loop(self) -> None:
        interval = self.config.keepalive_interval_s
        while True:
            await asyncio.sleep(interval / 2)
            self.tombstones.prune()
            now = time.monotonic()
            for active in list(self._active.values()):
                if now - active.last_sent >= interval:
                    try:
                        await self._send(active, frames.ka(active.envelope.id))
                    except Exception as exc:
                        log.debug("keep-alive failed for %s: %s", active.envelope.id, exc)


def _outcome(last: frames.Frame | None) -> str:
    """The stats counter a request ends in, from the last frame it sent."""
    if last is not None and last["t"] == frames.END:
        return "completed"
    if last is not None and last["t"] == frames.ERR and last["code"] == ErrorCode.CANCELLED:
        return "cancelled"
    return "failed"


def _failure(last: frames.Frame | None) -> str:
    """What a failed request's `$SRV` `last_error` says: its `err` frame's code and message."""
    if last is not None and last["t"] == frames.ERR:
        return f"{last['code']}: {last['message']}"
    return "its frames could not be sent"


async def _unsubscribe_all(subs: list[Subscription]) -> None:
    for sub in subs:
        await unsubscribe_quietly(sub)

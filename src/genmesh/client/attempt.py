"""One dispatch of an envelope: publish it, read its reply frames, watch the worker.

An attempt's stream always ends with one terminal frame. When the mesh sends none in time
(no `ack`, a silent worker that a ping finds gone or no longer running the request, a
worker that leaves discovery, lost frames, the deadline), the attempt makes up an `err`
frame (`"origin": "client"`) and says why in `failure`, which the `Migrator` reads. Leaving
the stream before the mesh ended it cancels the request on the workers
(`docs/protocol.md` §11, §11.3).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from genmesh.client.migration import MigrationReason
from genmesh.client.tracing import attempt_span, failed_attempt_span
from genmesh.codecs import CodecError, UnknownCodecError
from genmesh.shared import frames, tracing
from genmesh.shared.bus import (
    PING_NOT_RUNNING,
    PREFILL_HEADER,
    PayloadTooLarge,
    check_fits,
    codec_headers,
    is_no_responders,
    message_codec,
)
from genmesh.shared.envelope import Envelope
from genmesh.shared.errors import ErrorCode, MeshError
from genmesh.shared.tasks import keep_cancel

if TYPE_CHECKING:
    from genmesh.client.mesh_client import MeshClient
    from genmesh.routing.choice import Decision

log = logging.getLogger(__name__)

PING_TIMEOUT_S = 1.0


@dataclass(frozen=True, slots=True)
class Failure:
    """A failure the client detected itself, queued on a stream like a reply."""

    reason: MigrationReason | None  # None: a failure no migration survives (the deadline)
    code: ErrorCode
    message: str


class Wake:
    """Put on a stream's queue by the attempt's timer: time to check the timeouts."""


WAKE = Wake()

# What a stream's queue holds: replies, failures detected outside the stream, and the
# attempt's timer going off.
Incoming = Msg | Failure | Wake


class Attempt:
    """One dispatch of `envelope` by `client`: to `subject` when given (a pinned request),
    else to the worker the client's routing core chooses, else to the routers."""

    def __init__(
        self, client: MeshClient, envelope: Envelope, subject: str | None, deadline: float | None
    ) -> None:
        self.client = client
        self.envelope = envelope
        self.subject = subject or ""  # set by _route when not given
        # The client's own routing decision, when it routed the attempt itself.
        self.decision: Decision | None = None
        self.policy: str | None = None  # its policy, when the client routed it (traces)
        # Seconds it waited in the client's admission queue, if it waited (traces).
        self.waited_s: float | None = None
        self.deadline = deadline  # on the event loop's clock
        # The worker that acknowledged the attempt, once one did.
        self.worker: str | None = None
        # Why the attempt failed, when it ends with an `err` (the mesh's own: a
        # retryable error, or the failure the client detected).
        self.failure = MigrationReason.RETRYABLE_ERROR
        # The `seq` the next frame must have; when the last frame came, and the last frame
        # or good ping (the idle timeout and the next ping count from these).
        self._expected_seq = 0
        self._silent_since = self._reassured_at = 0.0
        # One timer per attempt, not one per frame: it is armed for the earliest time a
        # timeout may be due and left alone while frames keep coming; going off early (the
        # frames moved the timeouts on) only re-arms it (`_get`).
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    async def stream(self) -> AsyncGenerator[frames.Frame, None]:
        """Its frames, ending with one terminal frame (made up here if need be)."""
        client = self.client
        rid = self.envelope.id
        refusal = await self._route()
        token, queue = client.open_stream()
        # A span per attempt (a child of the caller's current span), ended by its terminal
        # frame, or below when the attempt is left without one. Without attempt spans,
        # only a failed attempt gets one, after the fact (client/tracing.py).
        span = (
            attempt_span(self.envelope, self.subject, self.policy, self.decision)
            if client.attempt_spans
            else None
        )
        if self.waited_s is not None:
            # On the attempt's span, or (under the frontend) the request's.
            tracing.admission_waited(span.span if span is not None else None, self.waited_s)
        started_ns = time.time_ns() if span is None and tracing.tracer() is not None else 0
        finished = False
        frame: frames.Frame | None = None
        try:
            frame = refusal or await self._publish(token, span, started_ns)
            while frame is None or frame["t"] not in frames.TERMINAL:
                if frame is not None:
                    if span is not None:
                        span.frame(frame)
                    yield frame
                frame = await self._receive(token, queue)
            if span is not None:
                span.frame(frame)
            # A terminal frame from the mesh needs no cancel; one made up here does.
            finished = "origin" not in frame
            yield frame
        finally:
            if self._timer is not None:
                self._timer.cancel()
            client.close_stream(token, self.worker)
            if self.decision is not None and client.router is not None:
                client.router.ended(self.decision)
            if span is not None:
                span.end(error_type=ErrorCode.CANCELLED.value)  # unless a frame ended it
            elif started_ns and frame is not None and frame["t"] == frames.ERR:
                failed_attempt_span(
                    self.envelope,
                    self.subject,
                    started_ns,
                    self.worker,
                    frame,
                    self.policy,
                    self.decision,
                )
            if not finished:
                try:
                    await client.cancel(rid)
                except Exception as exc:
                    log.warning("could not publish cancel for %s: %s", rid, exc)

    async def _route(self) -> frames.ErrFrame | None:
        """Set the subject the attempt goes to; the `err` frame that ends it at once when
        the client routes and no worker may serve it: the refusal a router would send
        (`frames.err`, seq 0), so that the caller cannot tell who routed. A busy mesh may
        hold it in the admission queue first (`routing/admission.py`)."""
        client = self.client
        if self.subject:
            return None
        router = client.router
        if router is None:
            self.subject = client.subjects.router_generate
            return None
        self.policy = router.policy.name
        try:
            decision = router.choose(self.envelope)
            if decision is None:
                since = time.monotonic()
                try:
                    decision = await router.wait(self.envelope)
                finally:
                    self.waited_s = time.monotonic() - since
            self.decision = decision
        except MeshError as error:
            log.info(
                "request %s not routed: %s: %s", self.envelope.id, error.code.value, error.message
            )
            self.subject = client.subjects.worker_generate("*")  # the span's name only
            return frames.err(self.envelope.id, 0, error)
        self.subject = self.decision.worker.subject
        return None

    async def _publish(
        self, token: str, span: tracing.FrameSpan | None, started_ns: int
    ) -> frames.Frame | None:
        """Send the request; None once it is out, else the `err` frame that ends it.
        `started_ns`: tracing is on, without an attempt span."""
        client = self.client
        try:
            data = client.codec.encode(self.envelope.to_wire())
        except CodecError as exc:  # e.g. an integer beyond 64 bits in a native field
            return frames.synthetic_err(
                self.envelope.id,
                ErrorCode.INVALID_ARGUMENT,
                f"the request cannot be encoded: {exc}",
            )
        headers = codec_headers(client.codec)
        prefill = self.decision.prefill if self.decision is not None else None
        if prefill is not None:  # a decode worker, paired (docs/protocol.md §3)
            headers = {**(headers or {}), PREFILL_HEADER: prefill.id}
        if span is not None:  # the router's and worker's spans become its children
            headers = tracing.inject(headers, span.span)
        elif started_ns:  # or the caller's span's (the frontend's server span)
            headers = tracing.inject_current(headers or {})
        if not client.nc.is_connected and client.reconnect_hold_s > 0:
            refusal = await self._wait_for_connection()
            if refusal is not None:
                return refusal
        try:
            # Too large for this server is too large for any worker: refused at once, never
            # retried (and never sent: the server would close the connection over it).
            check_fits(client.nc.max_payload, data, headers)
        except PayloadTooLarge as exc:
            return frames.synthetic_err(
                self.envelope.id, ErrorCode.INVALID_ARGUMENT, f"the request is too large: {exc}"
            )
        try:
            await client.nc.publish(
                self.subject, data, reply=client.reply_subject(token), headers=headers
            )
        except NatsError as exc:  # closed, draining, or the reconnect buffer is full
            return self._failed(
                MigrationReason.PUBLISH_FAILED,
                ErrorCode.UNAVAILABLE,
                f"could not publish the request: {exc!r}",
            )
        self._silent_since = self._reassured_at = asyncio.get_running_loop().time()
        return None

    async def _wait_for_connection(self) -> frames.ErrFrame | None:
        """Wait for the connection to come back (the client's reconnect hold, within the
        deadline) instead of publishing into nats-py's reconnect buffer, where the request
        would sit while its acknowledgement timeout runs. None once connected, else the
        `err` frame that ends the request: another worker would not help."""
        client = self.client
        loop = asyncio.get_running_loop()
        left = None if self.deadline is None else self.deadline - loop.time()
        why = await client.hold_until_connected(left)
        if why is None:
            return None
        if self.deadline is not None and loop.time() >= self.deadline:
            return self._failed(None, ErrorCode.DEADLINE_EXCEEDED, "the request's deadline passed")
        refusal = self._failed(None, ErrorCode.UNAVAILABLE, why)
        refusal["retryable"] = False
        return refusal

    async def _receive(self, token: str, queue: asyncio.Queue[Incoming]) -> frames.Frame | None:
        """The next frame (None: one of a type this client does not know), or the `err`
        frame of a failure detected here."""
        loop = asyncio.get_running_loop()
        while True:
            item = await self._next(queue)
            if item is not None:
                break
            self._reassured_at = loop.time()  # the silent worker answered a ping: keep
            # waiting, and ask again only after another pause
        if isinstance(item, Failure):
            return self._failed(item.reason, item.code, item.message)
        self._silent_since = self._reassured_at = loop.time()
        frame = self._read(item)
        if frame is not None and frame["t"] == frames.KA and frame["seq"] == frames.HELD_SEQ:
            # A router holds it in its admission queue: alive, not yet acknowledged (the
            # acknowledgement timeout starts again); outside the stream's numbering.
            return None
        self._expected_seq += 1
        if frame is not None and frame["t"] == frames.ACK:
            self.worker = frame["worker"]
            self.client.watch_worker(self.worker, token)
        return frame

    def _failed(
        self, reason: MigrationReason | None, code: ErrorCode, message: str
    ) -> frames.ErrFrame:
        if reason is not None:
            self.failure = reason
        return frames.synthetic_err(self.envelope.id, code, message)

    async def _next(self, queue: asyncio.Queue[Incoming]) -> Msg | Failure | None:
        """The next reply; a failure detected here; or None after a good ping.

        The idle timeout counts from the last frame (`_silent_since`); the next ping is due
        `ping_after_s` after the last frame or good ping (`_reassured_at`)."""
        if not queue.empty() and not isinstance(first := queue.get_nowait(), Wake):
            return first
        client = self.client
        deadline = self.deadline
        loop = asyncio.get_running_loop()
        acked = self._expected_seq > 0
        window = client.idle_timeout_s if acked else client.ack_timeout_s
        limit = self._silent_since + window
        # Acknowledged: wake early to ask a silent worker whether it is still there.
        wake = min(limit, self._reassured_at + client.ping_after_s) if acked else limit
        if deadline is not None:
            wake = min(wake, deadline)
        if (item := await self._get(queue, wake)) is not None:
            return item
        now = loop.time()
        if deadline is not None and now >= deadline:
            return Failure(None, ErrorCode.DEADLINE_EXCEEDED, "the request's deadline passed")
        if now >= limit:
            what = "sent a frame" if acked else "acknowledged the request"
            reason = MigrationReason.IDLE_TIMEOUT if acked else MigrationReason.ACK_TIMEOUT
            return Failure(reason, ErrorCode.UNAVAILABLE, f"no worker {what} within {window:g}s")
        # The ping waits no longer than the deadline allows (the next round reports it).
        ping_timeout = PING_TIMEOUT_S if deadline is None else min(PING_TIMEOUT_S, deadline - now)
        if self.worker is None or ping_timeout <= 0:
            return None
        failure = await self._ping(self.worker, ping_timeout)
        if failure is not None and queue.empty():  # a frame that came meanwhile wins
            return failure
        return None

    async def _get(self, queue: asyncio.Queue[Incoming], wake: float) -> Msg | Failure | None:
        """The next reply or failure, or None once the loop's clock reaches `wake`."""
        loop = asyncio.get_running_loop()
        while True:
            if self._timer is None or self._timer_at > wake:
                if self._timer is not None:
                    self._timer.cancel()
                self._timer = loop.call_at(wake, self._ring, queue)
                self._timer_at = wake
            item = await queue.get()
            if not isinstance(item, Wake):
                return item
            if loop.time() >= wake:
                return None

    def _ring(self, queue: asyncio.Queue[Incoming]) -> None:
        self._timer = None
        queue.put_nowait(WAKE)

    async def _ping(self, worker: str, timeout: float) -> Failure | None:
        """Ask a silent worker about this attempt: None while it may still run it, else
        why the stream is dead. Only "nobody is subscribed" means the worker is gone, and
        only "not running" means the stream's last frames were lost (say, in a NATS
        outage): a slow answer is a busy worker, and that is what the idle timeout is for."""
        client = self.client
        subject = client.subjects.worker_ping(worker)
        try:
            # Pings are where a frontend handler usually is when its client disconnects.
            reply = await keep_cancel(
                client.nc.request(subject, self.envelope.id.encode(), timeout=timeout)
            )
        except NoRespondersError:
            client.quarantine.add(worker)
            return Failure(
                MigrationReason.WORKER_GONE,
                ErrorCode.UNAVAILABLE,
                f"worker {worker} is gone (its ping subject has no responders)",
            )
        except (NatsTimeoutError, NatsError):
            return None
        if reply.data == PING_NOT_RUNNING:
            return Failure(
                MigrationReason.NOT_RUNNING,
                ErrorCode.UNAVAILABLE,
                f"worker {worker} no longer runs the request (its last frames were lost)",
            )
        return None

    def _read(self, msg: Msg) -> frames.Frame | None:
        """Decode and check one reply (None: a frame type this client does not know);
        problems become a terminal `err` frame."""
        rid = self.envelope.id
        client = self.client
        if is_no_responders(msg) and self.decision is not None:
            # The worker chosen here has gone since discovery last heard of it.
            worker = self.decision.worker.id
            client.quarantine.add(worker)
            return self._failed(
                MigrationReason.WORKER_GONE,
                ErrorCode.UNAVAILABLE,
                f"worker {worker} is gone (nothing is subscribed to {self.subject})",
            )
        if is_no_responders(msg):
            # Routers go missing for a moment when they reconnect to NATS; a worker subject
            # is a pinned request's, which never moves.
            nobody = self._failed(
                MigrationReason.NO_ROUTER,
                ErrorCode.NO_WORKER,
                f"nothing is subscribed to {self.subject}",
            )
            nobody["retryable"] = self.subject == client.subjects.router_generate
            return nobody
        try:
            seq, frame = frames.parse(message_codec(msg).decode(msg.data))
        except (UnknownCodecError, CodecError, frames.FrameError) as exc:
            return frames.synthetic_err(rid, ErrorCode.INTERNAL, f"unreadable reply frame: {exc}")
        # Rejections sent before a worker admitted the request carry seq 0 as well.
        expected = self._expected_seq
        held = seq == frames.HELD_SEQ and frame is not None and frame["t"] == frames.KA
        if seq != expected and (frame is None or frame["t"] != frames.ERR) and not held:
            return self._failed(
                MigrationReason.FRAMES_LOST,
                ErrorCode.UNAVAILABLE,
                f"reply frames lost: expected seq {expected}, got {seq}",
            )
        return frame

"""The NATS-level client of the mesh. The HTTP frontend dispatches through it too.

    from genmesh.client import MeshClient, request

    async with await MeshClient.connect("nats://127.0.0.1:4222") as client:
        async for frame in client.generate(request([1, 2, 3], max_tokens=8)):
            print(frame)

`generate` yields every reply frame (`ack`, `out`, `ka`, `end`, `err`) and always ends with
exactly one terminal frame, `end` or `err`: failures the client detects itself (no
responders, a worker that never acknowledges or goes silent, lost frames) arrive as `err`
frames with `"origin": "client"`. Leaving the loop early, or cancelling the task, publishes
a cancel so the engine stops.

When a worker fails with a retryable error (it died, its engine broke, it was drained,
it went silent and no longer answers pings or answers that it no longer runs the request,
or discovery dropped it), the client
*migrates* the request: it re-dispatches a continuation (`genmesh.shared.migration`)
elsewhere and yields a `mig` frame (`{"t": "mig", "attempt", "reason", "from_worker",
"delivered"}`, made by the client, never on the wire) before the new attempt's frames.
Counters in the new attempt's frames (usage) count from that attempt;
`genmesh.formats.merge.Rebaser` turns them back into what an uninterrupted run reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import replace
from types import TracebackType
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from genmesh.client.tracing import attempt_span
from genmesh.codecs import Codec, CodecError, UnknownCodecError, get_codec
from genmesh.shared import frames, tracing
from genmesh.shared.bus import (
    PING_NOT_RUNNING,
    NatsAuth,
    check_subscriptions,
    codec_headers,
    connect,
    drain_or_close,
    is_no_responders,
    message_codec,
    publish,
    unsubscribe_quietly,
)
from genmesh.shared.discovery import WorkerDirectory, WorkerInfo
from genmesh.shared.envelope import Envelope, OutputOptions, Routing, Sampling
from genmesh.shared.errors import ErrorCode
from genmesh.shared.ids import new_request_id
from genmesh.shared.migration import continuation
from genmesh.shared.subjects import Subjects
from genmesh.shared.tasks import keep_cancel

log = logging.getLogger(__name__)

DEFAULT_ACK_TIMEOUT_S = 2.0
DEFAULT_IDLE_TIMEOUT_S = 60.0
# A reply inbox carries every stream of this client; let it queue generously.
_INBOX_PENDING_MSGS = 1_000_000
_INBOX_PENDING_BYTES = 1 << 30


def request(
    token_ids: list[int],
    *,
    max_tokens: int | None = 16,
    min_tokens: int = 0,
    seed: int | None = None,
    stop_token_ids: list[int] | None = None,
    ignore_eos: bool = False,
    logprobs: bool = False,
    top_logprobs: int = 0,
    prompt_logprobs_start: int | None = None,
    worker: str | None = None,
    model: str | None = None,
    client_id: str | None = None,
) -> Envelope:
    """A request envelope with a fresh private ID, for the common knobs."""
    return Envelope(
        id=new_request_id(),
        token_ids=list(token_ids),
        format="tokens",
        model=model,
        client_id=client_id,
        sampling=Sampling(
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            seed=seed,
            stop_token_ids=list(stop_token_ids or []),
            ignore_eos=ignore_eos,
        ),
        output=OutputOptions(
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            prompt_logprobs_start=prompt_logprobs_start,
        ),
        routing=Routing(worker=worker),
    )


MIG = "mig"
DEFAULT_MIGRATION_LIMIT = 3
DEFAULT_PING_AFTER_S = 0.5
# A worker whose ping subject had no responders is left out of this client's requests
# for this long: it may stay listed until discovery expires it (3 heartbeats).
DEAD_WORKER_QUARANTINE_S = 10.0
PING_TIMEOUT_S = 1.0
# A refusal before admission (overloaded; a draining worker; no router subscribed) is
# retried after a pause that doubles each time (0.1, 0.2, 0.4 s): a full mesh gets a
# moment to free a slot, and a reconnecting router a moment to subscribe again, instead
# of meeting every attempt at once.
REFUSAL_BACKOFF_S = 0.1


class MeshClient:
    """Sends request envelopes and demultiplexes reply frames from one wildcard inbox."""

    def __init__(
        self,
        nc: Client,
        namespace: str = "default",
        *,
        codec: str | None = None,
        ack_timeout_s: float = DEFAULT_ACK_TIMEOUT_S,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        ping_after_s: float = DEFAULT_PING_AFTER_S,
        migration_limit: int = DEFAULT_MIGRATION_LIMIT,
        directory: WorkerDirectory | None = None,
        owns_connection: bool = False,
    ) -> None:
        self.nc = nc
        self.subjects = Subjects(namespace)
        self.codec: Codec = get_codec(codec)
        self.ack_timeout_s = ack_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.ping_after_s = ping_after_s
        self.migration_limit = migration_limit
        self.migrations = 0
        self._owns_connection = owns_connection
        self._inbox = nc.new_inbox()
        # Per stream token: its replies, or a failure frame made up here.
        self._streams: dict[str, asyncio.Queue[Msg | frames.Frame]] = {}
        # Worker id -> tokens of the streams it serves, to fail them when it disappears.
        self._by_worker: dict[str, set[str]] = {}
        self._tokens = itertools.count()
        # Worker id -> loop time until which it counts as dead (see DEAD_WORKER_QUARANTINE_S).
        self._dead: dict[str, float] = {}
        self._sub: Subscription | None = None
        if directory is not None:
            directory.on_change(self._on_directory_change)

    @classmethod
    async def connect(
        cls,
        url: str,
        namespace: str = "default",
        *,
        name: str = "genmesh-client",
        inbox_prefix: str = "_INBOX_client",
        auth: NatsAuth | None = None,
        **kwargs: Any,
    ) -> MeshClient:
        """Connect to NATS (failing fast if unreachable) and start a client on it.

        `url` may list several servers, comma-separated; `auth` holds credentials, TLS
        settings and the inbox prefix: a secured mesh gives each client application a user
        of its own, whose replies may only arrive under its own prefix (`_INBOX_client`
        for the `client` user, the default here: docs/deploy.md). A refused inbox raises
        NatsPermissionDenied."""
        nc = await connect(url, name=name, inbox_prefix=inbox_prefix, auth=auth)
        client = cls(nc, namespace, owns_connection=True, **kwargs)
        await client.start()
        return client

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(
            f"{self._inbox}.*",
            cb=self._on_reply,
            pending_msgs_limit=_INBOX_PENDING_MSGS,
            pending_bytes_limit=_INBOX_PENDING_BYTES,
        )
        await check_subscriptions(self.nc, self._sub)

    async def close(self) -> None:
        await unsubscribe_quietly(self._sub)
        self._sub = None
        if self._owns_connection:
            await drain_or_close(self.nc)

    async def __aenter__(self) -> MeshClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def active_streams(self) -> int:
        return len(self._streams)

    async def _on_reply(self, msg: Msg) -> None:
        queue = self._streams.get(msg.subject[len(self._inbox) + 1 :])
        if queue is not None:
            queue.put_nowait(msg)

    def _on_directory_change(self, event: str, worker: WorkerInfo) -> None:
        # Not on "draining": a draining worker lets its requests finish, or hands them back.
        if event != "removed":
            return
        for token in self._by_worker.pop(worker.id, set()):
            queue = self._streams.get(token)
            if queue is not None:
                message = f"worker {worker.id} left the mesh"
                queue.put_nowait(frames.synthetic_err("", ErrorCode.UNAVAILABLE, message))

    async def cancel(self, request_id: str, reason: str = "client") -> None:
        """Tell every worker to stop `request_id` (also before its request arrives)."""
        await publish(
            self.nc, self.subjects.cancel, self.codec, {"id": request_id, "reason": reason}
        )

    async def generate(
        self,
        envelope: Envelope,
        *,
        subject: str | None = None,
        no_migration: str | None = None,
    ) -> AsyncGenerator[frames.Frame, None]:
        """Dispatch `envelope` (to the routers unless `subject` says otherwise); yield frames.

        `no_migration`: why this request must not continue elsewhere once tokens were
        delivered (a restart before any token is always safe). Pinned requests (a
        `subject`, or `routing.worker`) never migrate.
        """
        if self._sub is None:
            raise RuntimeError("MeshClient.start() has not been called")
        pinned = subject is not None or envelope.routing.worker is not None
        limit = 0 if pinned else self.migration_limit
        deadline = _loop_deadline(envelope.deadline)
        delivered: list[int] = []
        expert_values = 0  # routed-expert values delivered (rows are re-sent on a retry)
        resent = 0  # of those, how many the current attempt is still to send again
        failed: list[str] = []
        refusals = 0
        attempt = 1
        env = self._avoiding_dead(envelope, pinned)
        while True:
            failure: frames.Frame | None = None
            worker: str | None = None
            # A span per attempt (a child of the caller's current span), ended by its
            # terminal frame, or by _attempt when the attempt is left without one.
            span = attempt_span(env, subject or self.subjects.router_generate)
            async with contextlib.aclosing(self._attempt(env, subject, deadline, span)) as stream:
                async for frame in stream:
                    if span is not None:
                        span.frame(frame)
                    kind = frame["t"]
                    if kind == frames.ACK:
                        worker = frame.get("worker")
                    elif kind in (frames.OUT, frames.END):
                        resent = _skip_experts(frame, resent)
                        delivered.extend(frame.get("tokens") or [])
                        expert_values += sum(len(row) for row in frame.get("routed_experts") or [])
                    elif kind == frames.ERR and frame.get("retryable") and attempt <= limit:
                        failure = frame
                        break
                    yield frame
                    if kind in frames.TERMINAL:
                        return
            assert failure is not None
            if delivered and no_migration is not None:
                yield {
                    **failure,
                    "message": f"{failure['message']} (not migrated: {no_migration})",
                    "retryable": False,
                }
                return
            if worker is not None:
                failed.append(worker)
            attempt += 1
            self.migrations += 1
            env = self._avoiding_dead(continuation(envelope, delivered, attempt, failed), pinned)
            resent = expert_values
            log.info(
                "request %s: attempt %d after: %s (%d tokens delivered)",
                envelope.id,
                attempt,
                failure["message"],
                len(delivered),
            )
            yield {
                "t": MIG,
                "id": envelope.id,
                "attempt": attempt,
                "reason": failure["message"],
                "from_worker": worker,
                "delivered": len(delivered),
            }
            # Refused by a router or worker, or no router there; not a timeout (which has
            # waited already).
            refused = "origin" not in failure or failure["code"] == ErrorCode.NO_WORKER
            if worker is None and refused:
                refusals += 1
                pause = REFUSAL_BACKOFF_S * 2 ** (refusals - 1)
                if deadline is not None:
                    pause = min(pause, deadline - asyncio.get_running_loop().time())
                await asyncio.sleep(max(0.0, pause))

    async def _attempt(
        self,
        envelope: Envelope,
        subject: str | None,
        deadline: float | None,
        span: tracing.FrameSpan | None = None,
    ) -> AsyncGenerator[frames.Frame, None]:
        """One dispatch: its frames, ending with one terminal frame (maybe made up here)."""
        rid = envelope.id
        token = str(next(self._tokens))
        queue: asyncio.Queue[Msg | frames.Frame] = asyncio.Queue()
        self._streams[token] = queue
        finished = False
        worker: str | None = None
        target = subject or self.subjects.router_generate
        try:
            try:
                data = self.codec.encode(envelope.to_wire())
            except CodecError as exc:  # e.g. an integer beyond 64 bits in a native field
                finished = True
                yield frames.synthetic_err(
                    rid, ErrorCode.INVALID_ARGUMENT, f"the request cannot be encoded: {exc}"
                )
                return
            headers = codec_headers(self.codec)
            if span is not None:  # the router's and worker's spans become its children
                headers = tracing.inject(headers, span.span)
            try:
                await self.nc.publish(target, data, reply=f"{self._inbox}.{token}", headers=headers)
            except NatsError as exc:  # closed, draining, or the reconnect buffer is full
                finished = True  # nothing went out, nothing to cancel
                yield frames.synthetic_err(
                    rid, ErrorCode.UNAVAILABLE, f"could not publish the request: {exc!r}"
                )
                return
            expected_seq = 0
            loop = asyncio.get_running_loop()
            silent_since = reassured_at = loop.time()
            while True:
                item = await self._next(
                    rid, queue, expected_seq, worker, silent_since, reassured_at, deadline
                )
                if item is None:  # the silent worker answered a ping: keep waiting, and
                    reassured_at = loop.time()  # ask again only after another pause
                    continue
                if isinstance(item, dict):  # made up here: timeout, deadline, worker gone
                    item["id"] = rid
                    yield item
                    return
                silent_since = reassured_at = loop.time()
                frame = self._read(rid, item, target, expected_seq)
                expected_seq += 1
                kind = frame["t"]
                if kind not in frames.TYPES:
                    continue  # a frame type from a newer protocol: numbered, not understood
                if kind == frames.ACK and isinstance(frame.get("worker"), str):
                    worker = frame["worker"]
                    self._by_worker.setdefault(frame["worker"], set()).add(token)
                if kind not in frames.TERMINAL:
                    yield frame
                    continue
                # A terminal frame from a worker needs no cancel; one we made up does.
                finished = "origin" not in frame
                yield frame
                return
        finally:
            self._streams.pop(token, None)
            if worker is not None and (tokens := self._by_worker.get(worker)) is not None:
                tokens.discard(token)
                if not tokens:  # no entry outlives its streams (drained workers are not
                    del self._by_worker[worker]  # "removed", so nothing else drops it)
            if span is not None:
                span.end(error_type=ErrorCode.CANCELLED.value)  # unless a frame ended it
            if not finished:
                try:
                    await self.cancel(rid)
                except Exception as exc:
                    log.warning("could not publish cancel for %s: %s", rid, exc)

    async def _next(
        self,
        rid: str,
        queue: asyncio.Queue[Msg | frames.Frame],
        expected_seq: int,
        worker: str | None,
        silent_since: float,
        reassured_at: float,
        deadline: float | None,
    ) -> Msg | frames.Frame | None:
        """The next reply; a terminal frame made up here; or None after a good ping.

        `silent_since`: the last frame (the idle timeout counts from it); `reassured_at`:
        the last frame or good ping (the next ping is due `ping_after_s` after it)."""
        if not queue.empty():
            return queue.get_nowait()
        loop = asyncio.get_running_loop()
        acked = expected_seq > 0
        window = self.idle_timeout_s if acked else self.ack_timeout_s
        limit = silent_since + window
        # Acknowledged: wake early to ask a silent worker whether it is still there.
        wake = min(limit, reassured_at + self.ping_after_s) if acked else limit
        if deadline is not None:
            wake = min(wake, deadline)
        try:
            async with asyncio.timeout_at(max(wake, loop.time())):
                return await queue.get()
        except TimeoutError:
            pass
        now = loop.time()
        if deadline is not None and now >= deadline:
            return frames.synthetic_err(
                "", ErrorCode.DEADLINE_EXCEEDED, "the request's deadline passed"
            )
        if now >= limit:
            what = "sent a frame" if acked else "acknowledged the request"
            message = f"no worker {what} within {window:g}s"
            return frames.synthetic_err("", ErrorCode.UNAVAILABLE, message)
        # The ping waits no longer than the deadline allows (the next round reports it).
        ping_timeout = PING_TIMEOUT_S if deadline is None else min(PING_TIMEOUT_S, deadline - now)
        if worker is None or ping_timeout <= 0:
            return None
        failure = await self._ping(worker, rid, ping_timeout)
        if failure is not None and queue.empty():  # a frame that came meanwhile wins
            return frames.synthetic_err("", ErrorCode.UNAVAILABLE, failure)
        return None

    async def _ping(self, worker: str, rid: str, timeout: float) -> str | None:
        """Ask a silent worker about request `rid`: None while it may still run it, else why
        the stream is dead. Only "nobody is subscribed" means the worker is gone, and only
        "not running" means the stream's last frames were lost (say, in a NATS outage): a
        slow answer is a busy worker, and that is what the idle timeout is for."""
        subject = self.subjects.worker_ping(worker)
        try:
            # Pings are where a frontend handler usually is when its client disconnects.
            reply = await keep_cancel(self.nc.request(subject, rid.encode(), timeout=timeout))
        except NoRespondersError:
            loop = asyncio.get_running_loop()
            self._dead[worker] = loop.time() + DEAD_WORKER_QUARANTINE_S
            return f"worker {worker} is gone (its ping subject has no responders)"
        except (NatsTimeoutError, NatsError):
            return None
        if reply.data == PING_NOT_RUNNING:
            return f"worker {worker} no longer runs the request (its last frames were lost)"
        return None

    def _avoiding_dead(self, envelope: Envelope, pinned: bool) -> Envelope:
        """`envelope`, excluding the workers this client found dead lately: a router may
        still list them, and each would cost a request its acknowledgement timeout."""
        if not self._dead or pinned:
            return envelope
        now = asyncio.get_running_loop().time()
        self._dead = {w: until for w, until in self._dead.items() if until > now}
        dead = set(self._dead) - set(envelope.routing.exclude)
        if not dead:
            return envelope
        routing = envelope.routing.copy()
        routing.exclude = sorted(set(routing.exclude) | dead)
        return replace(envelope, routing=routing)

    def _read(self, rid: str, msg: Msg, target: str, expected_seq: int) -> frames.Frame:
        """Decode and check one reply; problems become a terminal `err` frame."""
        if is_no_responders(msg):
            frame = frames.synthetic_err(
                rid, ErrorCode.NO_WORKER, f"nothing is subscribed to {target}"
            )
            # Routers go missing for a moment when they reconnect to NATS; a worker subject
            # is a pinned request's, which never moves.
            frame["retryable"] = target == self.subjects.router_generate
            return frame
        try:
            frame = frames.check(message_codec(msg).decode(msg.data))
        except (UnknownCodecError, CodecError, frames.FrameError) as exc:
            return frames.synthetic_err(rid, ErrorCode.INTERNAL, f"unreadable reply frame: {exc}")
        # Rejections sent before a worker admitted the request carry seq 0 as well.
        if frame["seq"] != expected_seq and frame["t"] != frames.ERR:
            return frames.synthetic_err(
                rid,
                ErrorCode.UNAVAILABLE,
                f"reply frames lost: expected seq {expected_seq}, got {frame['seq']}",
            )
        return frame


def _loop_deadline(deadline: float | None) -> float | None:
    """A Unix-time deadline on the event loop's clock."""
    if deadline is None:
        return None
    return asyncio.get_running_loop().time() + (deadline - time.time())


def _skip_experts(frame: frames.Frame, skip: int) -> int:
    """Drop the first `skip` routed-expert values of a continuation's frames, and return
    how many are still to drop: it reports rows from the original start again (an engine
    may send them only with its last chunk), and the client has the ones delivered."""
    rows = frame.get("routed_experts")
    if not rows or skip <= 0:
        return skip
    kept: list[list[int]] = []
    for row in rows:
        if skip >= len(row):
            skip -= len(row)
            continue
        kept.append(row[skip:])
        skip = 0
    frame["routed_experts"] = kept
    return skip

"""`MeshClient`: sends request envelopes and reads their reply frames from one inbox.

Each `generate` call runs a request's attempts (`client.attempt.Attempt`), as its
`Migrator` (`client.migration`) describes them; the client itself keeps what all requests
share: the connection and its wildcard reply inbox, the streams open on it, which worker
serves which stream (to fail them when discovery drops the worker), and the quarantine of
workers found dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from types import TracebackType
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from genmesh.client.attempt import Attempt, Failure, Incoming
from genmesh.client.migration import (
    DEFAULT_MIGRATION_LIMIT,
    ClientFrame,
    MigrationReason,
    Migrator,
    Quarantine,
)
from genmesh.codecs import Codec, get_codec
from genmesh.routing.admission import Admission
from genmesh.shared import frames
from genmesh.shared.bus import (
    check_subscriptions,
    connect,
    drain_or_close,
    publish,
    unsubscribe_quietly,
    wait_connected,
)
from genmesh.shared.credentials import NatsAuth
from genmesh.shared.discovery import WorkerDirectory, WorkerInfo
from genmesh.shared.envelope import (
    Envelope,
    OutputOptions,
    Routing,
    Sampling,
    TokenIds,
    token_array,
)
from genmesh.shared.errors import ErrorCode
from genmesh.shared.ids import new_request_id
from genmesh.shared.subjects import Subjects

log = logging.getLogger(__name__)

DEFAULT_ACK_TIMEOUT_S = 2.0
DEFAULT_IDLE_TIMEOUT_S = 60.0
DEFAULT_PING_AFTER_S = 0.5
# How long a request waits for a connection that is down to come back (a NATS node died,
# or the server restarted: nats-py reconnects within about half a second).
DEFAULT_RECONNECT_HOLD_S = 2.0
# A reply inbox carries every stream of this client; let it queue generously.
_INBOX_PENDING_MSGS = 1_000_000
_INBOX_PENDING_BYTES = 1 << 30


def request(
    token_ids: Sequence[int],
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
    """A request envelope with a fresh private ID, for the common knobs. `token_ids` is any
    sequence of token IDs, checked here as a worker checks them (`EnvelopeError`)."""
    return Envelope(
        id=new_request_id(),
        # A token array is checked as it is; any other sequence as the list it holds.
        token_ids=token_array(
            token_ids if isinstance(token_ids, TokenIds) else list(token_ids), "token_ids"
        ),
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
        reconnect_hold_s: float = DEFAULT_RECONNECT_HOLD_S,
        migration_limit: int = DEFAULT_MIGRATION_LIMIT,
        directory: WorkerDirectory | None = None,
        router: Admission | None = None,
        owns_connection: bool = False,
        attempt_spans: bool = True,
    ) -> None:
        """`directory`: discovery, whose departures fail the streams of the workers that
        left (a migration trigger). `router`: route each attempt here, straight to the
        worker it chooses, instead of through the router processes. `reconnect_hold_s`:
        how long a request waits to be sent while the connection is down (0: it goes
        into nats-py's reconnect buffer at once, and its acknowledgement timeout runs)."""
        self.nc = nc
        # A span per attempt (tracing on); False when the caller's span stands for the
        # request (the frontend's): then only failed attempts get one (client/tracing.py).
        self.attempt_spans = attempt_spans
        self.subjects = Subjects(namespace)
        self.codec: Codec = get_codec(codec)
        self.ack_timeout_s = ack_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.ping_after_s = ping_after_s
        self.reconnect_hold_s = reconnect_hold_s
        self.migration_limit = migration_limit
        self.migrations = 0
        self.router = router
        # Workers found dead: every request this client sends avoids them for a while.
        self.quarantine = Quarantine()
        self._owns_connection = owns_connection
        self._inbox = nc.new_inbox()
        # Per stream token: its replies, or a failure detected outside the stream.
        self._streams: dict[str, asyncio.Queue[Incoming]] = {}
        # Worker id -> tokens of the streams it serves, to fail them when it disappears.
        self._by_worker: dict[str, set[str]] = {}
        self._tokens = itertools.count()
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

    async def hold_until_connected(self, limit_s: float | None = None) -> str | None:
        """None once the connection is up, after waiting for it while it reconnects (the
        reconnect hold, at most `limit_s`); else why a request cannot go out."""
        hold = self.reconnect_hold_s
        if limit_s is not None:
            hold = round(max(0.0, min(hold, limit_s)), 3)
        if await wait_connected(self.nc, hold):
            return None
        return f"not connected to NATS (still reconnecting after {hold:g}s)"

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
    ) -> AsyncGenerator[ClientFrame, None]:
        """Dispatch `envelope` (to `subject` if given, else to the worker this client's
        `router` chooses, else to the routers); yield its frames, and a `mig` frame before
        each attempt after the first.

        `no_migration`: why this request must not continue elsewhere once tokens were
        delivered (a restart before any token is always safe). Pinned requests (a
        `subject`, or `routing.worker`) never migrate.
        """
        if self._sub is None:
            raise RuntimeError("MeshClient.start() has not been called")
        pinned = subject is not None or envelope.routing.worker is not None
        loop = asyncio.get_running_loop()
        migrator = Migrator(
            envelope,
            limit=0 if pinned else self.migration_limit,
            no_migration=no_migration,
            quarantine=None if pinned else self.quarantine,
            deadline=_loop_deadline(envelope.deadline),
            clock=loop.time,
        )
        while True:
            attempt = Attempt(self, migrator.envelope, subject, migrator.deadline)
            async with contextlib.aclosing(attempt.stream()) as stream:
                async for frame in stream:
                    if not migrator.accept(frame):
                        break  # a failure the request may survive
                    yield frame
                    if frame["t"] in frames.TERMINAL:
                        return
            following = migrator.next(attempt.failure, attempt.worker)
            yield following
            if following["t"] == frames.ERR:
                return
            self.migrations += 1
            log.info(
                "request %s: attempt %d after: %s (%d tokens delivered)",
                envelope.id,
                following["attempt"],
                following["message"],
                following["delivered"],
            )
            if migrator.pause:
                await asyncio.sleep(migrator.pause)

    # ------------------------------------------------------------ for the attempts

    def open_stream(self) -> tuple[str, asyncio.Queue[Incoming]]:
        """A fresh reply token on this client's inbox, and the queue its replies go to."""
        token = str(next(self._tokens))
        queue: asyncio.Queue[Incoming] = asyncio.Queue()
        self._streams[token] = queue
        return token, queue

    def reply_subject(self, token: str) -> str:
        return f"{self._inbox}.{token}"

    def watch_worker(self, worker: str, token: str) -> None:
        """Stream `token` is served by `worker`: fail it if discovery drops the worker."""
        self._by_worker.setdefault(worker, set()).add(token)

    def close_stream(self, token: str, worker: str | None) -> None:
        self._streams.pop(token, None)
        if worker is not None and (tokens := self._by_worker.get(worker)) is not None:
            tokens.discard(token)
            if not tokens:  # no entry outlives its streams (drained workers are not
                del self._by_worker[worker]  # "removed", so nothing else drops it)

    async def _on_reply(self, msg: Msg) -> None:
        queue = self._streams.get(msg.subject[len(self._inbox) + 1 :])
        if queue is not None:
            queue.put_nowait(msg)

    def _on_directory_change(self, event: str, worker: WorkerInfo) -> None:
        # Not on "draining": a draining worker lets its requests finish, or hands them back.
        if event != "removed":
            return
        gone = Failure(
            MigrationReason.LEFT_DISCOVERY,
            ErrorCode.UNAVAILABLE,
            f"worker {worker.id} left the mesh",
        )
        for token in self._by_worker.pop(worker.id, set()):
            queue = self._streams.get(token)
            if queue is not None:
                queue.put_nowait(gone)


def _loop_deadline(deadline: float | None) -> float | None:
    """A Unix-time deadline on the event loop's clock."""
    if deadline is None:
        return None
    return asyncio.get_running_loop().time() + (deadline - time.time())

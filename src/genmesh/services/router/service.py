"""The router: picks a worker per request (the routing core, `genmesh.routing`) and
forwards the request bytes to it.

The forward keeps the requester's reply subject, so the token stream goes straight from
the worker to the requester. Routers share the queue group `router`: each request reaches
exactly one of them, and any of them can fail without losing the subject.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter

from nats.aio.client import Client
from nats.aio.msg import Msg

from genmesh.codecs import Codec, get_codec
from genmesh.routing.admission import Admission
from genmesh.routing.busy import AdmissionConfig
from genmesh.routing.choice import Chooser, Decision
from genmesh.routing.kv_feed import kv_subscriber
from genmesh.routing.pairing import PdConfig
from genmesh.routing.policies import KvConfig, Policy, make_policy
from genmesh.services.router import tracing as router_tracing
from genmesh.shared import frames, tracing
from genmesh.shared.bus import (
    PREFILL_HEADER,
    PayloadTooLarge,
    check_fits,
    check_subscriptions,
    codec_headers,
    message_codec,
    publish,
    unsubscribe_quietly,
)
from genmesh.shared.discovery import WorkerDirectory
from genmesh.shared.endpoint import EnvelopeEndpoint, Request
from genmesh.shared.envelope import peek_id
from genmesh.shared.errors import ErrorCode, MeshError
from genmesh.shared.lifecycle import Service
from genmesh.shared.micro import MicroService
from genmesh.shared.subjects import ROUTER_QUEUE_GROUP, Subjects
from genmesh.shared.tasks import TaskOwner

log = logging.getLogger(__name__)

# While a request waits in this router's admission queue, its requester hears a `ka`
# outside the stream's numbering this often (docs/protocol.md §6.4): well within the
# requester's acknowledgement timeout (2 s by default), which it restarts.
HELD_KEEPALIVE_S = 0.5


class _Held:
    """A request waiting in the admission queue: where its keep-alives go, and the task
    that waits for it."""

    __slots__ = ("codec", "reply", "task")

    def __init__(self, reply: str, codec: Codec, task: asyncio.Task[None]) -> None:
        self.reply = reply
        self.codec = codec
        self.task = task


class Router(Service):
    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        *,
        policy: str = "round_robin",
        kv: KvConfig | None = None,
        router_id: str = "",
        heartbeat_interval_s: float = 1.0,
        admission: AdmissionConfig | None = None,
        pd: PdConfig | None = None,
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.router_id = router_id
        self.policy: Policy = make_policy(policy, kv)
        self.directory = WorkerDirectory(nc, subjects)
        self.kv = kv_subscriber(self.policy, nc, subjects, self.directory)
        self.endpoint = EnvelopeEndpoint(
            nc,
            subjects.router_generate,
            self._route,
            queue=ROUTER_QUEUE_GROUP,
            # A router holds a request only while it waits in the admission queue: once
            # forwarded, it is its worker's.
            micro_data=lambda: {"inflight": len(self._held)},
        )
        # Answers `$SRV` (docs/protocol.md, "$SRV (NATS micro)").
        self.micro = MicroService(
            nc,
            role="router",
            namespace=subjects.namespace,
            description=f"genmesh router {router_id} (policy {self.policy.name})",
            metadata={"router_id": router_id},
        )
        self.micro.add(self.endpoint.micro)
        config = admission or AdmissionConfig()
        self.admission = Admission(
            Chooser(self.directory, self.policy, config, pd), config, f"router {router_id}"
        )
        # Requests waiting in the admission queue, by id.
        self._held: dict[str, _Held] = {}
        self.decisions: Counter[str] = Counter()
        self.heartbeat_interval_s = heartbeat_interval_s
        self._tasks = TaskOwner(f"router {router_id}")
        # What start() set up, undone in reverse order by stop().
        self._running = contextlib.AsyncExitStack()

    @property
    def rejections(self) -> Counter[str]:
        """Requests this router answered with an error itself, by error code (read with
        `decisions` by services/router/metrics.py)."""
        return self.endpoint.rejections

    async def start(self) -> None:
        async with contextlib.AsyncExitStack() as stack:
            await self.directory.start()
            stack.push_async_callback(self.directory.close)
            if self.kv is not None:
                await self.kv.start()
                stack.push_async_callback(self.kv.close)
            subs = [
                await self.endpoint.subscribe(),
                await self.nc.subscribe(self.subjects.query, cb=self._on_query),
            ]
            queue = self.admission.config.queue_size > 0
            if queue:  # a requester that gives up cancels what waits here too
                subs.append(await self.nc.subscribe(self.subjects.cancel, cb=self._on_cancel))
            for sub in subs:
                stack.push_async_callback(unsubscribe_quietly, sub)
            await check_subscriptions(self.nc, *subs)
            await self.micro.start()
            stack.push_async_callback(self.micro.stop)
            stack.push_async_callback(self._leave)
            stack.push_async_callback(self._tasks.close)
            stack.push_async_callback(self._refuse_held)
            self._tasks.spawn(self._presence_loop(), name="presence")
            if queue:
                self._tasks.spawn(self._held_keepalive_loop(), name="held keep-alives")
            self._running = stack.pop_all()
        log.info(
            "router %s on %s (policy %s)",
            self.router_id,
            self.subjects.router_generate,
            self.policy.name,
        )

    async def stop(self) -> None:
        """Stop the presence heartbeat, announce the leave, unsubscribe, stop discovery."""
        await self._running.aclose()

    async def _announce(self, *, leaving: bool = False) -> None:
        presence = {
            "id": self.router_id,
            "policy": self.policy.name,
            "heartbeat_s": self.heartbeat_interval_s,
            "leaving": leaving,
        }
        await publish(self.nc, self.subjects.router_presence, get_codec(None), presence)

    async def _leave(self) -> None:
        try:
            await self._announce(leaving=True)
        except Exception as exc:  # NATS may already be gone
            log.debug("could not announce leave: %s", exc)

    async def _presence_loop(self) -> None:
        while True:
            try:
                # Not while disconnected: a presence buffered then would arrive on reconnect,
                # before this router's directory knows any worker again.
                if self.nc.is_connected:
                    await self._announce()
            except Exception as exc:
                log.warning("router presence not announced: %s", exc)
            await asyncio.sleep(self.heartbeat_interval_s)

    async def _on_query(self, msg: Msg) -> None:
        if not self._tasks.closed:  # once stopping, a late announce would undo the leave
            await self._announce()

    async def _route(self, request: Request) -> None:
        """Forward `request` to the worker `choose` picks, or raise why there is none; or
        hold it in the admission queue (in a task: this callback must not wait)."""
        msg, envelope = request.msg, request.envelope
        span = router_tracing.router_span(
            msg.headers, self.subjects.router_generate, envelope, self.policy.name, self.router_id
        )
        try:
            decision = self.admission.choose(envelope)
        except MeshError as exc:
            router_tracing.rejected(span, exc.code, exc.message)
            raise
        if decision is None:
            rid = envelope.id
            if rid in self._held:  # as a worker refuses a request id it runs already
                raise MeshError(ErrorCode.INVALID_ARGUMENT, f"request id {rid} is already waiting")
            task = self._tasks.spawn(self._hold(request, span), name=f"held {rid}")
            self._held[rid] = _Held(msg.reply, request.codec, task)
            return
        await self._forward(request, decision, span)

    async def _hold(self, request: Request, span: router_tracing.HopSpan | None) -> None:
        """Wait in the admission queue, then forward; or send the refusal."""
        rid = request.envelope.id
        since = asyncio.get_running_loop().time()
        try:
            decision = await self.admission.wait(request.envelope)
        except MeshError as exc:
            router_tracing.rejected(span, exc.code, exc.message)
            await self.endpoint.refuse(request.reply, request.codec, rid, exc)
            return
        except asyncio.CancelledError:  # its requester cancelled it, or the router stops
            router_tracing.rejected(span, ErrorCode.CANCELLED, "request was cancelled")
            raise
        finally:
            self._held.pop(rid, None)
        if span is not None:
            tracing.admission_waited(span.span, asyncio.get_running_loop().time() - since)
        try:
            await self._forward(request, decision, span)
        except MeshError as exc:
            await self.endpoint.refuse(request.reply, request.codec, rid, exc)

    async def _held_keepalive_loop(self) -> None:
        while True:
            await asyncio.sleep(HELD_KEEPALIVE_S)
            for rid, held in list(self._held.items()):
                try:
                    await self.nc.publish(
                        held.reply,
                        held.codec.encode(frames.held(rid)),
                        headers=codec_headers(held.codec),
                    )
                except Exception as exc:
                    log.debug("keep-alive for held request %s failed: %s", rid, exc)

    async def _on_cancel(self, msg: Msg) -> None:
        try:
            rid = peek_id(message_codec(msg).decode(msg.data))
        except Exception:  # not ours to judge: workers log unreadable cancels
            return
        held = self._held.pop(rid, None) if rid is not None else None
        if held is not None:
            held.task.cancel()  # it leaves the queue; its requester has gone

    async def _refuse_held(self) -> None:
        """On stop: refuse what waits (retryable: another router may serve it), and let
        the refusals go out before the tasks are cancelled."""
        self.admission.close()
        waiting = [held.task for held in self._held.values()]
        if waiting:
            await asyncio.wait(waiting, timeout=1.0)

    async def _forward(
        self, request: Request, decision: Decision, span: router_tracing.HopSpan | None
    ) -> None:
        msg = request.msg
        worker = decision.worker
        self.decisions[worker.id] += 1
        # The original bytes and headers (codec) go on untouched, but for the trace context
        # (with tracing on, this router's span becomes the worker span's parent) and the
        # pairing, which is this router's to make: a requester's own is dropped.
        headers = msg.headers
        if span is not None:
            headers = router_tracing.routed(
                span, worker, decision.candidates, headers, decision.prefill
            )
        if decision.prefill is not None:
            headers = {**(headers or {}), PREFILL_HEADER: decision.prefill.id}
        elif headers and PREFILL_HEADER in headers:
            headers = {k: v for k, v in headers.items() if k != PREFILL_HEADER}
        try:
            # The headers this router adds may tip a request that only just fitted over
            # the server's limit, and the server would close this router's connection.
            check_fits(self.nc.max_payload, msg.data, headers)
        except PayloadTooLarge as exc:
            error = MeshError(ErrorCode.INVALID_ARGUMENT, f"the request is too large: {exc}")
            router_tracing.rejected(span, error.code, error.message)
            raise error from None
        await self.nc.publish(worker.subject, msg.data, reply=msg.reply, headers=headers)

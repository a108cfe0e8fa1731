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

from genmesh.codecs import get_codec
from genmesh.routing.choice import Chooser
from genmesh.routing.kv_feed import kv_subscriber
from genmesh.routing.policies import KvConfig, Policy, make_policy
from genmesh.services.router import tracing as router_tracing
from genmesh.shared.bus import check_subscriptions, publish, unsubscribe_quietly
from genmesh.shared.discovery import WorkerDirectory
from genmesh.shared.endpoint import EnvelopeEndpoint, Request
from genmesh.shared.errors import MeshError
from genmesh.shared.lifecycle import Service
from genmesh.shared.subjects import ROUTER_QUEUE_GROUP, Subjects
from genmesh.shared.tasks import TaskOwner

log = logging.getLogger(__name__)


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
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.router_id = router_id
        self.policy: Policy = make_policy(policy, kv)
        self.directory = WorkerDirectory(nc, subjects)
        self.kv = kv_subscriber(self.policy, nc, subjects, self.directory)
        self.endpoint = EnvelopeEndpoint(
            nc, subjects.router_generate, self._route, queue=ROUTER_QUEUE_GROUP
        )
        self.chooser = Chooser(self.directory, self.policy)
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
            for sub in subs:
                stack.push_async_callback(unsubscribe_quietly, sub)
            await check_subscriptions(self.nc, *subs)
            stack.push_async_callback(self._leave)
            stack.push_async_callback(self._tasks.close)
            self._tasks.spawn(self._presence_loop(), name="presence")
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
        """Forward `request` to the worker `choose` picks, or raise why there is none."""
        msg, envelope = request.msg, request.envelope
        span = router_tracing.router_span(
            msg.headers, self.subjects.router_generate, envelope, self.policy.name, self.router_id
        )
        try:
            decision = self.chooser.choose(envelope)
        except MeshError as exc:
            router_tracing.rejected(span, exc.code, exc.message)
            raise
        worker = decision.worker
        self.decisions[worker.id] += 1
        # The original bytes and headers (codec) go on untouched, but for the trace context:
        # with tracing on, this router's span becomes the worker span's parent.
        headers = msg.headers
        if span is not None:
            headers = router_tracing.routed(span, worker, decision.candidates, headers)
        await self.nc.publish(worker.subject, msg.data, reply=msg.reply, headers=headers)

"""The NATS micro service (ADR-32, the "Service API") each genmesh process runs, so that
`nats micro ls|info|stats genmesh` list the mesh (docs/protocol.md, "$SRV (NATS micro)").

It answers `$SRV.PING|INFO|STATS`, `$SRV.<VERB>.genmesh` and `$SRV.<VERB>.genmesh.<id>`
with nats.micro's own response types (`nats.micro.service`: the JSON the NATS CLI parses),
but it is not nats.micro's `Service`: that one subscribes each endpoint itself, with a
handler that answers once and is timed around that answer. genmesh's endpoints keep their
own subscriptions (the generate subject's queue group, trace context and codec checks in
`shared/endpoint.py`), and a generate request is answered by a stream of frames from a
task its callback spawns. So the services keep subscribing as they did, and feed the
counts of a `MicroEndpoint` per subject from their handlers: a few integer additions and
two clock reads per message (docs/performance.md, "$SRV (NATS micro)").
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Protocol, TypeVar

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.micro.service import (
    EndpointInfo,
    EndpointStats,
    ServiceInfo,
    ServicePing,
    ServiceStats,
    ServiceVerb,
    control_subject,
)
from nats.nuid import NUID

from genmesh import __version__
from genmesh.shared.bus import NatsPermissionDenied, check_subscriptions, unsubscribe_quietly
from genmesh.shared.lifecycle import Service

log = logging.getLogger(__name__)

# Every genmesh process is an instance of one service; `role` in its metadata tells them
# apart (a namespace too: `namespace`).
SERVICE_NAME = "genmesh"

# A `last_error` keeps at most this many characters (docs/limits.md): error messages may
# quote what a client sent, and a STATS answer must stay small.
MAX_LAST_ERROR = 256

Callback = Callable[[Msg], Awaitable[None]]


class Reported(Protocol):
    """An endpoint as `$SRV.INFO` and `$SRV.STATS` report it."""

    def info(self) -> EndpointInfo: ...

    def stats(self) -> EndpointStats: ...


E = TypeVar("E", bound=Reported)


class MicroEndpoint:
    """One subject a process serves, with the counts `$SRV.STATS` reports for it.

    Whoever handles the subject's messages feeds it: `received` as a message arrives
    (it returns the clock reading `handled` takes), `handled` when the handler is done
    with it, `failed` for a request that ends in an error (what counts as one is each
    endpoint's, docs/protocol.md). `data`, if given, makes the endpoint's stats `data`."""

    __slots__ = (
        "data",
        "last_error",
        "name",
        "num_errors",
        "num_requests",
        "processing_ns",
        "queue_group",
        "subject",
    )

    def __init__(
        self,
        name: str,
        subject: str,
        queue_group: str = "",
        data: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.name = name
        self.subject = subject
        self.queue_group = queue_group
        self.data = data
        self.num_requests = 0
        self.num_errors = 0
        self.last_error = ""
        self.processing_ns = 0

    def received(self) -> int:
        self.num_requests += 1
        return time.perf_counter_ns()

    def handled(self, since_ns: int) -> None:
        self.processing_ns += time.perf_counter_ns() - since_ns

    def failed(self, error: str) -> None:
        self.num_errors += 1
        self.last_error = error[:MAX_LAST_ERROR]

    def counted(self, callback: Callback) -> Callback:
        """`callback`, counted here: every message a request, a raise an error."""

        async def counting(msg: Msg) -> None:
            since = self.received()
            try:
                await callback(msg)
            except Exception as exc:
                self.failed(repr(exc))
                raise
            finally:
                self.handled(since)

        return counting

    def info(self) -> EndpointInfo:
        return EndpointInfo(self.name, self.subject, self.queue_group, metadata={})

    def stats(self) -> EndpointStats:
        requests = self.num_requests
        return EndpointStats(
            name=self.name,
            subject=self.subject,
            queue_group=self.queue_group,
            num_requests=requests,
            num_errors=self.num_errors,
            processing_time=self.processing_ns,
            average_processing_time=self.processing_ns // requests if requests else 0,
            last_error=self.last_error,
            data=self.data() if self.data is not None else None,
        )


class MicroService(Service):
    """Answers the `$SRV` requests for one process: its identity (`metadata` holds the
    namespace and role, and what else the role adds) and its endpoints' counts.

    nats-py restores the subscriptions after a reconnect, so the service goes on answering
    without help; `stop` unsubscribes."""

    def __init__(
        self,
        nc: Client,
        *,
        role: str,
        namespace: str,
        description: str,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self.nc = nc
        self.id = NUID().next().decode()
        self.description = description
        self.metadata = {"namespace": namespace, "role": role, **(metadata or {})}
        self.endpoints: list[Reported] = []
        self.started = datetime.now(UTC)
        self._subs: list[Subscription] = []

    def add(self, endpoint: E) -> E:
        """List `endpoint` (from the next `$SRV` request on)."""
        self.endpoints.append(endpoint)
        return endpoint

    async def start(self) -> None:
        """Subscribe to the control subjects. A NATS user that may not (permissions from
        before `$SRV`) leaves the process serving as it did, unlisted: a warning says so."""
        answers = {
            ServiceVerb.PING: self._answer(self.ping),
            ServiceVerb.INFO: self._answer(self.info),
            ServiceVerb.STATS: self._answer(self.stats),
        }
        try:
            for verb, answer in answers.items():
                for name, sid in ((None, None), (SERVICE_NAME, None), (SERVICE_NAME, self.id)):
                    subject = control_subject(verb, name=name, id=sid)
                    self._subs.append(await self.nc.subscribe(subject, cb=answer))
            await check_subscriptions(self.nc, *self._subs)
        except NatsPermissionDenied as exc:
            log.warning("not answering $SRV (NATS micro): %s", exc)
            await self.stop()
        except BaseException:
            await self.stop()
            raise
        self.started = datetime.now(UTC)

    async def stop(self) -> None:
        subs, self._subs = self._subs, []
        for sub in subs:
            await unsubscribe_quietly(sub)

    def ping(self) -> dict[str, Any]:
        return ServicePing(self.id, SERVICE_NAME, __version__, self.metadata).to_dict()

    def info(self) -> dict[str, Any]:
        return ServiceInfo(
            name=SERVICE_NAME,
            id=self.id,
            version=__version__,
            description=self.description,
            endpoints=[endpoint.info() for endpoint in self.endpoints],
            metadata=self.metadata,
        ).to_dict()

    def stats(self) -> dict[str, Any]:
        return ServiceStats(
            id=self.id,
            name=SERVICE_NAME,
            version=__version__,
            started=self.started,
            endpoints=[endpoint.stats() for endpoint in self.endpoints],
            metadata=self.metadata,
        ).to_dict()

    def _answer(self, make: Callable[[], dict[str, Any]]) -> Callback:
        async def answer(msg: Msg) -> None:
            if msg.reply:
                await self.nc.publish(msg.reply, json.dumps(make()).encode())

        return answer

"""A prefill/decode pair on the wire, over real NATS: the routing core's pairing travels as
the `genmesh-prefill` header, sent by a router when it forwards and by a frontend that
routes itself (its attempt), and both count the path in `genmesh_pd_routed_total`.

The workers here are stand-ins that announce a decode or prefill card and record what
reaches their generate subject: the decode worker's side of P/D (running the prefill
stage) is tested with the engines. The choice itself: tests/unit/test_pd_routing.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import generate_latest

from genmesh.client import MeshClient, request
from genmesh.codecs import get_codec
from genmesh.routing.pairing import PdConfig
from genmesh.services.frontend.serve import start_frontend
from genmesh.services.router.metrics import router_registry
from genmesh.services.router.service import Router
from genmesh.shared import frames, tracing
from genmesh.shared.bus import (
    PREFILL_HEADER,
    codec_headers,
    flush_in_order,
    message_codec,
    publish,
)
from genmesh.shared.envelope import Envelope
from genmesh.shared.subjects import Subjects
from genmesh.shared.tracing import PD_PREFILL_WORKER, ROUTER, WORKER
from tests.http_util import post
from tests.mesh import frontend_options

pytestmark = pytest.mark.inproc

MSGPACK = get_codec(None)


class StandIn:
    """A worker's card (announced at start and on every discovery query) and generate
    subject: it answers each request with an `ack` and an `end` of one token, and keeps
    the headers and envelope of each."""

    def __init__(self, nc: Client, subjects: Subjects, wid: str, role: str) -> None:
        self.nc = nc
        self.subjects = subjects
        self.wid = wid
        self.card: dict[str, Any] = {
            "id": wid,
            "subject": subjects.worker_generate(wid),
            "inflight": 0,
            "capacity": 8,
            "heartbeat_s": 30.0,
            "model": "m",
            "role": role,
        }
        if role != "both":
            # As services/worker/service.py announces it: {"kind": pd_kind, **pd_card()}.
            self.card["disagg"] = {"kind": "mock", "local_prefill": False}
        self.received: list[tuple[dict[str, str], Envelope]] = []
        self.generate: Subscription | None = None

    async def start(self) -> None:
        await self.serve()
        await self.nc.subscribe(self.subjects.query, cb=self._announce)  # as workers do
        await flush_in_order(self.nc)
        await self._announce()

    async def serve(self) -> None:
        """Subscribe to the generate subject (again, after `generate.unsubscribe()`)."""
        self.generate = await self.nc.subscribe(
            self.subjects.worker_generate(self.wid), cb=self._serve
        )
        await flush_in_order(self.nc)

    async def _announce(self, _: Msg | None = None) -> None:
        await publish(self.nc, self.subjects.announce, MSGPACK, self.card)

    async def _serve(self, msg: Msg) -> None:
        codec = message_codec(msg)
        envelope = Envelope.from_wire(codec.decode(msg.data))
        self.received.append((dict(msg.headers or {}), envelope))
        end: frames.EndFrame = {
            "t": "end",
            "id": envelope.id,
            "seq": 1,
            "tokens": [5],
            "finish": {"reason": "length"},
            "usage": {"prompt_tokens": len(envelope.token_ids), "completion_tokens": 1},
        }
        for frame in (frames.ack(envelope.id, self.wid, "run"), end):
            await self.nc.publish(msg.reply, codec.encode(frame), headers=codec_headers(codec))

    def prefill_headers(self) -> list[str | None]:
        return [headers.get(PREFILL_HEADER) for headers, _ in self.received]


async def stand_ins(nc: Client, namespace: str, *roles: tuple[str, str]) -> dict[str, StandIn]:
    subjects = Subjects(namespace)
    found = {wid: StandIn(nc, subjects, wid, role) for wid, role in roles}
    for stand_in in found.values():
        await stand_in.start()
    return found


async def eventually(predicate: Any, what: str, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def pd_routed(exposition: str) -> dict[str, float]:
    prefix = "genmesh_pd_routed_total{path="
    return {
        line[len(prefix) + 1 : line.index('"}')]: float(line.rsplit(" ", 1)[1])
        for line in exposition.splitlines()
        if line.startswith(prefix)
    }


async def test_a_router_forwards_the_pair_as_a_header(nc: Client, namespace: str) -> None:
    subjects = Subjects(namespace)
    router = Router(nc, subjects, router_id="r-pd", pd=PdConfig())
    await router.start()
    workers = await stand_ins(nc, namespace, ("d1", "decode"), ("p1", "prefill"))
    client = MeshClient(nc, namespace)  # no routing of its own: through the router
    await client.start()
    try:
        await eventually(lambda: len(router.directory.live()) == 2, "both cards")
        replies = [f async for f in client.generate(request([1, 2, 3], max_tokens=1))]
        assert [f["t"] for f in replies] == ["ack", "end"]
        assert workers["d1"].prefill_headers() == ["p1"]
        assert workers["p1"].received == []  # the decode worker sends the prefill stage
        exposition = generate_latest(router_registry(router)).decode()
        assert pd_routed(exposition) == {"disaggregated": 1, "local": 0, "fallback": 0}
    finally:
        await client.close()
        await router.stop()


async def test_the_routers_span_names_the_pair(nc: Client, namespace: str) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    router = Router(nc, Subjects(namespace), router_id="r-pdt")
    await router.start()
    await stand_ins(nc, namespace, ("d1", "decode"), ("p1", "prefill"))
    client = MeshClient(nc, namespace)
    await client.start()
    try:
        await eventually(lambda: len(router.directory.live()) == 2, "both cards")
        assert [f["t"] async for f in client.generate(request([1, 2, 3]))] == ["ack", "end"]
        [span] = [s for s in exporter.get_finished_spans() if ROUTER in (s.attributes or {})]
        attributes = dict(span.attributes or {})
        assert (attributes[WORKER], attributes[PD_PREFILL_WORKER]) == ("d1", "p1")
    finally:
        await client.close()
        await router.stop()
        tracing.install(None)
        provider.shutdown()


async def test_a_router_drops_a_pairing_its_requester_made(nc: Client, namespace: str) -> None:
    """The pairing is the router's to make: a requester's own header does not reach a
    worker the router routes to without one."""
    subjects = Subjects(namespace)
    router = Router(nc, subjects, router_id="r-pd2")
    await router.start()
    workers = await stand_ins(nc, namespace, ("a", "both"))
    try:
        await eventually(lambda: len(router.directory.live()) == 1, "the card")
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        envelope = request([1, 2, 3], max_tokens=1)
        await nc.publish(
            subjects.router_generate,
            MSGPACK.encode(envelope.to_wire()),
            reply=inbox,
            headers={PREFILL_HEADER: "p-forged"},
        )
        ack = MSGPACK.decode((await sub.next_msg(timeout=5)).data)
        assert ack["t"] == "ack"
        assert workers["a"].prefill_headers() == [None]
    finally:
        await router.stop()


async def test_a_frontend_that_routes_itself_sends_the_pair(nats_url: str, nc: Client,
                                                            namespace: str) -> None:  # fmt: skip
    workers = await stand_ins(nc, namespace, ("d1", "decode"), ("p1", "prefill"), ("p2", "prefill"))
    frontend = await start_frontend(frontend_options(nats_url, namespace))
    try:
        await eventually(lambda: len(frontend.state.backend.directory.live()) == 3, "cards")
        url = f"http://127.0.0.1:{frontend.port}"
        for _ in range(2):
            reply = await post(
                f"{url}/generate",
                {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}},
            )
            assert reply.status == 200, reply.body
            assert reply.body["output_ids"] == [5]
        # Round robin over the prefill workers, in its own rotation.
        assert workers["d1"].prefill_headers() == ["p1", "p2"]
        async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as r:
            exposition = await r.text()
        assert pd_routed(exposition) == {"disaggregated": 2, "local": 0, "fallback": 0}
    finally:
        await frontend.close()


async def test_a_request_the_routers_header_would_tip_over_the_limit_is_refused(
    nc: Client, namespace: str
) -> None:
    """An envelope that fits the server's max_payload, but not with the pairing header the
    router adds, is refused in so many words; the router is not cut off the mesh (the
    server closes a connection that publishes past the limit) and serves the next one."""
    subjects = Subjects(namespace)
    router = Router(nc, subjects, router_id="r-pd3")
    await router.start()
    workers = await stand_ins(nc, namespace, ("d1", "decode"), ("p1", "prefill"))
    try:
        await eventually(lambda: len(router.directory.live()) == 2, "both cards")
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        envelope = request([1, 2, 3], max_tokens=1)
        bare = len(MSGPACK.encode(envelope.to_wire()))
        envelope.engine = {"pad": ""}
        padding = nc.max_payload - len(MSGPACK.encode(envelope.to_wire()))
        envelope.engine = {"pad": "x" * padding}
        data = MSGPACK.encode(envelope.to_wire())
        envelope.engine = {"pad": "x" * (padding - (len(data) - nc.max_payload))}  # str32
        data = MSGPACK.encode(envelope.to_wire())
        assert len(data) == nc.max_payload > bare
        await nc.publish(subjects.router_generate, data, reply=inbox)
        refusal = MSGPACK.decode((await sub.next_msg(timeout=5)).data)
        assert (refusal["t"], refusal["code"]) == ("err", "invalid_argument")
        assert refusal["message"].startswith("the request is too large: a message of ")
        assert workers["d1"].received == []
        assert (await sub.next_msg(timeout=5)).data == b""  # the stream's terminator
        assert router.nc.is_connected
        envelope = request([1, 2, 3], max_tokens=1)
        await nc.publish(subjects.router_generate, MSGPACK.encode(envelope.to_wire()), reply=inbox)
        assert MSGPACK.decode((await sub.next_msg(timeout=5)).data)["t"] == "ack"
    finally:
        await router.stop()

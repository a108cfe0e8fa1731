"""Discovery trusts nothing it hears (issue 15 item 8): forged worker cards and router
presence messages, published on a real NATS, neither misdirect requests nor make a
frontend ready; a worker's generate subject comes from its id, never from its card.

What a valid card and presence are is unit-tested in tests/unit/test_cards.py.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from typing import Any

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from genmesh.client import request
from genmesh.codecs import get_codec
from genmesh.services.router.service import Router
from genmesh.shared.bus import flush_in_order, publish
from genmesh.shared.cards import MAX_MESSAGE_BYTES
from genmesh.shared.envelope import Envelope
from genmesh.shared.subjects import Subjects
from tests.http_util import post
from tests.inproc import InProcessMesh
from tests.mesh import wait_until

pytestmark = pytest.mark.inproc

MSGPACK = get_codec(None)
BODY = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}


def forged_card(wid: str, subject: str) -> dict[str, Any]:
    """A card as a worker announces it, but for its `subject`."""
    return {
        "v": 1,
        "id": wid,
        "subject": subject,
        "engine": "mock",
        "model": "genmesh-mock",
        "inflight": 0,
        "capacity": 1000,
        "heartbeat_s": 30.0,
    }


@pytest.fixture
async def nc(empty_mesh: InProcessMesh) -> AsyncIterator[Client]:
    conn = await nats.connect(empty_mesh.nats_url, name="genmesh-test-forger")
    yield conn
    await conn.close()


async def announce(nc: Client, subject: str, *messages: dict[str, Any]) -> None:
    for message in messages:
        await publish(nc, subject, MSGPACK, message)
    await flush_in_order(nc)


async def health(mesh: InProcessMesh) -> tuple[int, str]:
    reply = await post(mesh.http_url + "/health", b"", method="GET")
    return reply.status, str(reply.body)


async def ask_router(nc: Client, subjects: Subjects, envelope: Envelope) -> bytes:
    """Send `envelope` to the routers as a client in another language would (a plain NATS
    request, msgpack, no header); the first reply's bytes."""
    data = MSGPACK.encode(envelope.to_wire())
    return (await nc.request(subjects.router_generate, data, timeout=5)).data


async def stand_in(nc: Client, subject: str) -> list[Msg]:
    """Whoever listens on `subject`: answers each request with `b"here"`, keeps each."""
    received: list[Msg] = []

    async def answer(msg: Msg) -> None:
        received.append(msg)
        await msg.respond(b"here")

    await nc.subscribe(subject, cb=answer)
    await flush_in_order(nc)
    return received


async def test_a_card_naming_the_routers_subject_does_not_make_it_forward_to_itself(
    empty_mesh: InProcessMesh, nc: Client
) -> None:
    """A router sends a worker's requests to the subject derived from its id, with the
    requester's reply subject, never to the subject its card names."""
    subjects = Subjects(empty_mesh.namespace)
    routed: Router = empty_mesh.add_router().value
    on_router_subject = 0

    async def count(msg: Msg) -> None:
        nonlocal on_router_subject
        on_router_subject += 1

    await nc.subscribe(subjects.router_generate, cb=count)
    behind_the_id = await stand_in(nc, subjects.worker_generate("wforged"))
    await announce(nc, subjects.announce, forged_card("wforged", subjects.router_generate))
    await asyncio.to_thread(
        wait_until, lambda: "wforged" in routed.directory.workers, 5.0, 0.02, "the forged card"
    )
    assert await ask_router(nc, subjects, request([1, 2, 3], max_tokens=2)) == b"here"
    await flush_in_order(nc)
    assert on_router_subject == 1
    assert routed.decisions == {"wforged": 1}
    assert [m.subject for m in behind_the_id] == [subjects.worker_generate("wforged")]


@pytest.mark.parametrize(
    "subject", ["", "a b", "_INBOX.elsewhere"], ids=["empty", "space", "inbox"]
)
async def test_a_card_with_another_subject_cannot_steer_requests(
    empty_mesh: InProcessMesh, nc: Client, subject: str
) -> None:
    """Whatever subject a card names (none, two tokens that a NATS publish line would read
    as subject and reply, anyone's), a router forwards to the worker's derived subject; a
    frontend that routes itself meets no responders there and moves the request to a
    real worker at once."""
    subjects = Subjects(empty_mesh.namespace)
    routed: Router = empty_mesh.add_router().value
    empty_mesh.add_worker("wreal")
    empty_mesh.add_frontend()
    await announce(nc, subjects.announce, forged_card("wodd", subject))
    await asyncio.to_thread(
        wait_until,
        lambda: {"wreal", "wodd"} <= routed.directory.workers.keys(),
        5.0,
        0.02,
        "both workers",
    )
    await asyncio.to_thread(
        empty_mesh.wait_for_workers, lambda ids: {"wreal", "wodd"} <= ids, 5.0, "both workers"
    )
    # The frontend's six requests, with nothing behind wodd: half of them meet no
    # responders there and migrate to wreal.
    replies = await asyncio.gather(
        *(post(empty_mesh.http_url + "/generate", BODY) for _ in range(6))
    )
    assert [r.status for r in replies] == [200] * 6
    # A router's request pinned to wodd reaches whoever answers for wodd.
    behind_the_id = await stand_in(nc, subjects.worker_generate("wodd"))
    pinned = request([1, 2, 3], max_tokens=2, worker="wodd")
    assert await ask_router(nc, subjects, pinned) == b"here"
    assert [m.subject for m in behind_the_id] == [subjects.worker_generate("wodd")]


async def test_a_card_past_the_size_bound_is_not_even_decoded(
    empty_mesh: InProcessMesh, nc: Client
) -> None:
    """A card padded past 64 KiB (NATS would carry 1 MB, 8 MB with deploy/nats/) is
    ignored; the next card, just under, is believed."""
    subjects = Subjects(empty_mesh.namespace)
    routed: Router = empty_mesh.add_router().value
    big = {**forged_card("wbig", ""), "pad": "x" * MAX_MESSAGE_BYTES}
    fits = {**forged_card("wfits", ""), "pad": "x" * (MAX_MESSAGE_BYTES - 300)}
    assert len(MSGPACK.encode(fits)) <= MAX_MESSAGE_BYTES
    await announce(nc, subjects.announce, big, fits)
    await asyncio.to_thread(
        wait_until, lambda: "wfits" in routed.directory.workers, 5.0, 0.02, "the card that fits"
    )
    assert "wbig" not in routed.directory.workers


GARBAGE_PRESENCE: list[dict[str, Any]] = [
    {"id": ""},
    {"id": "a b"},
    {"id": "r.dot"},
    {"id": "x" * 65},
    {"id": "rnan", "heartbeat_s": math.nan},
    {"id": "rinf", "heartbeat_s": math.inf},
    {"id": "rhuge", "heartbeat_s": 1e300},
    {"id": "rzero", "heartbeat_s": 0},
    {"id": "rbool", "heartbeat_s": True},
    {"id": "rstr", "heartbeat_s": "1"},
    {"id": "rleaving", "leaving": "yes", "heartbeat_s": -5},
]


async def test_garbage_router_presence_does_not_make_a_frontend_ready(
    empty_mesh: InProcessMesh, nc: Client
) -> None:
    """A frontend that routes through routers stays unready while only garbage presence
    arrives; a real presence (the test's control) makes it ready, its leave unready."""
    subjects = Subjects(empty_mesh.namespace)
    empty_mesh.add_worker("wreal")
    empty_mesh.add_frontend("--routing", "routers")
    no_router = f"genmesh is not ready: no router is running in namespace {subjects.namespace!r}"
    assert await health(empty_mesh) == (503, no_router)

    await announce(nc, subjects.router_presence, *GARBAGE_PRESENCE)
    # The frontend reads discovery in order: once this card is in, so is the garbage.
    await announce(nc, subjects.announce, forged_card("wmark", "anything"))
    await asyncio.to_thread(
        empty_mesh.wait_for_workers, lambda ids: "wmark" in ids, 5.0, "the marker card"
    )
    assert await health(empty_mesh) == (503, no_router)

    await announce(nc, subjects.router_presence, {"id": "rgood", "heartbeat_s": 30.0})
    await asyncio.to_thread(wait_until, lambda: empty_mesh._http_ok("/health"), 5.0, 0.02, "ok")
    await announce(nc, subjects.router_presence, {"id": "rgood", "leaving": True})
    await asyncio.to_thread(
        wait_until, lambda: not empty_mesh._http_ok("/health"), 5.0, 0.02, "unready again"
    )
    assert await health(empty_mesh) == (503, no_router)

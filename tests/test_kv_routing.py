"""KV-aware routing over real NATS: events on `genmesh.<ns>.kv.<wid>` fill the index, a
gap resyncs from the worker's snapshot pages, a worker leaving discovery is forgotten; and
the `kv` policy in a frontend sending a shared prefix where it is cached.

The policy and the index are unit-tested in tests/unit/test_kv_policy.py and
tests/unit/test_kv_index.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from prometheus_client import generate_latest

from genmesh.client import MeshClient, request
from genmesh.codecs import get_codec
from genmesh.routing.kv_feed import KvSubscriber
from genmesh.routing.kv_policy import KvPolicy
from genmesh.routing.policies import KvConfig
from genmesh.services.router.metrics import router_registry
from genmesh.shared.bus import publish
from genmesh.shared.discovery import WorkerDirectory
from genmesh.shared.envelope import TokenIds
from genmesh.shared.kv_events import (
    BlockStored,
    KvEvent,
    KvEventsMessage,
    KvSnapshotPage,
    block_keys,
)
from genmesh.shared.subjects import Subjects
from tests.http_util import post
from tests.inproc import InProcessMesh
from tests.mesh import wait_until

pytestmark = pytest.mark.inproc

MSGPACK = get_codec(None)
BS = 16
PREFIX = list(range(1000, 1064))  # four blocks


def block(i: int, tokens: list[int] = PREFIX) -> BlockStored:
    """Block i of `tokens` as an engine stores it: hash 10 + i, its parent 10 + i - 1."""
    return BlockStored(
        [10 + i], None if i == 0 else 9 + i, TokenIds(tokens[i * BS : (i + 1) * BS]), BS
    )


async def eventually(predicate: Any, what: str, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


async def announce(nc: Client, subjects: Subjects, wid: str) -> None:
    card = {
        "id": wid,
        "subject": f"{subjects.prefix}.worker.{wid}.generate",
        "inflight": 0,
        "capacity": 4,
        "heartbeat_s": 30.0,
        "kv_events": True,
    }
    await publish(nc, subjects.announce, MSGPACK, card)


async def send(nc: Client, subjects: Subjects, wid: str, seq: int, *events: KvEvent) -> None:
    message = KvEventsMessage(wid, seq, float(seq), list(events))
    await publish(nc, subjects.kv_events(wid), MSGPACK, message.to_wire())


async def test_events_fill_the_index_a_gap_resyncs_from_pages_and_leavers_are_forgotten(
    nc: Client, namespace: str
) -> None:
    subjects = Subjects(namespace)
    policy = KvPolicy(KvConfig())
    directory = WorkerDirectory(nc, subjects)
    subscriber = KvSubscriber(nc, subjects, directory, policy)
    await directory.start()
    await subscriber.start()
    keys = block_keys(TokenIds(PREFIX), BS)
    # The fake worker's snapshot, as of its message 3: blocks 0-2 over two pages.
    asked: list[Any] = []

    async def snapshot(msg: Msg) -> None:
        request = MSGPACK.decode(msg.data)
        asked.append(request)
        page = request["page"]
        events = [block(0), block(1)] if page == 0 else [block(2)]
        answer = KvSnapshotPage("w1", "snap-1", 3, page, 2, events)
        await msg.respond(MSGPACK.encode(answer.to_wire()))

    await nc.subscribe(subjects.worker_kv_snapshot("w1"), cb=snapshot)
    try:
        await send(nc, subjects, "w1", 1, block(0))  # before discovery knows w1: ignored
        await announce(nc, subjects, "w1")
        await eventually(lambda: "w1" in directory.workers, "w1 discovered")
        await send(nc, subjects, "w1", 2, block(1))  # first contact at 2: resync
        await eventually(lambda: subscriber.sequencer.last_applied("w1") == 3, "a resync")
        assert asked == [{"snapshot": None, "page": 0}, {"snapshot": "snap-1", "page": 1}]
        assert policy.index.overlaps(keys) == {"w1": 3}
        await send(nc, subjects, "w1", 4, block(3))  # the next one: applied on top
        await eventually(lambda: policy.index.overlaps(keys) == {"w1": 4}, "w1's 4 blocks")
        assert subscriber.sequencer.resyncs == 1
        await publish(nc, subjects.leave, MSGPACK, {"id": "w1"})
        await eventually(lambda: policy.index.keys_held == 0, "w1 forgotten")
        assert subscriber.sequencer.last_applied("w1") == 0
    finally:
        await subscriber.close()
        await directory.close()


async def test_a_worker_without_snapshots_is_followed_from_its_live_events(
    nc: Client, namespace: str
) -> None:
    subjects = Subjects(namespace)
    policy = KvPolicy(KvConfig())
    directory = WorkerDirectory(nc, subjects)
    subscriber = KvSubscriber(nc, subjects, directory, policy)
    await directory.start()
    await subscriber.start()
    try:
        await announce(nc, subjects, "w2")
        await eventually(lambda: "w2" in directory.workers, "w2 discovered")
        await send(nc, subjects, "w2", 5, block(0), block(1))  # nobody answers a snapshot
        await eventually(lambda: subscriber.sequencer.resync_failures == 1, "a failed resync")
        assert policy.index.overlaps(block_keys(TokenIds(PREFIX), BS)) == {"w2": 2}
        assert subscriber.sequencer.last_applied("w2") == 5
    finally:
        await subscriber.close()
        await directory.close()


# -- the policy in a frontend ---------------------------------------------------------------


def admitted(mesh: InProcessMesh) -> dict[str, int]:
    return {w["id"]: w["stats"]["admitted"] for w in mesh.server_info()["genmesh"]["workers"]}


def body(tokens: list[int], max_new_tokens: int = 2, **more: Any) -> dict[str, Any]:
    return {"input_ids": tokens, "sampling_params": {"max_new_tokens": max_new_tokens}, **more}


async def test_without_events_a_shared_prefix_follows_where_it_was_routed(
    empty_mesh: InProcessMesh,
) -> None:
    for wid in ("wa", "wb"):
        empty_mesh.add_worker(wid, speedup=1.0)
    empty_mesh.add_frontend("--router-policy", "kv")
    url = empty_mesh.http_url + "/generate"
    await asyncio.to_thread(
        wait_until, lambda: empty_mesh.worker_ids() == {"wa", "wb"}, 10.0, 0.05, "two workers"
    )
    # A long request keeps wa busy (every cost ties when idle: wa, the lower id, wins).
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=json.dumps(body(list(range(64)), 5000, stream=True))) as busy,
    ):
        assert busy.status == 200
        await busy.content.readline()  # it runs
        shared = [*PREFIX, 7, 8, 9]
        first = await post(url, body(shared))  # wa is busy: wb, now taken to hold PREFIX
        assert first.status == 200, first.body
    # wa is idle again and would win a tie, but wb is predicted to hold the prefix.
    again = await post(url, body([*PREFIX, 4, 5, 6]))
    assert again.status == 200, again.body
    await asyncio.to_thread(
        wait_until, lambda: sum(admitted(empty_mesh).values()) == 3, 5.0, 0.02, "3 admitted"
    )
    assert admitted(empty_mesh) == {"wa": 1, "wb": 2}


async def test_a_shared_prefix_lands_on_the_worker_whose_events_say_it_holds_it(
    empty_mesh: InProcessMesh,
) -> None:
    # Real mock workers with a paged cache publish their KV events; wc is the last by id,
    # so only the index can send a request there when every worker is idle.
    for wid in ("wa", "wb", "wc"):
        empty_mesh.add_worker(wid, extra_args=("--mock-kv-blocks", "64"))
    frontend = empty_mesh.add_frontend("--router-policy", "kv")
    await asyncio.to_thread(
        wait_until, lambda: empty_mesh.worker_ids() == {"wa", "wb", "wc"}, 10.0, 0.05, "workers"
    )
    policy = frontend.value.state.backend.client.router.policy
    assert isinstance(policy, KvPolicy)
    subjects = Subjects(empty_mesh.namespace)
    async with await MeshClient.connect(empty_mesh.nats_url, empty_mesh.namespace) as client:
        pinned = request([*PREFIX, 1, 2, 3], max_tokens=2)
        frames = [f async for f in client.generate(pinned, subject=subjects.worker_generate("wc"))]
        assert frames[-1]["t"] == "end"
    keys = block_keys(TokenIds(PREFIX), BS)
    await eventually(lambda: policy.index.overlaps(keys).get("wc") == 4, "wc's blocks indexed")
    assert policy.index.overlaps(keys) == {"wc": 4}
    reply = await post(empty_mesh.http_url + "/generate", body([*PREFIX, 4, 5, 6]))
    assert reply.status == 200, reply.body
    assert reply.body["meta_info"]["cached_tokens"] == 64
    await asyncio.to_thread(
        wait_until, lambda: sum(admitted(empty_mesh).values()) == 2, 5.0, 0.02, "2 admitted"
    )
    assert admitted(empty_mesh) == {"wa": 0, "wb": 0, "wc": 2}


async def test_a_router_with_kv_follows_the_events_too(empty_mesh: InProcessMesh) -> None:
    for wid in ("wa", "wb"):
        empty_mesh.add_worker(wid, extra_args=("--mock-kv-blocks", "64"))
    router = empty_mesh.add_router("kv")
    subjects = Subjects(empty_mesh.namespace)
    keys = block_keys(TokenIds(PREFIX), BS)
    async with await MeshClient.connect(empty_mesh.nats_url, empty_mesh.namespace) as client:
        await eventually(lambda: set(router.value.directory.workers) == {"wa", "wb"}, "workers")
        pinned = request([*PREFIX, 1], max_tokens=2)
        frames = [f async for f in client.generate(pinned, subject=subjects.worker_generate("wb"))]
        assert frames[-1]["t"] == "end"
        await eventually(lambda: router.value.policy.index.overlaps(keys) == {"wb": 4}, "indexed")
        routed = request([*PREFIX, 2], max_tokens=2)  # through the router
        frames = [f async for f in client.generate(routed)]
    assert frames[-1]["t"] == "end"
    assert router.value.decisions == {"wb": 1}
    # Its metrics say what its index holds: the prefix's 4 blocks, no resync.
    scraped = generate_latest(router_registry(router.value)).decode()
    assert "genmesh_kv_index_blocks 4.0" in scraped
    assert "genmesh_kv_resyncs_total 0.0" in scraped
    assert "genmesh_kv_messages_total 0.0" not in scraped

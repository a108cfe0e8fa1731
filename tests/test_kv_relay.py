"""A mock worker's KV events through the mesh: relayed onto NATS numbered from 1, a
snapshot whose pages rebuild the cache the events describe, the card's `kv_events`, and
`cached_tokens` in both formats' HTTP responses (docs/protocol.md §13)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import nats
import pytest
from nats.aio.client import Client

from genmesh.client import request
from genmesh.codecs import get_codec
from genmesh.services.worker import kv_relay
from genmesh.services.worker.kv_relay import KvRelay
from genmesh.shared.bus import CODEC_HEADER, flush_in_order, publish
from genmesh.shared.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    KvEvent,
    KvEventBatch,
    KvEventsMessage,
    KvSnapshotPage,
    request_block_keys,
    stored_keys,
)
from genmesh.shared.subjects import Subjects
from tests.conftest import unique_namespace
from tests.inproc import InProcessMesh

pytestmark = pytest.mark.inproc

WID = "wkv"
BLOCK = 4
MSGPACK = get_codec(None)
# (parent, tokens) of each cached block, by engine hash: what the tests rebuild.
Blocks = dict[EngineHash, tuple[EngineHash | None, list[int]]]


@pytest.fixture
def kv_mesh(nats_url: str) -> Iterator[InProcessMesh]:
    """One instant mock worker with a small cache (32 blocks of 4), and a frontend."""
    mesh = InProcessMesh(nats_url, unique_namespace("kv"))
    try:
        mesh.add_worker(
            WID, wait=False, extra_args=("--mock-kv-blocks", "32", "--mock-block-size", "4")
        )
        mesh.add_frontend()
        mesh.wait_for_workers(lambda known: WID in known, what="the kv worker")
        yield mesh
    finally:
        mesh.stop()


class Listener:
    """Every KV events message of the worker, from before its first request."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.messages: list[KvEventsMessage] = []

    async def on_message(self, msg: Any) -> None:
        self.messages.append(KvEventsMessage.from_wire(MSGPACK.decode(msg.data)))

    async def settled(self) -> list[KvEventsMessage]:
        """The messages, once none has come for a while."""
        count = -1
        while count != len(self.messages):
            count = len(self.messages)
            await asyncio.sleep(0.2)
        return self.messages


async def listen(mesh: InProcessMesh) -> tuple[Client, Listener]:
    nc = await nats.connect(mesh.nats_url)
    listener = Listener(nc)
    await nc.subscribe(Subjects(mesh.namespace).kv_events(WID), cb=listener.on_message)
    await flush_in_order(nc)
    return nc, listener


async def sglang(mesh: InProcessMesh, prompt: list[int], tokens: int = 1) -> dict[str, Any]:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": tokens}}
    async with aiohttp.ClientSession() as s, s.post(mesh.http_url + "/generate", json=body) as r:
        assert r.status == 200, await r.text()
        answer: dict[str, Any] = await r.json()
        return answer


async def vllm(mesh: InProcessMesh, prompt: list[int]) -> dict[str, Any]:
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 2}}
    url = mesh.http_url + "/inference/v1/generate"
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        answer: dict[str, Any] = await r.json()
        return answer


def apply(blocks: Blocks, events: list[KvEvent]) -> None:
    """The cache the events describe, rebuilt independently of the worker's mirror."""
    for event in events:
        if isinstance(event, BlockStored):
            parent = event.parent_hash
            size = event.block_size
            for i, h in enumerate(event.block_hashes):
                blocks[h] = (parent, list(event.token_ids[i * size : (i + 1) * size]))
                parent = h
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                del blocks[h]  # a removal of a block never stored would fail here
        elif isinstance(event, AllBlocksCleared):
            blocks.clear()


def prompts(first: int, count: int, length: int = 12) -> list[list[int]]:
    return [list(range(first + 100 * i, first + 100 * i + length)) for i in range(count)]


# ------------------------------------------------------------------ the event stream


async def test_events_arrive_numbered_from_1_and_key_as_the_prompts_do(
    kv_mesh: InProcessMesh,
) -> None:
    nc, listener = await listen(kv_mesh)
    try:
        sent = prompts(1000, 3)
        for prompt in sent:
            assert (await sglang(kv_mesh, prompt))["meta_info"]["cached_tokens"] == 0
        messages = await listener.settled()
    finally:
        await nc.close()
    assert [m.seq for m in messages] == list(range(1, len(messages) + 1))
    assert {m.worker for m in messages} == {WID}
    # The router keys every stored block from the events, chaining parent keys, and
    # finds each prompt's full blocks (all but the last token's: 2 of 3) among them.
    keys: dict[EngineHash, int] = {}
    for message in messages:
        for event in message.events:
            if isinstance(event, BlockStored):
                parent = keys[event.parent_hash] if event.parent_hash is not None else None
                new = stored_keys(event) if parent is None else stored_keys(event, parent)
                keys |= dict(zip(event.block_hashes, new, strict=True))
    for prompt in sent:
        assert set(request_block_keys(request(prompt), BLOCK)) <= set(keys.values())


async def test_the_card_says_the_worker_publishes_kv_events(kv_mesh: InProcessMesh) -> None:
    subjects = Subjects(kv_mesh.namespace)
    nc = await nats.connect(kv_mesh.nats_url)
    cards: list[dict[str, Any]] = []

    async def on_card(msg: Any) -> None:
        cards.append(MSGPACK.decode(msg.data))

    try:
        await nc.subscribe(subjects.announce, cb=on_card)
        await flush_in_order(nc)
        await publish(nc, subjects.query, MSGPACK, {})
        await until(lambda: any(c["id"] == WID for c in cards))
    finally:
        await nc.close()
    card = next(c for c in cards if c["id"] == WID)
    assert card["kv_events"] is True
    assert card["engine_info"]["max_total_num_tokens"] == 32 * BLOCK


# ------------------------------------------------------------------ cached_tokens over HTTP


async def test_cached_tokens_reach_both_formats_responses(kv_mesh: InProcessMesh) -> None:
    first, second = prompts(5000, 2, length=21)
    assert (await sglang(kv_mesh, first))["meta_info"]["cached_tokens"] == 0
    # 21 tokens: 5 whole blocks of 4, all cached after the first request's prefill.
    assert (await sglang(kv_mesh, first))["meta_info"]["cached_tokens"] == 20
    assert (await vllm(kv_mesh, second))["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    usage = (await vllm(kv_mesh, second))["usage"]
    assert (usage["prompt_tokens"], usage["prompt_tokens_details"]) == (21, {"cached_tokens": 20})


# ------------------------------------------------------------------ snapshots


async def snapshot_page(nc: Client, mesh: InProcessMesh, body: Any) -> dict[str, Any]:
    subject = Subjects(mesh.namespace).worker_kv_snapshot(WID)
    reply = await nc.request(subject, MSGPACK.encode(body), timeout=5)
    answer: dict[str, Any] = MSGPACK.decode(reply.data)
    return answer


async def test_a_snapshots_pages_rebuild_the_cache_the_events_describe(
    kv_mesh: InProcessMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kv_relay, "PAGE_BYTES", 400)  # a few blocks a page
    nc, listener = await listen(kv_mesh)
    try:
        # 12 prompts of 4 blocks through a 32-block cache: evictions on the way.
        for prompt in prompts(20_000, 12, length=17):
            await sglang(kv_mesh, prompt, tokens=3)
        await listener.settled()
        first = KvSnapshotPage.from_wire(await snapshot_page(nc, kv_mesh, {"snapshot": None}))
        assert first.page == 0
        assert first.pages > 2
        # The cache changes; the snapshot's later pages do not.
        await sglang(kv_mesh, list(range(90_000, 90_017)))
        pages = [first]
        for k in range(1, first.pages):
            body = {"snapshot": first.snapshot, "page": k}
            pages.append(KvSnapshotPage.from_wire(await snapshot_page(nc, kv_mesh, body)))
        messages = await listener.settled()
    finally:
        await nc.close()
    assert {(p.worker, p.snapshot, p.seq, p.pages) for p in pages} == {
        (WID, first.snapshot, first.seq, first.pages)
    }
    assert [p.page for p in pages] == list(range(first.pages))
    assert any(isinstance(e, BlockRemoved) for m in messages for e in m.events)
    expected: Blocks = {}
    for message in messages:
        if message.seq <= first.seq:
            apply(expected, message.events)
    rebuilt: Blocks = {}
    for page in pages:
        for event in page.events:
            # Parents first: a block's parent is rebuilt before it, or not cached at all.
            assert (
                event.parent_hash is None
                or event.parent_hash in rebuilt
                or (event.parent_hash not in expected)
            )
            apply(rebuilt, [event])
    assert rebuilt == expected
    assert len(expected) > 8
    # Newer messages than the snapshot's hold the request made after it.
    assert max(m.seq for m in messages) > first.seq


async def test_snapshot_requests_it_cannot_answer_say_why(kv_mesh: InProcessMesh) -> None:
    nc = await nats.connect(kv_mesh.nats_url)
    try:
        await sglang(kv_mesh, list(range(300, 309)))
        unknown = await snapshot_page(nc, kv_mesh, {"snapshot": "nope", "page": 0})
        fresh = await snapshot_page(nc, kv_mesh, {"snapshot": None, "page": 0})
        beyond = await snapshot_page(nc, kv_mesh, {"snapshot": fresh["snapshot"], "page": 9})
        malformed = await snapshot_page(nc, kv_mesh, {"snapshot": 3, "page": 0})
        subject = Subjects(kv_mesh.namespace).worker_kv_snapshot(WID)
        json = get_codec("json")
        reply = await nc.request(
            subject, json.encode({"snapshot": None}), headers={CODEC_HEADER: "json"}, timeout=5
        )
        in_json = json.decode(reply.data)
    finally:
        await nc.close()
    assert unknown == {
        "worker": WID,
        "error": "no snapshot nope (expired, or never made here): ask for a new one",
    }
    assert (fresh["page"], fresh["pages"]) == (0, 1)
    assert beyond == {
        "worker": WID,
        "error": f"snapshot {fresh['snapshot']} has 1 pages; there is no page 9",
    }
    assert in_json == {
        "worker": WID,
        "error": "json cannot encode: Object of type bytes is not JSON serializable",
    }
    assert malformed == {
        "worker": WID,
        "error": 'a snapshot request is {"snapshot": null or a snapshot id, '
        '"page": an integer >= 0}',
    }


# ------------------------------------------------------------------ NATS away


async def test_a_batch_nats_cannot_take_is_numbered_and_mirrored_all_the_same(
    nats_url: str,
) -> None:
    """Publishing fails (here: a closed connection); the relay goes on counting, so
    routers see the gap, and its snapshot holds what the lost messages said."""
    nc = await nats.connect(nats_url)
    await nc.close()
    batches = [
        KvEventBatch(1.0, [BlockStored([b"a", b"b"], None, request([1, 2, 3, 4]).token_ids, 2)]),
        KvEventBatch(2.0, [BlockRemoved([b"b"])]),
    ]

    async def events() -> Any:
        for batch in batches:
            yield batch

    relay = KvRelay(nc, Subjects(unique_namespace()), WID, events())
    await relay.run()
    assert relay.seq == 2
    page = await relay.page({"snapshot": None, "page": 0})
    assert (page.seq, page.pages) == (2, 1)
    assert [(e.block_hashes, list(e.token_ids)) for e in page.events] == [([b"a"], [1, 2])]


async def until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)

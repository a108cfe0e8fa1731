"""A worker's slots and memory against hostile NATS input, on real nats-servers (issue 15,
items 1 and 2): a request whose `ack` cannot be sent gives its slot back, and IDs too
long to echo or to keep are refused or ignored (docs/limits.md)."""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client

from genmesh.client import MeshClient, request
from genmesh.codecs import get_codec
from genmesh.services.worker.service import Worker
from genmesh.shared import frames
from genmesh.shared.bus import flush_in_order
from genmesh.shared.ids import MAX_ID_BYTES
from genmesh.shared.natsserver import NatsServer
from genmesh.shared.subjects import Subjects
from tests.conftest import unique_namespace
from tests.inproc import InProcessMesh, InProcessService
from tests.mesh import wait_until

pytestmark = pytest.mark.inproc


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[Client]:
    conn = await nats.connect(nats_url, allow_reconnect=False)
    yield conn
    await conn.close()


async def replies(
    nc: Client, subject: str, data: bytes, codec: str, *, quiet_s: float = 1.0
) -> list[dict[str, Any]]:
    """The frames sent back for one request message, up to the terminator, or what came
    before `quiet_s` seconds passed without a message."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        headers = None if codec == "msgpack" else {"genmesh-codec": codec}
        await nc.publish(subject, data, reply=inbox, headers=headers)
        got: list[dict[str, Any]] = []
        while True:
            try:
                msg = await sub.next_msg(timeout=quiet_s)
            except nats.errors.TimeoutError:
                return got
            if not msg.data:
                return got
            got.append(get_codec(codec).decode(msg.data))
    finally:
        await sub.unsubscribe()


def ack_size(worker: str, request_id: str, codec: str) -> int:
    ack = frames.ack(request_id, worker, "0" * 32)
    ack["seq"] = 0
    return len(get_codec(codec).encode(ack))


def worker_of(service: InProcessService) -> Worker:
    worker = service.value
    assert isinstance(worker, Worker)
    return worker


# ---------------------------------------------------------------- item 1


@pytest.mark.parametrize("codec", ["msgpack", "json"])
async def test_an_id_whose_ack_cannot_be_sent_takes_no_slot(
    mesh: InProcessMesh, nc: Client, client: MeshClient, codec: str
) -> None:
    """An envelope that fits the default max_payload, whose `ack` (the ID plus the
    worker's fields, and with JSON the codec header) would not: refused at once, and the
    worker keeps its NATS connection and serves on. Before: the worker ran the request
    and sent its frames without an ack, or (JSON) the server cut the worker off the mesh
    for good."""
    service = mesh.workers[0]
    worker = worker_of(service)
    overhead = ack_size(service.name, "", codec)
    request_id = "x" * (nc.max_payload - overhead + 1)  # the ack's payload is 1 byte over
    envelope = get_codec(codec).encode({"v": 1, "id": request_id, "token_ids": [1]})
    assert len(envelope) < nc.max_payload
    subject = Subjects(mesh.namespace).worker_generate(service.name)

    got = await replies(nc, subject, envelope, codec)

    assert [(f["t"], f["id"], f["code"]) for f in got] == [("err", None, "bad_envelope")]
    assert got[0]["message"] == f"id: at most 256 bytes, got {len(request_id)} characters"
    assert worker.inflight == 0
    assert worker.nc.is_connected
    answer = [f async for f in client.generate(request([1, 2], max_tokens=2))]
    assert answer[-1]["t"] == "end"
    assert service.alive


@pytest.fixture
def small_payload_mesh(tmp_path: Path) -> Iterator[InProcessMesh]:
    """A mesh on a nats-server of its own whose max_payload (300 bytes) an `ack` of a
    legal ID (up to 256 bytes) exceeds, while its envelope fits."""
    config = tmp_path / "small.conf"
    config.write_text("max_payload: 300\n")
    server = NatsServer(config_file=str(config))
    url = server.start()
    mesh = InProcessMesh(url, unique_namespace("small"))
    try:
        yield mesh
    finally:
        mesh.stop()
        server.stop()


async def test_a_request_whose_ack_fails_gives_its_slot_back(
    small_payload_mesh: InProcessMesh,
) -> None:
    """The `ack` send fails (here: too big for the server) after the request was admitted
    and its task created, before that task ever ran: it must leave the worker's requests,
    its engine's, and the load, and nothing of it may reach the requester."""
    mesh = small_payload_mesh
    service = mesh.add_worker(max_concurrency=1, wait=False, speedup=1.0)
    worker = worker_of(service)
    subject = Subjects(mesh.namespace).worker_generate(service.name)
    request_id = "x" * 250
    async with await nats.connect(mesh.nats_url, allow_reconnect=False) as nc:
        assert ack_size(service.name, request_id, "msgpack") > nc.max_payload
        envelope = get_codec(None).encode({"v": 1, "id": request_id, "token_ids": [1]})
        assert len(envelope) <= nc.max_payload

        for _ in range(3):  # with one slot, a leaked one would refuse the next
            assert await replies(nc, subject, envelope, "msgpack", quiet_s=0.5) == []

        wait_until(lambda: worker.inflight == 0, what="the worker to forget the request")
        assert len(worker.engine._running) == 0  # type: ignore[attr-defined]
        assert worker.stats["failed"] == 3
        assert worker.nc.is_connected
        small = get_codec(None).encode(
            {"v": 1, "id": "ok", "token_ids": [1], "sampling": {"max_tokens": 2}}
        )
        served = await replies(nc, subject, small, "msgpack")
        assert [f["t"] for f in served] == ["ack", "out", "end"]
    assert "could not send its ack" in service.log()


# ---------------------------------------------------------------- item 2


async def wait_for_tombstone(worker: Worker, request_id: str) -> None:
    for _ in range(500):
        if request_id in worker.tombstones:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the worker never tombstoned {request_id}")


async def test_cancels_with_huge_ids_do_not_grow_the_worker(
    empty_mesh: InProcessMesh, nc: Client
) -> None:
    """300 cancels with ~1 MB IDs: each is ignored, not tombstoned; the worker (in this
    process, so tracemalloc sees it) holds no more memory after them than before.
    Before: the store kept every ID, ~300 MB."""
    service = empty_mesh.add_worker(wait=False)
    worker = worker_of(service)
    cancel = Subjects(empty_mesh.namespace).cancel
    # ~1 MB each, as in the issue (the tests' server takes up to 8 MiB).
    huge = get_codec(None).encode({"id": "x" * min(nc.max_payload - 64, 1 << 20), "reason": "r"})
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for batch in range(10):
            for _ in range(30):
                await nc.publish(cancel, huge)
            # Cancels are handled in order: once this one is in, the batch has been seen.
            marker = f"marker-{batch}"
            await nc.publish(cancel, get_codec(None).encode({"id": marker}))
            await flush_in_order(nc)
            await wait_for_tombstone(worker, marker)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(worker.tombstones) == 10
    assert worker.tombstones.bytes == sum(len(f"marker-{i}") for i in range(10))
    assert grown < 5_000_000, f"the worker grew by {grown} bytes"
    assert service.log().count("ignored cancel: id: at most 256 bytes") == 300


async def test_cancels_with_the_longest_ids_are_kept_and_counted(
    empty_mesh: InProcessMesh, nc: Client
) -> None:
    service = empty_mesh.add_worker(wait=False)
    worker = worker_of(service)
    subjects = Subjects(empty_mesh.namespace)
    ids = [f"{i:0{MAX_ID_BYTES}d}" for i in range(300)]
    for rid in ids:
        await nc.publish(subjects.cancel, get_codec(None).encode({"id": rid}))
    await flush_in_order(nc)
    await wait_for_tombstone(worker, ids[-1])
    assert (len(worker.tombstones), worker.tombstones.bytes) == (300, 300 * MAX_ID_BYTES)
    # A tombstoned ID of the longest kind still refuses its request.
    got = await replies(
        nc,
        subjects.worker_generate(service.name),
        get_codec(None).encode({"v": 1, "id": ids[0], "token_ids": [1]}),
        "msgpack",
    )
    assert [(f["t"], f["code"], f["message"]) for f in got] == [
        ("err", "cancelled", "request was cancelled")
    ]


async def test_a_ping_with_an_id_longer_than_any_request_is_not_running(
    empty_mesh: InProcessMesh, nc: Client
) -> None:
    service = empty_mesh.add_worker(wait=False)
    ping = Subjects(empty_mesh.namespace).worker_ping(service.name)
    answer = await nc.request(ping, b"x" * (MAX_ID_BYTES + 1), timeout=5)
    assert answer.data == b"not running"
    assert (await nc.request(ping, b"", timeout=5)).data == b""


async def test_a_long_cancel_reason_is_cut_in_the_err_frame(
    empty_mesh: InProcessMesh, nc: Client
) -> None:
    service = empty_mesh.add_worker(wait=False, speedup=1.0)
    subjects = Subjects(empty_mesh.namespace)
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    envelope = {"v": 1, "id": "long-reason", "token_ids": [1], "sampling": {"max_tokens": 500}}
    await nc.publish(
        subjects.worker_generate(service.name), get_codec(None).encode(envelope), reply=inbox
    )
    ack = get_codec(None).decode((await sub.next_msg(timeout=5)).data)
    assert ack["t"] == "ack"  # it runs, at the mock's real-time pace
    await nc.publish(
        subjects.cancel, get_codec(None).encode({"id": "long-reason", "reason": "r" * 10_000})
    )
    while True:
        frame = get_codec(None).decode((await sub.next_msg(timeout=5)).data)
        if frame["t"] == "err":
            break
    assert frame["message"] == f"request was cancelled ({'r' * 256})"

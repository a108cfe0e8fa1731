"""The mesh as a whole: discovery, several routers and workers, failures, cancellation."""

from __future__ import annotations

import asyncio
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from genmesh.client import MeshClient, request
from genmesh.codecs import get_codec
from genmesh.services.frontend.serve import start_frontend
from genmesh.shared.bus import flush_in_order
from genmesh.shared.subjects import Subjects
from tests.conftest import unique_namespace
from tests.http_util import post
from tests.inproc import AnyMesh, InProcessMesh
from tests.mesh import Mesh, frontend_options, wait_until

pytestmark = pytest.mark.inproc

BODY = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}


@pytest.fixture
def proc_mesh(nats_url: str, tmp_path: Path) -> Iterator[Mesh]:
    """The same, each service an OS process: for the tests that kill or signal them."""
    mesh = Mesh(nats_url, tmp_path, unique_namespace("own"))
    yield mesh
    mesh.stop()


def card(mesh: AnyMesh, worker_id: str) -> dict[str, Any]:
    for worker in mesh.server_info()["genmesh"]["workers"]:
        if worker["id"] == worker_id:
            return dict(worker)
    raise KeyError(worker_id)


async def test_no_worker_is_503_at_once(empty_mesh: InProcessMesh, nats_url: str) -> None:
    empty_mesh.add_router()
    empty_mesh.add_frontend()
    async with aiohttp.ClientSession() as s, s.get(empty_mesh.http_url + "/health") as r:
        assert r.status == 503
        assert "no worker" in await r.text()
    reply = await post(empty_mesh.http_url + "/generate", BODY)
    assert reply.status == 503
    assert reply.headers["Retry-After"] == "1"
    assert "no worker" in reply.body["message"]  # SGLang's shape for 5xx
    assert reply.body["code"] == 503

    # At NATS level the router answers with an err frame at once, not after a timeout.
    async with await MeshClient.connect(nats_url, empty_mesh.namespace) as client:
        started = time.monotonic()
        frames = [f async for f in client.generate(request([1, 2]))]
        elapsed = time.monotonic() - started
    assert [f["t"] for f in frames] == ["err"]
    assert frames[0]["code"] == "no_worker"
    assert "origin" not in frames[0]  # sent by the router, not made up by the client
    assert elapsed < client.ack_timeout_s / 2


@pytest.mark.process
async def test_health_needs_a_router_too(proc_mesh: Mesh) -> None:
    """With --routing routers (a frontend that routes itself needs none)."""
    proc_mesh.add_frontend("--routing", "routers")
    proc_mesh.add_worker()
    async with aiohttp.ClientSession() as s, s.get(proc_mesh.http_url + "/health") as r:
        assert r.status == 503
        assert "no router" in await r.text()
    router = proc_mesh.add_router()
    await asyncio.to_thread(
        wait_until, lambda: proc_mesh._http_ok("/health"), 5.0, 0.05, "health with a router"
    )
    router.terminate()  # a clean stop says goodbye: readiness drops at once
    await asyncio.to_thread(
        wait_until, lambda: not proc_mesh._http_ok("/health"), 1.0, 0.02, "health to drop"
    )


async def test_oversized_and_pathological_bodies(empty_mesh: InProcessMesh) -> None:
    empty_mesh.add_router()
    empty_mesh.add_frontend("--body-limit-mb", "0.001")
    empty_mesh.add_worker()
    reply = await post(empty_mesh.http_url + "/generate", {"input_ids": list(range(1000))})
    assert reply.status == 413
    assert "larger than the limit of 1048 bytes" in reply.body["error"]["message"]
    reply = await post(empty_mesh.http_url + "/generate", b"[" * 1000)
    assert reply.status == 400
    assert reply.body["object"] == "error"
    reply = await post(empty_mesh.http_url + "/generate", {"input_ids": [1, 2]})
    assert reply.status == 200


@pytest.mark.chaos
async def test_several_routers_share_the_load_and_survive_each_other(
    proc_mesh: Mesh,
) -> None:
    routers = [proc_mesh.add_router(), proc_mesh.add_router()]
    proc_mesh.add_frontend("--routing", "routers")
    workers = [proc_mesh.add_worker() for _ in range(3)]
    for _ in range(30):
        reply = await post(proc_mesh.http_url + "/generate", BODY)
        assert reply.status == 200
    wait_until(
        lambda: sum(card(proc_mesh, w.name)["stats"]["admitted"] for w in workers) == 30,
        what="all 30 requests to be counted",
    )
    served = {w.name: card(proc_mesh, w.name)["stats"]["admitted"] for w in workers}
    assert all(n > 0 for n in served.values()), served
    routers[0].kill()
    for _ in range(10):
        reply = await post(proc_mesh.http_url + "/generate", BODY)
        assert reply.status == 200, "the surviving router takes the whole queue group"


async def test_new_worker_is_routable_within_a_second(
    empty_mesh: InProcessMesh, nats_url: str
) -> None:
    empty_mesh.add_router()
    empty_mesh.add_frontend()
    empty_mesh.add_worker()
    newcomer = empty_mesh.add_worker(wait=False)  # returns once it serves its subject
    async with await MeshClient.connect(nats_url, empty_mesh.namespace) as client:
        started = time.monotonic()
        while True:
            frames = [f async for f in client.generate(request([1], worker=newcomer.name))]
            if frames[-1]["t"] == "end":
                break
            assert frames[-1]["code"] == "no_worker", frames
            assert time.monotonic() - started < 1.0, "the router did not learn of the worker in 1s"
            await asyncio.sleep(0.02)


@pytest.mark.chaos
async def test_a_killed_worker_is_dropped_and_a_stopped_one_leaves_at_once(
    proc_mesh: Mesh,
) -> None:
    proc_mesh.add_router()
    proc_mesh.add_frontend()
    keep = proc_mesh.add_worker()
    victim = proc_mesh.add_worker()
    leaver = proc_mesh.add_worker()

    leaver.terminate()
    started = time.monotonic()
    proc_mesh.wait_for_workers(lambda ids: leaver.name not in ids, timeout=1.0, what="clean leave")
    assert time.monotonic() - started < 1.0

    victim.kill()
    killed = time.monotonic()
    proc_mesh.wait_for_workers(lambda ids: victim.name not in ids, timeout=5.0, what="expiry")
    # Every directory (the router's too) expires it within 5 s of the kill; from then on
    # nothing is routed to the dead worker.
    await asyncio.sleep(max(0.0, killed + 5.0 - time.monotonic()))
    for _ in range(12):
        reply = await post(proc_mesh.http_url + "/generate", BODY)
        assert reply.status == 200, reply.body
    assert proc_mesh.worker_ids() == {keep.name}


async def test_overloaded_workers_answer_503(empty_mesh: InProcessMesh) -> None:
    empty_mesh.add_router()
    empty_mesh.add_frontend()
    empty_mesh.add_worker(speedup=0.2, max_concurrency=1)
    slow = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
    replies = await asyncio.gather(
        *(post(empty_mesh.http_url + "/generate", slow) for _ in range(4))
    )
    statuses = sorted(r.status for r in replies)
    assert statuses.count(200) >= 1
    assert 503 in statuses, statuses
    rejected = next(r for r in replies if r.status == 503)
    assert rejected.headers["Retry-After"] == "1"
    assert "capacity" in rejected.body["message"] or "limit" in rejected.body["message"]


async def test_a_refused_request_backs_off_and_gets_the_freed_slot(
    empty_mesh: InProcessMesh,
) -> None:
    """Refused as overloaded, a request is sent again after 0.1, 0.2, 0.4 s: the one slot,
    busy for ~0.15 s, is free by then (sent again at once, all attempts met a full mesh)."""
    empty_mesh.add_router()
    frontend = empty_mesh.add_frontend()
    empty_mesh.add_worker(speedup=0.2, max_concurrency=1)
    short = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
    first = asyncio.create_task(post(empty_mesh.http_url + "/generate", short))
    await asyncio.sleep(0.03)  # admitted: the slot is taken
    second = await post(empty_mesh.http_url + "/generate", short)
    assert (await first).status == 200
    assert second.status == 200, second.body
    assert re.search(r"attempt 2 after: .*at capacity", frontend.log()), frontend.log()


async def _wait_cancelled(mesh: AnyMesh, worker_id: str, before: int) -> dict[str, Any]:
    def cancelled() -> bool:
        c = card(mesh, worker_id)
        return bool(c["stats"]["cancelled"] > before and c["inflight"] == 0)

    await asyncio.to_thread(wait_until, cancelled, 5.0, 0.02, "the worker to cancel")
    return card(mesh, worker_id)


async def test_sse_disconnect_cancels_at_the_worker(empty_mesh: InProcessMesh) -> None:
    empty_mesh.add_router()
    empty_mesh.add_frontend()
    worker = empty_mesh.add_worker(speedup=0.05)
    body = {
        "input_ids": [1, 2],
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
        "stream": True,
    }
    async with (
        aiohttp.ClientSession() as s,
        s.post(empty_mesh.http_url + "/generate", json=body) as r,
    ):
        assert r.status == 200
        await r.content.readuntil(b"\n\n")
        await r.content.readuntil(b"\n\n")
        # Leaving the block drops the connection mid-stream.
    after = await _wait_cancelled(empty_mesh, worker.name, 0)
    assert after["stats"]["completed"] == 0


async def test_unary_disconnect_cancels_at_the_worker(empty_mesh: InProcessMesh) -> None:
    empty_mesh.add_router()
    empty_mesh.add_frontend()
    worker = empty_mesh.add_worker(speedup=0.05)
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    timeout = aiohttp.ClientTimeout(total=0.5)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        with pytest.raises(asyncio.TimeoutError):
            async with s.post(empty_mesh.http_url + "/generate", json=body) as r:
                await r.read()
    after = await _wait_cancelled(empty_mesh, worker.name, 0)
    assert after["stats"]["completed"] == 0


async def _raw_exchange(
    nats_url: str,
    namespace: str,
    envelope: dict[str, Any],
    *,
    cancel_first: bool = False,
    cancel_after: int | None = None,
) -> list[dict[str, Any]]:
    """Speak the protocol by hand: own inbox, publish, optionally cancel, collect frames."""
    import nats

    codec = get_codec(None)
    subjects = Subjects(namespace)
    nc = await nats.connect(nats_url, allow_reconnect=False)
    try:
        inbox = nc.new_inbox()
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def on_msg(msg: Any) -> None:
            await queue.put(msg)

        await nc.subscribe(inbox, cb=on_msg)
        cancel = codec.encode({"id": envelope["id"], "reason": "test"})
        if cancel_first:
            await nc.publish(subjects.cancel, cancel)
            await flush_in_order(nc)
        await nc.publish(subjects.router_generate, codec.encode(envelope), reply=inbox)
        frames: list[dict[str, Any]] = []
        while True:
            msg = await asyncio.wait_for(queue.get(), 10)
            frame = codec.decode(msg.data)
            frames.append(frame)
            if frame["t"] in ("end", "err"):
                return frames
            if cancel_after is not None and sum(f["t"] == "out" for f in frames) == cancel_after:
                await nc.publish(subjects.cancel, cancel)
    finally:
        await nc.close()


async def test_nats_cancel_stops_the_engine(empty_mesh: InProcessMesh, nats_url: str) -> None:
    empty_mesh.add_router()
    empty_mesh.add_frontend()
    empty_mesh.add_worker(speedup=0.05)
    envelope = request([1, 2], max_tokens=2000, ignore_eos=True).to_wire()
    frames = await _raw_exchange(nats_url, empty_mesh.namespace, envelope, cancel_after=2)
    assert frames[0]["t"] == "ack"
    assert frames[-1]["t"] == "err"
    assert frames[-1]["code"] == "cancelled"
    assert frames[-1]["retryable"] is False
    outs = [f for f in frames if f["t"] == "out"]
    assert 2 <= len(outs) < 10  # stopped right away, far from the 2000-token budget
    assert [f["seq"] for f in frames] == list(range(len(frames)))


async def test_a_cancel_that_overtakes_its_request_still_wins(
    empty_mesh: InProcessMesh, nats_url: str
) -> None:
    empty_mesh.add_router()
    empty_mesh.add_frontend()
    empty_mesh.add_worker()
    envelope = request([1, 2], max_tokens=50).to_wire()
    frames = await _raw_exchange(nats_url, empty_mesh.namespace, envelope, cancel_first=True)
    assert [f["t"] for f in frames] == ["err"]
    assert frames[0]["code"] == "cancelled"


async def test_frontend_sockets_have_tcp_nodelay(mesh: AnyMesh, nats_url: str) -> None:
    """A stream must never wait on a delayed ACK: read the option off the server's sockets."""
    frontend = await start_frontend(frontend_options(nats_url, mesh.namespace))
    try:
        await asyncio.to_thread(
            wait_until,
            lambda: frontend.state.backend.not_ready_reason() is None,
            5.0,
            0.02,
            "discovery",
        )
        url = f"http://127.0.0.1:{frontend.port}/generate"
        body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 3}, "stream": True}
        async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
            assert r.status == 200
            server = frontend.runner.server
            assert server is not None
            connections = server.connections
            assert connections
            for handler in connections:
                assert handler.transport is not None
                sock = handler.transport.get_extra_info("socket")
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
            await r.read()
    finally:
        await frontend.close()

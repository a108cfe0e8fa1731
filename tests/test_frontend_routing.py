"""Routing in the frontend (`--routing frontend`, the default) over a real mesh: no router
needed, the policy honoured, a killed worker still migrated from, the refusals a router
would send, and `--routing routers` still going through a router.

The choice itself is unit-tested in tests/unit/test_routing.py.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from nats.aio.client import Client

from genmesh.services.frontend.serve import start_frontend
from genmesh.services.router.service import Router
from genmesh.shared.bus import flush_in_order
from genmesh.shared.subjects import Subjects
from tests.conftest import unique_namespace
from tests.http_util import post
from tests.inproc import AnyMesh, InProcessMesh
from tests.mesh import Mesh, frontend_options, wait_until
from tests.test_pd_routing import StandIn, eventually

pytestmark = pytest.mark.inproc

BODY = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}


def admitted(mesh: AnyMesh) -> dict[str, int]:
    return {w["id"]: w["stats"]["admitted"] for w in mesh.server_info()["genmesh"]["workers"]}


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as reply:
            return bool(reply.status == 200)
    except OSError:
        return False


async def health(mesh: AnyMesh) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.get(mesh.http_url + "/health") as r:
        return r.status, await r.text()


async def test_no_router_needed_and_the_policy_is_honoured(empty_mesh: InProcessMesh) -> None:
    empty_mesh.add_frontend("--router-policy", "round_robin")
    assert (await health(empty_mesh))[0] == 503  # no worker yet
    workers = [empty_mesh.add_worker().name for _ in range(2)]
    assert await health(empty_mesh) == (200, "")
    for _ in range(10):
        reply = await post(empty_mesh.http_url + "/generate", BODY)
        assert reply.status == 200, reply.body
    await asyncio.to_thread(
        wait_until, lambda: sum(admitted(empty_mesh).values()) == 10, 5.0, 0.02, "10 admitted"
    )
    # Round robin over the sorted workers, in this frontend: exactly alternating.
    assert admitted(empty_mesh) == dict.fromkeys(workers, 5)


async def test_sticky_keeps_one_request_at_a_time_on_one_worker(
    empty_mesh: InProcessMesh,
) -> None:
    # The frontend sees each request end, so the worker it chose last is idle again by
    # the next one and keeps it (rotation under load: tests/unit/test_routing.py).
    empty_mesh.add_frontend("--router-policy", "sticky")
    workers = [empty_mesh.add_worker().name for _ in range(2)]
    assert await health(empty_mesh) == (200, "")
    for _ in range(6):
        reply = await post(empty_mesh.http_url + "/generate", {**BODY, "stream": True})
        assert reply.status == 200, reply.body
    await asyncio.to_thread(
        wait_until, lambda: sum(admitted(empty_mesh).values()) == 6, 5.0, 0.02, "6 admitted"
    )
    assert sorted(admitted(empty_mesh).values()) == [0, 6]
    assert set(admitted(empty_mesh)) == set(workers)


async def test_refusals_are_the_routers_own(empty_mesh: InProcessMesh) -> None:
    """The same request, routed by the frontend and by a router, gets the same answer."""
    empty_mesh.add_router()
    empty_mesh.add_worker(speedup=0.2, max_concurrency=1)
    routed_here = empty_mesh.add_frontend(name="frontend-routes").value.port
    via_router = empty_mesh.add_frontend("--routing", "routers", name="frontend-routers").value.port
    urls = [f"http://127.0.0.1:{port}" for port in (routed_here, via_router)]
    await asyncio.to_thread(
        wait_until, lambda: all(ready(url) for url in urls), 5.0, 0.02, "both ready"
    )

    unknown = {"model": "no-such-model", "token_ids": [1, 2], "sampling_params": {}}
    json_type = {"Content-Type": "application/json"}
    a, b = [await post(url + "/inference/v1/generate", unknown, headers=json_type) for url in urls]
    assert a.status == b.status == 404
    assert a.body == b.body
    assert "`no-such-model` does not exist" in json.dumps(a.body)

    # The one slot taken for a few seconds: every attempt of both meets a full mesh.
    slow = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 60, "ignore_eos": True}}
    busy = asyncio.create_task(post(urls[0] + "/generate", slow))
    await asyncio.to_thread(
        wait_until, lambda: sum(admitted(empty_mesh).values()) == 1, 5.0, 0.02, "the slot taken"
    )
    a, b = await asyncio.gather(*(post(url + "/generate", BODY) for url in urls))
    assert not busy.done(), "the slot was freed too early for this test"
    assert a.status == b.status == 503
    assert a.body == b.body
    assert a.headers["Retry-After"] == b.headers["Retry-After"] == "1"
    assert "at capacity" in a.body["message"]
    busy.cancel()


async def test_routing_routers_still_goes_through_a_router(empty_mesh: InProcessMesh) -> None:
    empty_mesh.add_worker()
    empty_mesh.add_frontend("--routing", "routers")
    status, text = await health(empty_mesh)
    assert status == 503
    assert "no router" in text
    router = empty_mesh.add_router()
    await asyncio.to_thread(
        wait_until, lambda: empty_mesh._http_ok("/health"), 5.0, 0.05, "health with a router"
    )
    for _ in range(3):
        assert (await post(empty_mesh.http_url + "/generate", BODY)).status == 200
    routed: Router = router.value
    assert sum(routed.decisions.values()) == 3


def busy_worker(mesh: Mesh) -> str:
    """The worker whose card says it runs a request."""
    found: list[str] = []

    def running() -> bool:
        cards = mesh.server_info()["genmesh"]["workers"]
        found[:] = [c["id"] for c in cards if c["inflight"]]
        return bool(found)

    wait_until(running, 5.0, 0.01, "a busy worker")
    return found[0]


@pytest.mark.chaos
async def test_a_killed_worker_is_migrated_from_without_a_router(
    nats_url: str, tmp_path: Path
) -> None:
    mesh = Mesh(nats_url, tmp_path, unique_namespace("froutek"))
    try:
        frontend = mesh.add_frontend()
        workers = {w.name: w for w in (mesh.add_worker(speedup=0.5) for _ in range(2))}
        body: dict[str, Any] = {
            "input_ids": [5, 6, 7],
            "sampling_params": {"max_new_tokens": 40, "ignore_eos": True},
            "stream": True,
        }
        tokens: list[int] = []
        killed: list[str] = []
        async with (
            aiohttp.ClientSession() as s,
            s.post(mesh.http_url + "/generate", json=body) as r,
        ):
            assert r.status == 200
            async for line in r.content:
                text = line.decode().strip()
                if not text.startswith("data: {"):
                    continue
                tokens.extend(json.loads(text[6:])["output_ids"])
                if len(tokens) >= 3 and not killed:
                    victim = await asyncio.to_thread(busy_worker, mesh)
                    workers[victim].kill()
                    killed.append(victim)
        assert killed
        assert len(tokens) == 40
        assert "attempt 2 after" in frontend.log()
    except BaseException:
        print(mesh.logs())
        raise
    finally:
        mesh.stop()


async def test_a_worker_not_yet_back_on_nats_still_gets_the_request(
    nats_url: str, nc: Client, namespace: str
) -> None:
    """After a NATS outage the frontend may be back before a worker has subscribed again.
    Nothing subscribed to the chosen worker's subject is a refusal, retried after the
    refusal back-off (0.1, 0.2, 0.4 s), as on the router subject: before, the request
    met the same gap three times within milliseconds and failed (the soak test lost one)."""
    worker = StandIn(nc, Subjects(namespace), "w1", "both")
    await worker.start()
    frontend = await start_frontend(frontend_options(nats_url, namespace))
    try:
        await eventually(lambda: len(frontend.state.backend.directory.live()) == 1, "the card")
        assert worker.generate is not None
        await worker.generate.unsubscribe()  # as NATS restarts: still in discovery
        await flush_in_order(nc)

        async def back_on_nats() -> None:
            await asyncio.sleep(0.2)
            await worker.serve()

        back = asyncio.create_task(back_on_nats())
        reply = await post(f"http://127.0.0.1:{frontend.port}/generate", BODY)
        await back
        assert reply.status == 200, reply.body
        assert reply.body["output_ids"] == [5]
        assert len(worker.received) == 1
    finally:
        await frontend.close()

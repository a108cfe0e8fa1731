"""`genmesh status` (docs/status.md): the mesh from discovery and `$SRV`, each process
with its health, load and card age; one-shot, `--json`, `--watch`.

Against real meshes on the real nats-server: in-process services (their `$SRV` answers are
the real ones, `shared/micro.py`), and, where a process must die, OS processes killed with
SIGKILL and `genmesh status` run as a subprocess. What a mesh cannot be made to show on
its own (a process known to one side only, an unreadable answer) comes from real protocol
messages: a worker card published on the announce subject (protocol.md §9.1), and a
`$SRV` service run by nats-py's own `nats.micro` (the library the NATS tools speak).
"""

from __future__ import annotations

import asyncio
import io
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import nats
import nats.micro
import pytest
from nats.aio.client import Client
from nats.micro.service import EndpointConfig, ServiceConfig

from genmesh.client import MeshClient, request
from genmesh.codecs import get_codec
from genmesh.shared.connection import MeshConnection
from genmesh.shared.subjects import Subjects
from genmesh.status.config import StatusConfig
from genmesh.status.run import NOTHING_ANSWERS, run_status
from tests.inproc import InProcessMesh
from tests.mesh import Mesh, free_port, start_mesh, wait_until

pytestmark = pytest.mark.inproc


async def status_json(nats_url: str, namespace: str) -> tuple[int, dict[str, Any]]:
    """`genmesh status --json` in this process: (exit status, the object it printed)."""
    out = io.StringIO()
    config = StatusConfig(mesh=MeshConnection(nats_url, namespace), as_json=True)
    code = await run_status(config, out=out)
    return code, json.loads(out.getvalue())


def by_id(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {row["id"]: row for row in rows}


async def test_status_lists_routers_workers_and_the_frontend(
    nats_url: str, empty_mesh: InProcessMesh
) -> None:
    """Every process of a running mesh, `up`, with its engine, role, model and load from
    its card and its counts from `$SRV`; a busy worker's load shows its running request."""
    mesh = empty_mesh
    router = mesh.add_router()
    mesh.add_worker("wfast", max_concurrency=5)
    # Real time at 1/100 of the mock's speed: one request runs long enough to be seen.
    mesh.add_worker("wslow", max_concurrency=3, speedup=0.01)
    mesh.add_frontend()
    mesh.wait_for_workers(lambda ids: ids == {"wfast", "wslow"})

    async with await MeshClient.connect(nats_url, mesh.namespace) as client:
        frames = [f async for f in client.generate(request([1, 2, 3], max_tokens=2))]
        assert frames[-1]["t"] == "end"
        running = client.generate(request([4, 5, 6], max_tokens=10_000, worker="wslow"))
        first = await anext(running)  # admitted: the worker's load counts it
        assert first["t"] in ("ack", "out")

        async def busy() -> tuple[int, dict[str, Any]]:
            while True:
                code, shown = await status_json(nats_url, mesh.namespace)
                if by_id(shown["workers"])["wslow"]["inflight"] == 1:
                    return code, shown
                await asyncio.sleep(0.05)

        code, shown = await asyncio.wait_for(busy(), 10)
        await running.aclose()  # cancels the generation

    assert code == 0
    assert shown["namespace"] == mesh.namespace
    (routed,) = shown["routers"]
    assert routed["id"] == router.value.router_id
    assert routed["health"] == "up"
    assert routed["inflight"] == 0
    # A NATS-level client sends every request to the routers, pinned or not.
    assert routed["requests"] == 2
    assert routed["srv"]["metadata"]["role"] == "router"
    workers = by_id(shown["workers"])
    assert set(workers) == {"wfast", "wslow"}
    for wid, capacity in (("wfast", 5), ("wslow", 3)):
        worker = workers[wid]
        assert worker["health"] == "up", worker
        assert (worker["engine"], worker["role"], worker["model"]) == (
            "mock",
            "both",
            "genmesh-mock",
        )
        assert worker["capacity"] == capacity
        assert 0 <= worker["card_age_s"] < 3 * 1.0  # fresher than its expiry
        assert worker["srv"]["metadata"]["worker_id"] == wid
    assert workers["wslow"]["inflight"] == 1
    assert workers["wslow"]["srv"]["endpoints"]["generate"]["data"]["max_concurrency"] == 3
    assert workers["wfast"]["inflight"] == 0
    assert workers["wfast"]["requests"] + workers["wslow"]["requests"] == 2
    (frontend,) = shown["frontends"]
    assert frontend["health"] == "up"
    assert frontend["http"] == f"http://127.0.0.1:{mesh.http_port}"
    assert frontend["inflight"] == 0
    assert shown["notes"] == []


async def test_the_tables_show_each_process_on_one_row(nats_url: str, mesh: InProcessMesh) -> None:
    """Without --json: a table per kind, one row per process naming it, its health and
    (a worker) its engine, role, model and load; no notes when everything is up."""
    out = io.StringIO()
    code = await run_status(StatusConfig(mesh=MeshConnection(nats_url, mesh.namespace)), out)
    assert code == 0
    lines = out.getvalue().splitlines()
    assert lines[0].startswith(f"genmesh status  namespace {mesh.namespace}  {nats_url}  ")
    assert [line.strip() for line in lines if line[:1].isalpha()][1:] == [
        "routers",
        "workers",
        "frontends",
    ]
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in lines if "│" in line]
    for worker in mesh.workers:
        (row,) = [c for c in cells if c[0] == worker.name]
        assert row[1:6] == ["up", "mock", "both", "genmesh-mock", "0/256"]
    (frontend,) = [c for c in cells if c[2] == f"http://127.0.0.1:{mesh.http_port}"]
    assert frontend[1] == "up"
    assert sum(c[1] == "up" for c in cells) == 4  # a router, two workers, the frontend
    assert not any(line.startswith(("no_", "draining", "gone")) for line in lines)


async def test_a_process_known_to_one_side_only_is_flagged(
    nats_url: str, nc: Client, empty_mesh: InProcessMesh
) -> None:
    """A card without `$SRV` is `no_srv`; `$SRV` without a card is `no_card`, and
    `draining` once it left discovery to drain; each flag is explained in the notes."""
    mesh = empty_mesh
    mesh.add_worker("wboth")
    subjects = Subjects(mesh.namespace)
    msgpack = get_codec(None)
    card = {
        "v": 1,
        "id": "wcard",
        "engine": "mock",
        "inflight": 2,
        "capacity": 4,
        "heartbeat_s": 5.0,
        "model": "m1",
        "role": "decode",
        "disagg": {"kind": "mock"},
    }

    async def announce() -> None:
        await nc.publish(subjects.announce, msgpack.encode(card))

    async def on_query(_msg: Any) -> None:  # as a worker answers a directory's query
        await announce()

    query = await nc.subscribe(subjects.query, cb=on_query)
    service = await nats.micro.add_service(
        nc,
        ServiceConfig(
            name="genmesh",
            version="0.0.1",
            description="a worker whose engine is down",
            metadata={
                "namespace": mesh.namespace,
                "role": "worker",
                "worker_id": "wsrv",
                "worker_role": "prefill",
                "engine": "vllm",
                "model": "m2",
            },
        ),
    )
    await service.add_endpoint(
        EndpointConfig(name="generate", subject=subjects.worker_generate("wsrv"), handler=_noop)
    )
    try:
        code, shown = await status_json(nats_url, mesh.namespace)
        assert code == 0
        workers = by_id(shown["workers"])
        assert workers["wboth"]["health"] == "up"
        assert workers["wcard"]["health"] == "no_srv"
        assert (workers["wcard"]["role"], workers["wcard"]["model"]) == ("decode", "m1")
        assert (workers["wcard"]["inflight"], workers["wcard"]["capacity"]) == (2, 4)
        assert workers["wcard"]["srv"] is None
        wsrv = workers["wsrv"]
        assert wsrv["health"] == "no_card"
        # Without a card, what `$SRV` says: its metadata, the generate endpoint's data.
        assert (wsrv["engine"], wsrv["role"], wsrv["model"]) == ("vllm", "prefill", "m2")
        assert (wsrv["inflight"], wsrv["card_age_s"]) == (None, None)
        assert shown["notes"] == [
            "no_card: answers $SRV, but announces no card (engine down, or starting or stopping)",
            "no_srv: in discovery, but does not answer $SRV (hung, its NATS user may not "
            "answer $SRV, or a genmesh without it)",
        ]

        # A worker that leaves to drain, still answering $SRV, is draining.
        card["id"] = "wsrv"
        await query.unsubscribe()
        out = io.StringIO()
        config = StatusConfig(
            mesh=MeshConnection(nats_url, mesh.namespace), watch_s=0.2, as_json=True
        )
        watching = asyncio.ensure_future(run_status(config, out=out))
        await asyncio.sleep(0.1)
        await announce()
        await asyncio.sleep(0.5)
        await nc.publish(subjects.leave, msgpack.encode({"id": "wsrv", "draining": True}))

        def last() -> dict[str, Any]:
            lines = out.getvalue().splitlines()
            return json.loads(lines[-1]) if lines else {"workers": []}

        await _eventually(
            lambda: by_id(last()["workers"]).get("wsrv", {}).get("health") == "draining"
        )
        watching.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watching
    finally:
        await service.stop()


async def _noop(_request: Any) -> None:
    return None


async def _eventually(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_unreadable_srv_answers_are_counted_not_shown(
    nats_url: str, nc: Client, empty_mesh: InProcessMesh
) -> None:
    """An answer on `$SRV.INFO.genmesh` that is not an info response, and a genmesh service
    of the namespace without the id its role needs, are counted in the notes."""
    mesh = empty_mesh
    mesh.add_worker("wok")

    async def garbage(msg: Any) -> None:
        await nc.publish(msg.reply, b'{"type": "io.nats.micro.v1.info_response"}')

    sub = await nc.subscribe("$SRV.INFO.genmesh", cb=garbage)
    service = await nats.micro.add_service(
        nc,
        ServiceConfig(
            name="genmesh",
            version="0.0.1",
            metadata={"namespace": mesh.namespace, "role": "worker"},
        ),
    )
    try:
        code, shown = await status_json(nats_url, mesh.namespace)
    finally:
        await service.stop()
        await sub.unsubscribe()
    assert code == 0
    assert [w["id"] for w in shown["workers"]] == ["wok"]
    # The garbage, and the service (its INFO and STATS answers are one service).
    assert shown["unreadable_srv_answers"] == 2
    assert shown["notes"] == ["2 $SRV answer(s) could not be read or matched to a process"]


async def test_nothing_answers_in_an_empty_namespace(nats_url: str, namespace: str) -> None:
    code, shown = await status_json(nats_url, namespace)
    assert code == NOTHING_ANSWERS
    assert shown["workers"] == shown["routers"] == shown["frontends"] == []
    assert shown["notes"] == [
        f"nothing answers in namespace {namespace!r}: no worker card, router presence or $SRV reply"
    ]


def genmesh_status(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "genmesh", "status", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.process
def test_unreachable_nats_is_one_line_and_exit_status_2() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    done = genmesh_status("--nats-url", url, "--json")
    assert done.returncode == 2
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"genmesh: cannot reach NATS at {url}: "), line


@pytest.mark.chaos
def test_a_killed_worker_is_gone_while_the_others_stay_up(
    nats_url: str, namespace: str, tmp_path: Path
) -> None:
    """The issue's case: a mesh of worker processes, one SIGKILLed. `genmesh status --json`
    (a subprocess) no longer lists it; `--watch` shows it stop answering `$SRV` at once
    (`no_srv`, its card still fresh) and then `gone` once its card expires (3 heartbeats
    of 0.5 s), while the others stay `up`."""
    mesh: Mesh = start_mesh(
        nats_url, tmp_path, namespace=namespace, workers=3, worker_opts={"heartbeat": 0.5}
    )
    watch = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "genmesh",
            "status",
            "--nats-url",
            nats_url,
            "--namespace",
            namespace,
            "--watch",
            "0.2",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ids = {w.name for w in mesh.workers}
        before = json.loads(
            genmesh_status("--nats-url", nats_url, "--namespace", namespace, "--json").stdout
        )
        assert {w["id"]: w["health"] for w in before["workers"]} == dict.fromkeys(ids, "up")
        assert [r["health"] for r in before["routers"]] == ["up"]
        assert [f["health"] for f in before["frontends"]] == ["up"]
        assert watch.stdout is not None
        first = json.loads(watch.stdout.readline())
        assert {w["id"] for w in first["workers"]} == ids

        victim = mesh.workers[0]
        victim.kill()  # SIGKILL: no leave, its card expires
        killed_at = time.monotonic()
        survivors = ids - {victim.name}
        wait_until(lambda: not victim.alive, what="the worker to die")
        done = genmesh_status("--nats-url", nats_url, "--namespace", namespace, "--json")
        assert done.returncode == 0, done.stderr
        after = json.loads(done.stdout)
        assert {w["id"]: w["health"] for w in after["workers"]} == dict.fromkeys(survivors, "up")

        seen: list[str] = []
        while not seen or seen[-1] != "gone":
            assert time.monotonic() - killed_at < 10, seen
            frame = json.loads(watch.stdout.readline())
            health = {w["id"]: w["health"] for w in frame["workers"]}
            assert all(health[s] == "up" for s in survivors), health
            if not seen or seen[-1] != health[victim.name]:
                seen.append(health[victim.name])
        # Up (the frames before the kill showed), then its $SRV gone at once with its
        # connection, its card for up to 3 x 0.5 s more, then gone.
        assert seen[-2:] == ["no_srv", "gone"], seen
        assert set(seen) <= {"up", "no_srv", "gone"}, seen
        assert time.monotonic() - killed_at < 3 * 0.5 + 2.0
        assert "gone_for_s" in next(w for w in frame["workers"] if w["id"] == victim.name)
    finally:
        watch.send_signal(signal.SIGTERM)
        try:
            watch.wait(timeout=10)
        finally:
            if watch.poll() is None:
                watch.kill()
            mesh.stop()
    assert watch.returncode == 0, watch.stderr.read() if watch.stderr else ""

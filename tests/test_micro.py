"""`$SRV`: every genmesh process answers the NATS micro protocol (ADR-32), so that
`nats micro ls|info|stats genmesh` list the mesh (docs/protocol.md, "$SRV (NATS micro)").

Requests go out as the NATS CLI sends them (a request on `$SRV.<VERB>[.genmesh[.<id>]]`,
every reply gathered until a short quiet interval), and each reply is checked against the
CLI's own JSON schemas (tests/srv.py). The `nats` binary is not installed here; the
schemas stand for it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client

from genmesh import __version__
from genmesh.client import MeshClient, request
from genmesh.codecs import get_codec
from genmesh.services.worker.config import WorkerConfig
from genmesh.shared.bus import flush_in_order
from genmesh.shared.natsserver import NatsServer
from genmesh.shared.subjects import Subjects
from genmesh.status.srv import QUIET_S
from tests.conftest import unique_namespace
from tests.http_util import post
from tests.inproc import InProcessMesh, start_inproc_mesh
from tests.srv import by_role, endpoint, gather
from tests.tcp_proxy import TcpProxy

pytestmark = pytest.mark.inproc


async def test_every_process_answers_ping_as_the_cli_parses_it(
    nc: Client, mesh: InProcessMesh
) -> None:
    for subject in ("$SRV.PING", "$SRV.PING.genmesh"):
        pings = await gather(nc, subject, kind="ping", namespace=mesh.namespace)
        assert {p["type"] for p in pings} == {"io.nats.micro.v1.ping_response"}
        assert {(p["name"], p["version"]) for p in pings} == {("genmesh", __version__)}
        assert len({p["id"] for p in pings}) == len(pings)  # one instance per process
        workers = by_role(pings, "worker")
        assert sorted(w["metadata"]["worker_id"] for w in workers) == sorted(
            w.name for w in mesh.workers
        )
        assert len(by_role(pings, "router")) == 1
        assert len(by_role(pings, "frontend")) == 1
    # One instance by its id.
    worker = workers[0]
    (alone,) = await gather(
        nc, f"$SRV.PING.genmesh.{worker['id']}", kind="ping", namespace=mesh.namespace
    )
    assert alone == worker


async def test_info_lists_each_process_its_endpoints_and_metadata(
    nc: Client, mesh: InProcessMesh
) -> None:
    infos = await gather(nc, "$SRV.INFO.genmesh", kind="info", namespace=mesh.namespace)
    subjects = Subjects(mesh.namespace)
    assert len(by_role(infos, "worker")) == len(mesh.workers) == 2
    for info in by_role(infos, "worker"):
        wid = info["metadata"]["worker_id"]
        assert info["metadata"] == {
            "namespace": mesh.namespace,
            "role": "worker",
            "worker_id": wid,
            "worker_role": "both",
            "engine": "mock",
            "model": "genmesh-mock",
            "format": "*",
        }
        assert info["description"] == f"genmesh worker {wid} (mock engine)"
        assert {(e["name"], e["subject"], e["queue_group"]) for e in info["endpoints"]} == {
            ("generate", subjects.worker_generate(wid), ""),
            ("ping", subjects.worker_ping(wid), ""),
            ("cancel", subjects.cancel, ""),
            ("abort", subjects.abort, ""),
            ("flush_cache", subjects.flush_cache, ""),
        }
    (router,) = by_role(infos, "router")
    router_id = router["metadata"]["router_id"]
    assert router_id
    assert router["description"] == f"genmesh router {router_id} (policy round_robin)"
    assert router["endpoints"] == [
        {
            "name": "generate",
            "subject": subjects.router_generate,
            "queue_group": "router",
            "metadata": {},
        }
    ]


async def test_stats_count_requests_and_errors_per_endpoint(
    nc: Client, nats_url: str, mesh: InProcessMesh
) -> None:
    """n requests through the router: its generate endpoint counts n, the workers' n
    between them; an invalid envelope sent to a worker is an error of that worker's."""
    ns = mesh.namespace

    async def stats() -> list[dict[str, Any]]:
        return await gather(nc, "$SRV.STATS.genmesh", kind="stats", namespace=ns)

    def generate_counts(answers: list[dict[str, Any]], role: str) -> tuple[int, int]:
        eps = [endpoint(a, "generate") for a in by_role(answers, role)]
        return sum(e["num_requests"] for e in eps), sum(e["num_errors"] for e in eps)

    before = await stats()
    n = 5
    async with await MeshClient.connect(nats_url, ns) as client:
        for i in range(n):
            frames = [f async for f in client.generate(request([1, 2, i], max_tokens=3))]
            assert frames[-1]["t"] == "end", frames[-1]
    after = await stats()
    assert generate_counts(after, "router")[0] == generate_counts(before, "router")[0] + n
    assert generate_counts(after, "worker")[0] == generate_counts(before, "worker")[0] + n
    assert generate_counts(after, "worker")[1] == generate_counts(before, "worker")[1]
    for worker in by_role(after, "worker"):
        generate = endpoint(worker, "generate")
        assert generate["data"] == {
            "inflight": 0,
            "max_concurrency": WorkerConfig().max_concurrency,  # the shared mesh's
        }
        if generate["num_requests"]:
            assert generate["processing_time"] > 0
            assert generate["average_processing_time"] == (
                generate["processing_time"] // generate["num_requests"]
            )
    (router,) = by_role(after, "router")
    assert endpoint(router, "generate")["data"] == {"inflight": 0}

    # An envelope without its fields, straight to one worker: refused, counted as an error.
    wid = mesh.workers[0].name
    (target,) = [w for w in by_role(after, "worker") if w["metadata"]["worker_id"] == wid]
    json_codec = get_codec("json")
    reply = await nc.request(
        Subjects(ns).worker_generate(wid),
        json_codec.encode({"v": 1, "id": "micro-bad"}),
        headers={"genmesh-codec": "json"},
        timeout=5,
    )
    assert json_codec.decode(reply.data)["code"] == "bad_envelope"
    (refused,) = await gather(nc, f"$SRV.STATS.genmesh.{target['id']}", kind="stats", namespace=ns)
    generate = endpoint(refused, "generate")
    assert generate["num_requests"] == endpoint(target, "generate")["num_requests"] + 1
    assert generate["num_errors"] == endpoint(target, "generate")["num_errors"] + 1
    assert generate["last_error"].startswith("bad_envelope: "), generate["last_error"]


async def test_the_small_endpoints_count_their_messages(nc: Client, mesh: InProcessMesh) -> None:
    """A ping of one worker is one request of its `ping` endpoint; a cancel reaches every
    worker's `cancel`."""
    ns = mesh.namespace
    wid = mesh.workers[0].name

    async def worker_stats() -> dict[str, dict[str, Any]]:
        answers = await gather(nc, "$SRV.STATS.genmesh", kind="stats", namespace=ns)
        return {a["metadata"]["worker_id"]: a for a in by_role(answers, "worker")}

    before = await worker_stats()
    await nc.request(Subjects(ns).worker_ping(wid), b"", timeout=5)
    await nc.publish(Subjects(ns).cancel, get_codec("json").encode({"id": "micro-nobody"}),
                     headers={"genmesh-codec": "json"})  # fmt: skip
    await flush_in_order(nc)
    await asyncio.sleep(QUIET_S)
    after = await worker_stats()
    for worker, stats in after.items():
        pings = (
            endpoint(stats, "ping")["num_requests"]
            - endpoint(before[worker], "ping")["num_requests"]
        )
        assert pings == (1 if worker == wid else 0)
        cancels = endpoint(stats, "cancel")["num_requests"]
        assert cancels == endpoint(before[worker], "cancel")["num_requests"] + 1
        assert endpoint(stats, "cancel")["num_errors"] == 0


async def test_the_frontend_reports_its_http_requests(nc: Client, mesh: InProcessMesh) -> None:
    """The frontend's one endpoint, `http`, counts its generate requests: n served, one
    refused (a 400) an error."""
    ns = mesh.namespace

    async def frontend() -> dict[str, Any]:
        answers = await gather(nc, "$SRV.STATS.genmesh", kind="stats", namespace=ns)
        (found,) = by_role(answers, "frontend")
        return endpoint(found, "http")

    (info,) = by_role(await gather(nc, "$SRV.INFO.genmesh", kind="info", namespace=ns), "frontend")
    assert info["metadata"] == {"namespace": ns, "role": "frontend", "http": mesh.http_url}
    assert info["endpoints"] == [
        {"name": "http", "subject": mesh.http_url, "queue_group": "", "metadata": {}}
    ]
    before = await frontend()
    n = 3
    for i in range(n):
        body = {"input_ids": [1, 2, i], "sampling_params": {"max_new_tokens": 2}}
        assert (await post(mesh.http_url + "/generate", body)).status == 200
    served = await frontend()
    assert served["num_requests"] == before["num_requests"] + n
    assert served["num_errors"] == before["num_errors"]
    assert served["processing_time"] > before["processing_time"]
    assert served["data"] == {"inflight": 0}

    refused = await post(mesh.http_url + "/generate", {"input_ids": "not tokens"})
    assert refused.status == 400
    after = await frontend()
    assert after["num_requests"] == served["num_requests"] + 1
    assert after["num_errors"] == served["num_errors"] + 1
    assert after["last_error"] == "400 invalid_argument", after["last_error"]


async def test_a_prefill_decode_pair_lists_its_kv_endpoints(nc: Client, nats_url: str) -> None:
    """Workers with a prefix cache serve `kv_snapshot`; a mock prefill worker serves
    `kv_pull`, which a disaggregated request calls once."""
    ns = unique_namespace("micro-pd")
    kv = ("--mock-kv-blocks", "64")
    mesh = start_inproc_mesh(
        nats_url,
        namespace=ns,
        routers=0,
        worker_args=[("--role", "prefill", *kv), ("--role", "decode", *kv)],
    )
    try:
        subjects = Subjects(ns)
        infos = by_role(await gather(nc, "$SRV.INFO", kind="info", namespace=ns), "worker")
        roles = {i["metadata"]["worker_role"]: i for i in infos}
        assert set(roles) == {"prefill", "decode"}
        for info in roles.values():
            wid = info["metadata"]["worker_id"]
            names = {e["name"]: e["subject"] for e in info["endpoints"]}
            assert names["kv_snapshot"] == subjects.worker_kv_snapshot(wid)
            # Both mocks serve their KV handles (a decode worker's are never asked for).
            assert names["kv_pull"] == subjects.worker_kv_pull(wid)

        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
        assert (await post(mesh.http_url + "/generate", body)).status == 200
        stats = by_role(await gather(nc, "$SRV.STATS", kind="stats", namespace=ns), "worker")
        counts = {
            s["metadata"]["worker_role"]: {
                e["name"]: (e["num_requests"], e["num_errors"]) for e in s["endpoints"]
            }
            for s in stats
        }
        assert counts["prefill"]["generate"] == (1, 0)  # the request's prefill stage
        assert counts["prefill"]["kv_pull"] == (1, 0)
        assert counts["decode"]["generate"] == (1, 0)
        assert counts["decode"]["kv_pull"] == (0, 0)
    finally:
        mesh.stop()


async def test_srv_answers_again_after_a_reconnect(
    nc: Client, nats_url: str, empty_mesh: InProcessMesh
) -> None:
    """A worker whose NATS connection is cut answers `$SRV` again once it is back: the
    same instance, its counts kept."""
    proxy = TcpProxy(int(nats_url.rsplit(":", 1)[1])).start()
    try:
        empty_mesh.add_worker("w1", wait=False, extra_args=("--nats-url", proxy.url))
        ns = empty_mesh.namespace
        await nc.request(Subjects(ns).worker_ping("w1"), b"", timeout=5)  # subscribed by now
        (before,) = await gather(nc, "$SRV.STATS.genmesh", kind="stats", namespace=ns)
        assert endpoint(before, "ping")["num_requests"] == 1
        proxy.cut()
        assert await gather(nc, "$SRV.PING", kind="ping", namespace=ns) == []
        proxy.restore()
        for _ in range(50):
            back = await gather(nc, "$SRV.STATS.genmesh", kind="stats", namespace=ns)
            if back:
                break
        (after,) = back
        assert after["id"] == before["id"]
        assert endpoint(after, "ping")["num_requests"] == 1
    finally:
        proxy.close()


async def test_a_user_that_may_not_answer_srv_still_serves(tmp_path: Path) -> None:
    """Permissions written before `$SRV` (no `$SRV` subscriptions): the worker starts and
    serves as it did, unlisted, and says why in its log."""
    conf = tmp_path / "legacy.conf"
    conf.write_text(
        "authorization { users = [\n"
        '  {user: legacy, password: pw, permissions: {subscribe: {deny: ["$SRV.>"]}}}\n'
        "] }\n"
    )
    server = NatsServer(config_file=str(conf))
    server.start()
    mesh = InProcessMesh(server.url, unique_namespace("legacy"))
    try:
        worker = mesh.add_worker(
            "w1", wait=False, extra_args=("--nats-user", "legacy", "--nats-password", "pw")
        )
        nc = await nats.connect(server.url, user="legacy", password="pw")
        try:
            alive = await nc.request(Subjects(mesh.namespace).worker_ping("w1"), b"", timeout=5)
            assert alive.data == b""
            assert await gather(nc, "$SRV.PING", kind="ping", namespace=mesh.namespace) == []
        finally:
            await nc.close()
        assert "not answering $SRV (NATS micro): the NATS server refused a subscription to" in (
            worker.log()
        )
    finally:
        mesh.stop()
        server.stop()


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_a_worker_in_front_of_an_engine_names_it_and_its_model(
    nc: Client, empty_mesh: InProcessMesh, engine: str
) -> None:
    """The metadata of a worker in front of an SGLang or vLLM server (the testkit's): its
    engine, and the model the server says it serves."""
    _, url = empty_mesh.spawn_engine_server(engine, "--model", f"{engine}-model")
    empty_mesh.add_worker("w1", wait=False, engine=engine, engine_url=url)
    (info,) = await gather(nc, "$SRV.INFO", kind="info", namespace=empty_mesh.namespace)
    assert info["description"] == f"genmesh worker w1 ({engine} engine)"
    assert {k: info["metadata"][k] for k in ("engine", "model", "format")} == {
        "engine": engine,
        "model": f"{engine}-model",
        "format": "*",
    }


async def test_a_workers_model_is_filled_in_when_its_engine_comes_up(
    nc: Client, empty_mesh: InProcessMesh
) -> None:
    """A worker whose engine is down at start does not know its model yet (`unknown`); its
    `$SRV` metadata names the model once the engine answers."""
    _, url = empty_mesh.spawn_engine_server("sglang", "--model", "late-model")
    proxy = TcpProxy(int(url.rsplit(":", 1)[1])).start()
    try:
        proxy.cut()
        empty_mesh.add_worker(
            "w1", wait=False, engine="sglang", engine_url=f"http://127.0.0.1:{proxy.port}"
        )
        ns = empty_mesh.namespace
        (info,) = await gather(nc, "$SRV.INFO", kind="info", namespace=ns)
        assert info["metadata"]["model"] == "unknown"
        proxy.restore()
        for _ in range(40):
            (info,) = await gather(nc, "$SRV.INFO", kind="info", namespace=ns)
            if info["metadata"]["model"] != "unknown":
                break
            await asyncio.sleep(0.25)
        assert info["metadata"]["model"] == "late-model"
    finally:
        proxy.close()

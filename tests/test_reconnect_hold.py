"""A frontend (or NATS-level client) whose NATS connection drops holds new requests while it
reconnects, for `--reconnect-hold` seconds, and sends them once connected; past the hold
they get a clear 503 (docs/limits.md, "Item 10").

The frontend reaches the real nats-server through a TCP proxy (tests/tcp_proxy.py) that
the test cuts and restores: the frontend's node dies and comes back while the worker and
router, connected straight to the server, stay up. The node-kill test on a real 3-node
cluster is tests/test_deploy.py's `test_a_cluster_node_dies_under_load`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import pytest

from genmesh.client import ClientFrame, MeshClient, request
from tests.http_util import parse_sse
from tests.inproc import InProcessMesh
from tests.tcp_proxy import TcpProxy

pytestmark = pytest.mark.inproc

SGLANG = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
VLLM = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 8, "ignore_eos": True}}
NOT_CONNECTED = "genmesh is not ready: not connected to NATS"


@pytest.fixture
def proxy(nats_url: str) -> Iterator[TcpProxy]:
    proxy = TcpProxy(int(nats_url.rsplit(":", 1)[1])).start()
    yield proxy
    proxy.close()


@pytest.fixture
def behind_proxy(empty_mesh: InProcessMesh, proxy: TcpProxy) -> Callable[..., InProcessMesh]:
    """A router and a worker on the server itself; a frontend (its options given) through
    the proxy."""

    def start(*frontend_args: str) -> InProcessMesh:
        empty_mesh.add_router()
        empty_mesh.add_worker("w1", wait=False, vocab_size=1000, eos_token_id=7)
        empty_mesh.add_frontend("--nats-url", proxy.url, *frontend_args)
        empty_mesh.wait_for_workers(lambda ids: "w1" in ids, what="the worker")
        return empty_mesh

    return start


async def post(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], **headers: str
) -> tuple[int, dict[str, str], Any]:
    async with session.post(url, json=body, headers=headers) as resp:
        text = await resp.text()
        payload = parse_sse(text) if body.get("stream") else await resp.json(content_type=None)
        return resp.status, dict(resp.headers), payload


async def health_becomes(session: aiohttp.ClientSession, mesh: InProcessMesh, status: int) -> str:
    """/health's text once it answers `status` (it follows the connection at once)."""
    for _ in range(200):
        async with session.get(mesh.http_url + "/health") as resp:
            if resp.status == status:
                return await resp.text()
        await asyncio.sleep(0.05)
    raise TimeoutError(f"/health never answered {status}")


async def test_requests_sent_while_the_frontend_reconnects_are_held_then_served(
    behind_proxy: Callable[..., InProcessMesh], proxy: TcpProxy
) -> None:
    mesh = behind_proxy("--reconnect-hold", "30")
    sglang_url = mesh.http_url + "/generate"
    vllm_url = mesh.http_url + "/inference/v1/generate"
    async with aiohttp.ClientSession() as session:
        expected = await post(session, sglang_url, SGLANG)
        assert expected[0] == 200, expected
        proxy.cut()
        # /health still says at once what is going on.
        assert await health_becomes(session, mesh, 503) == NOT_CONNECTED
        held = [
            asyncio.create_task(post(session, sglang_url, SGLANG)),
            asyncio.create_task(post(session, vllm_url, {**VLLM, "stream": True})),
        ]
        await asyncio.sleep(0.5)
        # Refused at once before the hold existed: a 503 "not connected to NATS".
        assert not any(task.done() for task in held), [t.result() for t in held if t.done()]
        proxy.restore()
        (status, _, unary), (sse_status, sse_headers, events) = await asyncio.gather(*held)
        metrics = await (await session.get(mesh.http_url + "/metrics")).text()
    print(f"\nheld while reconnecting: {status=} {sse_status=}")
    assert status == 200, unary
    assert unary["output_ids"] == expected[2]["output_ids"]
    assert sse_status == 200, events
    assert sse_headers["Content-Type"].startswith("text/event-stream")
    assert events[-1] == "[DONE]"
    tokens = [t for e in events[:-1] for c in e["choices"] for t in c["token_ids"]]
    assert tokens == expected[2]["output_ids"]  # the same deterministic mock, both formats
    # Sent once connected: no attempt timed out in nats-py's reconnect buffer and moved on.
    migrations = [m for m in metrics.splitlines() if m.startswith("genmesh_frontend_migrations_")]
    assert migrations, metrics
    assert all(m.endswith(" 0.0") for m in migrations), migrations
    frontend = next(s for s in mesh.services if s.role == "frontend")
    assert frontend.log().count("reconnected to") == 1


@pytest.mark.parametrize(
    ("hold", "headers", "message"),
    [
        pytest.param("0", {}, NOT_CONNECTED, id="no-hold-refuses-at-once"),
        pytest.param(
            "0.3", {}, f"{NOT_CONNECTED} (still reconnecting after 0.3s)", id="past-the-hold"
        ),
        pytest.param(
            "30",
            {"X-Request-Timeout": "0.2"},
            f"{NOT_CONNECTED} (still reconnecting after 0.2s)",
            id="past-the-request-timeout",
        ),
    ],
)
async def test_past_the_reconnect_hold_a_request_gets_a_clear_503(
    behind_proxy: Callable[..., InProcessMesh],
    proxy: TcpProxy,
    hold: str,
    headers: dict[str, str],
    message: str,
) -> None:
    mesh = behind_proxy("--reconnect-hold", hold)
    async with aiohttp.ClientSession() as session:
        proxy.cut()
        await health_becomes(session, mesh, 503)
        sglang = await post(session, mesh.http_url + "/generate", SGLANG, **headers)
        vllm = await post(session, mesh.http_url + "/inference/v1/generate", VLLM, **headers)
        proxy.restore()
        await health_becomes(session, mesh, 200)
        after = await post(session, mesh.http_url + "/generate", SGLANG)
    status, sent, body = sglang
    assert (status, sent["Retry-After"]) == (503, "1"), sglang
    assert body == {
        "object": "error",
        "message": message,
        "type": "503",
        "param": None,
        "code": 503,
    }
    status, sent, body = vllm
    assert (status, sent["Retry-After"]) == (503, "1"), vllm
    assert body == {
        "error": {
            "message": message,
            "type": "ServiceUnavailableError",
            "param": None,
            "code": 503,
        }
    }
    assert after[0] == 200, after  # and it serves on once reconnected


async def generate(client: MeshClient) -> list[ClientFrame]:
    return [f async for f in client.generate(request([5, 6, 7], max_tokens=4, ignore_eos=True))]


async def cut(proxy: TcpProxy, client: MeshClient) -> None:
    """Cut the proxy, and return once the client has noticed."""
    proxy.cut()
    for _ in range(200):
        if not client.nc.is_connected:
            return
        await asyncio.sleep(0.01)
    raise TimeoutError("the client never noticed the cut")


async def test_a_mesh_client_sends_a_request_once_reconnected(
    behind_proxy: Callable[..., InProcessMesh], proxy: TcpProxy
) -> None:
    """Published into nats-py's reconnect buffer, the request's acknowledgement timeout
    (0.3 s) would run out before it was sent: it would move on, with a `mig` frame."""
    mesh = behind_proxy()
    async with await MeshClient.connect(
        proxy.url, mesh.namespace, ack_timeout_s=0.3, reconnect_hold_s=30
    ) as client:
        await cut(proxy, client)
        pending = asyncio.create_task(generate(client))
        await asyncio.sleep(1.0)
        assert not pending.done(), pending.result()
        proxy.restore()
        got = await pending
    kinds = [f["t"] for f in got]
    assert (kinds[0], kinds[-1]) == ("ack", "end"), got
    assert "mig" not in kinds, got
    assert sum(len(f["tokens"]) for f in got if f["t"] in ("out", "end")) == 4


async def test_past_the_reconnect_hold_a_mesh_client_request_ends_without_retries(
    behind_proxy: Callable[..., InProcessMesh], proxy: TcpProxy
) -> None:
    mesh = behind_proxy()
    async with await MeshClient.connect(proxy.url, mesh.namespace, reconnect_hold_s=0.3) as client:
        await cut(proxy, client)
        got = await generate(client)
        proxy.restore()
    # One attempt: another worker would not help a client that cannot reach NATS.
    assert len(got) == 1, got
    assert {k: got[0].get(k) for k in ("t", "code", "message", "retryable", "origin")} == {
        "t": "err",
        "code": "unavailable",
        "message": "not connected to NATS (still reconnecting after 0.3s)",
        "retryable": False,
        "origin": "client",
    }

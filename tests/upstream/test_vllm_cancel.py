"""Port of vLLM's cancel tests: /v1/requests/{id}/cancel, DELETE /v1/requests/{id},
/v1/requests/cancel, /abort_requests, and the API key in front of them.

Origin: vllm-project/vllm `tests/entrypoints/serve/test_cancel.py`
@ 71c6740d8e6cd81f441c51bff85f25d6a7f546f9.

Upstream mounts the cancel router on a FastAPI app over a MagicMock engine whose
"active" requests are `cmpl-123` and `chatcmpl-456`. Adapted: the requests are real and
running, on this module's own mesh of real-time mock workers (a 1000-token request lasts
seconds), started as streams to /inference/v1/generate; their ids are the `request_id`
vLLM gives them ("generate-tokens-<X-Request-Id>"), read off their first chunk. Not
ported: `test_cancel_single_request_race_condition` (it scripts the engine to lose the
request between has_request and abort).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import aiohttp
import pytest

from tests.inproc import InProcessMesh
from tests.upstream.kit import post_json, start_mesh_with

pytestmark = pytest.mark.inproc

GEN_ENDPOINT = "/inference/v1/generate"
API_KEY = "secret-token-123"


@pytest.fixture(scope="module")
def slow_mesh(nats_url: str) -> Iterator[InProcessMesh]:
    mesh = start_mesh_with(nats_url, "vcancel", speedup=1.0)
    yield mesh
    mesh.stop()


@dataclass
class Running:
    """A streaming generate request in flight: its id, and the rest of its stream."""

    request_id: str
    task: asyncio.Task[list[Any]]
    first: dict[str, Any] = field(default_factory=dict)


@contextlib.asynccontextmanager
async def running(mesh: InProcessMesh, client_id: str) -> AsyncIterator[Running]:
    """Start a long streaming request with X-Request-Id `client_id`; yields once its first
    chunk is in (so the engine has it), and cancels what is left on the way out."""
    session = aiohttp.ClientSession()
    resp = await session.post(
        mesh.http_url + GEN_ENDPOINT,
        json={
            "token_ids": [1, 2, 3],
            "sampling_params": {"max_tokens": 1000, "ignore_eos": True},
            "stream": True,
        },
        headers={"X-Request-Id": client_id},
    )
    assert resp.status == 200, await resp.text()

    async def events() -> list[Any]:
        out = []
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: "):
                payload = line[len("data: ") :]
                out.append(payload if payload == "[DONE]" else json.loads(payload))
        return out

    first_line = b""
    while not first_line.startswith(b"data: "):
        first_line = await asyncio.wait_for(resp.content.readline(), 10)
    first = json.loads(first_line[len(b"data: ") :])
    task = asyncio.create_task(events())
    try:
        yield Running(first["request_id"], task, first)
    finally:
        task.cancel()
        resp.close()
        await session.close()


async def finished(run: Running) -> list[Any]:
    """The rest of a cancelled request's stream: it must end soon, not after 1000 tokens."""
    return await asyncio.wait_for(run.task, 10)


async def test_cancel_single_request_success(slow_mesh: InProcessMesh) -> None:
    async with running(slow_mesh, "cmpl-123") as run:
        reply = await post_json(slow_mesh.http_url + f"/v1/requests/{run.request_id}/cancel", None)
        assert reply.status == HTTPStatus.OK, reply.body
        assert reply.body["status"] == "cancelled"
        assert reply.body["request_id"] == run.request_id
        events = await finished(run)
        tokens = [
            t
            for e in [run.first, *events]
            if isinstance(e, dict)
            for t in e["choices"][0]["token_ids"]
        ]
        assert len(tokens) < 1000


async def test_cancel_single_request_delete_method(slow_mesh: InProcessMesh) -> None:
    async with running(slow_mesh, "chatcmpl-456") as run:
        reply = await post_json(
            slow_mesh.http_url + f"/v1/requests/{run.request_id}", None, method="DELETE"
        )
        assert reply.status == HTTPStatus.OK, reply.body
        assert reply.body["status"] == "cancelled"
        assert reply.body["request_id"] == run.request_id
        await finished(run)


async def test_cancel_single_request_not_found(slow_mesh: InProcessMesh) -> None:
    reply = await post_json(slow_mesh.http_url + "/v1/requests/nonexistent-id/cancel", None)
    assert reply.status == HTTPStatus.NOT_FOUND, reply.body
    assert reply.body["error"]["type"] == "NotFoundError"
    assert "nonexistent-id" in reply.body["error"]["message"]


async def test_cancel_batch_requests(slow_mesh: InProcessMesh) -> None:
    async with running(slow_mesh, "cmpl-123") as one, running(slow_mesh, "chatcmpl-456") as two:
        reply = await post_json(
            slow_mesh.http_url + "/v1/requests/cancel",
            {"request_ids": [one.request_id, two.request_id, "missing"]},
        )
        assert reply.status == HTTPStatus.OK, reply.body
        assert reply.body["status"] == "cancelled"
        assert one.request_id in reply.body["cancelled_request_ids"]
        assert two.request_id in reply.body["cancelled_request_ids"]
        assert "missing" not in reply.body["cancelled_request_ids"]
        await finished(one)
        await finished(two)


async def test_cancel_batch_empty(slow_mesh: InProcessMesh) -> None:
    reply = await post_json(slow_mesh.http_url + "/v1/requests/cancel", {"request_ids": []})
    assert reply.status == HTTPStatus.OK, reply.body
    assert reply.body["status"] == "cancelled"
    assert reply.body["cancelled_request_ids"] == []


async def test_abort_requests_with_ids(slow_mesh: InProcessMesh) -> None:
    async with running(slow_mesh, "cmpl-123") as run:
        reply = await post_json(
            slow_mesh.http_url + "/abort_requests", {"request_ids": [run.request_id]}
        )
        assert reply.status == HTTPStatus.OK, reply.body
        assert reply.body["status"] == "cancelled"
        assert run.request_id in reply.body["cancelled_request_ids"]
        await finished(run)


async def test_abort_requests_empty_body(slow_mesh: InProcessMesh) -> None:
    reply = await post_json(slow_mesh.http_url + "/abort_requests", {})
    assert reply.status == HTTPStatus.OK, reply.body
    assert reply.body["status"] == "cancelled"


async def test_authentication_middleware_protects_cancel_endpoint(
    slow_mesh: InProcessMesh,
) -> None:
    """With an API key (vLLM's and SGLang's `--api-key`), the cancel route wants it:
    401 without, 200 with. A second frontend on the same mesh carries the key."""
    previous = slow_mesh.http_port
    keyed = slow_mesh.add_frontend("--api-key", API_KEY, name="frontend-keyed")
    keyed_url = f"http://127.0.0.1:{keyed.value.port}"
    slow_mesh.http_port = previous  # the module's other tests keep the open frontend
    try:
        async with running(slow_mesh, "cmpl-123") as run:
            path = f"/v1/requests/{run.request_id}/cancel"
            unauth = await post_json(keyed_url + path, None)
            assert unauth.status == HTTPStatus.UNAUTHORIZED, unauth.body
            auth = await post_json(
                keyed_url + path, None, headers={"Authorization": f"Bearer {API_KEY}"}
            )
            assert auth.status == HTTPStatus.OK, auth.body
            await finished(run)
    finally:
        slow_mesh.stop_service(keyed)

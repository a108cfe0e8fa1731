"""The frontend's HTTP edge against hostile clients (issue 15, items 3-7), over real sockets
against a real frontend on a real NATS: a body the bus cannot carry, client IDs that are no
header text, values that once made 500s, disconnects in the log, JSON 405s, and the
timeouts and connection bound that keep a slow or greedy client from holding the server."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, urlsplit

import nats
import pytest

from tests.conftest import unique_namespace
from tests.http_util import post, raw_exchange, stream
from tests.inproc import InProcessMesh, worker_requests

pytestmark = pytest.mark.inproc

SGLANG, VLLM = "/generate", "/inference/v1/generate"
# Long enough a context for a prompt past the tests' nats-server's max_payload (8 MiB:
# 2 Mi tokens packed), so that a prompt outgrows the server's limit, not the model's.
CONTEXT = 4_000_000
IDLE_TIMEOUT_S, BODY_TIMEOUT_S = 0.5, 0.5


@pytest.fixture(scope="module")
def edge(nats_url: str) -> Iterator[InProcessMesh]:
    """One instant mock worker with a long context, and a frontend with short HTTP
    timeouts (the tests that need the defaults use the module's shared `mesh`)."""
    mesh = InProcessMesh(nats_url, unique_namespace("edge"))
    try:
        worker = mesh.add_worker(wait=False, extra_args=("--mock-max-model-len", str(CONTEXT)))
        mesh.add_frontend(
            "--http-idle-timeout", str(IDLE_TIMEOUT_S), "--http-body-timeout", str(BODY_TIMEOUT_S)
        )
        mesh.wait_for_workers(lambda ids: worker.name in ids, what="the worker")
        yield mesh
    finally:
        mesh.stop()


def body_of(path: str, prompt: list[int], max_tokens: int = 1, **extra: Any) -> dict[str, Any]:
    if path == SGLANG:
        return {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_tokens}, **extra}
    return {"token_ids": prompt, "sampling_params": {"max_tokens": max_tokens}, **extra}


def error_of(path: str, message: str, status: int = 400) -> dict[str, Any]:
    """The format's error body (SGLang's ValueError shape; vLLM's envelope)."""
    if path == SGLANG:
        return {"error": {"message": message}}
    type_ = {400: "BadRequestError", 405: "MethodNotAllowedError", 408: "RequestTimeoutError"}
    return {"error": {"message": message, "type": type_[status], "param": None, "code": status}}


# ---------------------------------------------------------------- item 3: too large for NATS


@pytest.mark.parametrize("path", [SGLANG, VLLM])
async def test_an_envelope_past_the_max_payload_is_refused_at_once(
    edge: InProcessMesh, path: str
) -> None:
    nc = await nats.connect(edge.nats_url)
    max_payload = nc.max_payload
    await nc.close()
    # Packed, a token is 4 bytes of the envelope: a quarter of the limit, and some.
    body = body_of(path, [1 + i % 900 for i in range(max_payload // 4 + 1000)])
    async with worker_requests(edge.nats_url, edge.namespace) as seen:
        reply = await post(edge.http_url + path, body, headers={"Content-Type": "application/json"})
    assert reply.status == 400
    assert "Retry-After" not in reply.headers
    message = reply.body["error"]["message"]
    assert message.startswith("the request is too large: a message of ")
    assert message.endswith(f" bytes exceeds the server's max_payload of {max_payload}")
    assert reply.body == error_of(path, message)
    assert seen == []  # never published, so never re-published either


# ---------------------------------------------------------------- item 4: client IDs


@pytest.mark.parametrize("client_id", ["a\r\nX-Evil: 1", "a\x00b", "é 100%"])
@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("path", [SGLANG, VLLM])
async def test_a_client_id_is_echoed_percent_encoded_in_the_header(
    edge: InProcessMesh, path: str, streaming: bool, client_id: str
) -> None:
    field = "rid" if path == SGLANG else "request_id"
    body = body_of(path, [1, 2], **{field: client_id})
    headers = {"Content-Type": "application/json"}
    if streaming:
        reply: Any = await stream(edge.http_url + path, body, headers=headers)
        first = reply.events[0]
    else:
        reply = await post(edge.http_url + path, body, headers=headers)
        first = reply.body
    assert reply.status == 200
    assert reply.headers["x-request-id"] == quote(
        client_id, safe="!\"#$&'()*+,/:;<=>?@[\\]^_`{|}~-."
    )
    assert "X-Evil" not in reply.headers
    # The body echoes the ID as it came.
    if path == SGLANG:
        assert first["meta_info"]["id"] == client_id
    else:
        assert first["request_id"] == "generate-tokens-" + client_id


@pytest.mark.parametrize("path", [SGLANG, VLLM])
async def test_a_client_id_past_the_bound_is_refused_before_it_runs(
    edge: InProcessMesh, path: str
) -> None:
    field = "rid" if path == SGLANG else "request_id"
    body = body_of(path, [1, 2], **{field: "r" * 100_000})
    async with worker_requests(edge.nats_url, edge.namespace) as seen:
        reply = await post(edge.http_url + path, body, headers={"Content-Type": "application/json"})
    message = "the request ID is not accepted: at most 1024 bytes, got 100000 characters"
    assert (reply.status, reply.body) == (400, error_of(path, message))
    assert "x-request-id" not in reply.headers
    assert seen == []
    # 1,024 bytes is still an ID.
    body = body_of(path, [1, 2], **{field: "é" * 512})
    reply = await post(edge.http_url + path, body, headers={"Content-Type": "application/json"})
    assert reply.status == 200


# ---------------------------------------------------------------- item 5: no more 500s


async def test_a_lone_surrogate_field_name_is_a_400(edge: InProcessMesh) -> None:
    raw = b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1, "\\ud800": 1}}'
    reply = await post(edge.http_url + SGLANG, raw)
    assert reply.status == 400
    assert reply.body == error_of(SGLANG, "Unexpected keyword argument '\ud800'")


async def test_a_5000_digit_data_parallel_rank_is_ignored_as_vllm_ignores_it(
    edge: InProcessMesh,
) -> None:
    # vLLM's _get_data_parallel_rank: int() fails past 4,300 digits, and a failed int() is
    # no rank (vllm/entrypoints/openai/engine/serving.py).
    async with worker_requests(edge.nats_url, edge.namespace) as seen:
        reply = await post(
            edge.http_url + VLLM,
            body_of(VLLM, [1, 2]),
            headers={"Content-Type": "application/json", "X-data-parallel-rank": "9" * 5000},
        )
    assert reply.status == 200
    assert len(seen) == 1


@pytest.mark.parametrize("path", [SGLANG, VLLM])
async def test_a_5000_digit_logit_bias_key_is_a_400(edge: InProcessMesh, path: str) -> None:
    body = body_of(path, [1, 2])
    body["sampling_params"]["logit_bias"] = {"9" * 5000: 1.0}
    reply = await post(edge.http_url + path, body, headers={"Content-Type": "application/json"})
    assert reply.status == 400
    message = reply.body["error"]["message"]
    if path == SGLANG:
        assert message == (
            "Exceeds the limit (4300 digits) for integer string conversion: value has 5000 "
            "digits; use sys.set_int_max_str_digits() to increase the limit"
        )
    else:
        assert "int_parsing_size" in message
        assert reply.body["error"]["type"] == "Bad Request"  # vLLM's validation errors


# ---------------------------------------------------------------- item 6: logs and 405s


async def test_a_disconnect_mid_stream_is_one_info_line(
    edge: InProcessMesh, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that resets its connection while tokens stream: whether the frontend
    notices it in a write or by the connection's end, nothing is logged as an error."""
    parts = urlsplit(edge.http_url)
    caplog.set_level(logging.INFO)
    lost_in_a_write = 0
    for attempt in range(40):
        path = (SGLANG, VLLM)[attempt % 2]
        data = json.dumps(body_of(path, [1, 2], 20_000, stream=True)).encode()
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        await reader.readuntil(b"\n\n")
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST
        writer.close()
        await asyncio.sleep(0.1)
        lost_in_a_write = sum("client connection lost" in r.getMessage() for r in caplog.records)
        if lost_in_a_write >= 2:
            break
    assert lost_in_a_write >= 2, "no disconnect was noticed in a write: the test proves nothing"
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == []
    lost = [r for r in caplog.records if "client connection lost" in r.getMessage()]
    assert all(r.levelno == logging.INFO and r.exc_info is None for r in lost)


@pytest.mark.parametrize(
    ("method", "path", "allow", "expected"),
    [
        ("GET", SGLANG, "POST,PUT", error_of(SGLANG, "Method Not Allowed", 405)),
        ("GET", VLLM, "POST", error_of(VLLM, "Method Not Allowed", 405)),
        # A route of no format answers in the shape of the format serving /generate.
        ("POST", "/health", "GET,HEAD", error_of(SGLANG, "Method Not Allowed", 405)),
    ],
)
async def test_a_405_is_json(
    edge: InProcessMesh, method: str, path: str, allow: str, expected: dict[str, Any]
) -> None:
    reply = await post(edge.http_url + path, b"", method=method)
    assert reply.status == 405
    assert reply.headers["Content-Type"] == "application/json; charset=utf-8"
    assert reply.headers["Allow"] == allow
    assert reply.body == expected


# ---------------------------------------------------------------- item 7: timeouts, bound


@pytest.mark.parametrize(
    "sent",
    [b"", b"POST /generate HTTP/1.1\r\nHost: x\r\n"],  # silent; headers never finished
)
async def test_a_connection_without_a_whole_request_is_closed(
    edge: InProcessMesh, sent: bytes
) -> None:
    # aiohttp checks its keep-alive timer at its own granularity: well within 5 s of 0.5 s.
    answer = await raw_exchange(edge.http_url, sent, timeout=5)
    assert answer == b""  # closed, without an answer


@pytest.mark.parametrize("path", [SGLANG, VLLM])
async def test_a_body_that_does_not_arrive_in_time_is_a_408(edge: InProcessMesh, path: str) -> None:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Content-Length: 1000\r\n\r\n"
    )
    parts = urlsplit(edge.http_url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        writer.write(head.encode() + b'{"input_ids": [')
        # The answer comes before aiohttp's lingering close (it reads what is left of the
        # body for up to 10 s, then closes).
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        length = int(answer.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        body = await asyncio.wait_for(reader.readexactly(length), 5)
    finally:
        writer.close()
    assert answer.split(b"\r\n")[0] == b"HTTP/1.1 408 Request Timeout"
    assert b"Connection: close" in answer
    message = f"request body did not arrive within {BODY_TIMEOUT_S:g} seconds"
    assert json.loads(body) == error_of(path, message, 408)


async def test_connections_past_the_bound_are_answered_503(edge: InProcessMesh) -> None:
    port = edge.http_port
    bounded = edge.add_frontend("--max-connections", "2", name="bounded")
    edge.http_port = port  # the module's other tests keep the first frontend
    url = f"http://127.0.0.1:{bounded.value.port}"
    parts = urlsplit(url)
    held = [await asyncio.open_connection(parts.hostname, parts.port) for _ in range(2)]
    try:
        answer = await raw_exchange(url, b"")
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.split(b"\r\n")[0] == b"HTTP/1.1 503 Service Unavailable"
        assert b"Retry-After: 1" in head
        message = "too many connections: this frontend keeps at most 2"
        # SGLang's shape for its 5xx answers (HTTPExceptions): the legacy one.
        expected = {"object": "error", "message": message, "type": "503", "param": None}
        assert json.loads(body) == {**expected, "code": 503}
    finally:
        for _, writer in held:
            writer.close()
    await asyncio.sleep(0.2)  # the server sees them closed
    reply = await post(url + SGLANG, body_of(SGLANG, [1, 2]))
    assert reply.status == 200

"""A request the HTTP server cannot parse is answered 400 and logged as one INFO line, not
an ERROR traceback: sglang-router sends an HTTP/2 preface (its gRPC probe) each time it
registers a worker, and port scanners send worse."""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlsplit

import pytest

from tests.http_util import post
from tests.inproc import InProcessMesh

pytestmark = pytest.mark.inproc

HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


async def _raw(url: str, data: bytes) -> bytes:
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


# (bytes sent, whether aiohttp logs it at all: a TLS hello it drops without a word)
@pytest.mark.parametrize(
    ("data", "logged"), [(HTTP2_PREFACE, True), (b"\x16\x03\x01\x00\xa5hello\r\n\r\n", False)]
)
async def test_malformed_http_is_a_400_and_no_error_log(
    mesh: InProcessMesh, caplog: pytest.LogCaptureFixture, data: bytes, logged: bool
) -> None:
    with caplog.at_level(logging.INFO, logger="aiohttp.server"):
        answer = await _raw(mesh.http_url, data)
        await asyncio.sleep(0.05)  # the log record follows the answer
    assert answer.startswith(b"HTTP/1.")
    assert b" 400 " in answer.split(b"\r\n")[0]
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert all(r.levelno == logging.INFO for r in records)
    assert all(r.exc_info is None for r in records)
    assert any("malformed HTTP" in r.getMessage() for r in records) == logged
    # and the frontend goes on serving
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
    reply = await post(mesh.http_url + "/generate", body)
    assert reply.status == 200

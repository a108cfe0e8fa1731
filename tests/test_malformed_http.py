"""A request the HTTP server cannot parse is answered 400 and logged as one INFO line, not
an ERROR traceback: sglang-router sends an HTTP/2 preface (its gRPC probe) each time it
registers a worker, and port scanners send worse."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tests.http_util import post, raw_exchange
from tests.inproc import InProcessMesh

pytestmark = pytest.mark.inproc

HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# A header far past aiohttp's 8,190 bytes: refused while most of it is still on its way, so
# the server's close resets the connection under the client's send (RFC 9112 §9.6); the
# 400 must still be there to read.
HUGE_HEADER = b"POST /generate HTTP/1.1\r\nHost: x\r\nX-Big: " + b"x" * 4_000_000 + b"\r\n\r\n"


# (bytes sent, whether aiohttp logs it at all: a TLS hello it drops without a word)
@pytest.mark.parametrize(
    ("data", "logged"),
    [
        (HTTP2_PREFACE, True),
        (b"\x16\x03\x01\x00\xa5hello\r\n\r\n", False),
        (HUGE_HEADER, True),
    ],
    ids=["http2-preface", "tls-hello", "huge-header"],
)
async def test_malformed_http_is_a_400_and_no_error_log(
    mesh: InProcessMesh, caplog: pytest.LogCaptureFixture, data: bytes, logged: bool
) -> None:
    with caplog.at_level(logging.INFO, logger="aiohttp.server"):
        answer = await raw_exchange(mesh.http_url, data)
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

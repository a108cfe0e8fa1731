"""Small HTTP helpers for end-to-end tests (real sockets, real processes)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from multidict import CIMultiDict


@dataclass
class Reply:
    status: int
    headers: CIMultiDict[str]
    body: Any


@dataclass
class SseReply:
    status: int
    headers: CIMultiDict[str]
    events: list[Any]  # decoded `data:` payloads, "[DONE]" kept as the string
    raw: str


async def post(
    url: str, body: Any, *, headers: dict[str, str] | None = None, method: str = "POST"
) -> Reply:
    data = body if isinstance(body, bytes | str) else json.dumps(body)
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, url, data=data, headers=headers) as resp,
    ):
        text = await resp.text()
        try:
            parsed: Any = json.loads(text)
        except ValueError:
            parsed = text
        return Reply(resp.status, CIMultiDict(resp.headers), parsed)


async def raw_exchange(
    url: str, data: bytes, *, timeout: float = 10.0, limit: int | None = None
) -> bytes:
    """Send `data` on a fresh connection; what the server sends until it closes (or the
    first `limit` bytes). Raises TimeoutError past `timeout`, and the connection's error if
    it broke before a byte came back.

    A server that refuses a request before reading all of it (a header past the parser's
    limit) closes with bytes unread, so its kernel resets the connection (the TCP reset
    problem, RFC 9112 §9.6): our send may then fail while the answer already sits in our
    receive queue. asyncio's streams drop the connection on the send's error, unread answer
    and all; a plain socket sends beside the reads and reads on, so the answer is read."""
    parts = urlsplit(url)
    loop = asyncio.get_running_loop()
    with socket.socket() as sock:
        sock.setblocking(False)
        await loop.sock_connect(sock, (parts.hostname, parts.port))
        sender = asyncio.create_task(loop.sock_sendall(sock, data))
        received = bytearray()
        try:
            async with asyncio.timeout(timeout):
                while limit is None or len(received) < limit:
                    want = 65536 if limit is None else limit - len(received)
                    chunk = await loop.sock_recv(sock, want)
                    if not chunk:
                        break
                    received += chunk
        except OSError:
            if not received:
                raise
        finally:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await sender
        return bytes(received)


def parse_sse(raw: str) -> list[Any]:
    events: list[Any] = []
    for block in raw.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: "):
                payload = line[len("data: ") :]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def stream(
    url: str, body: dict[str, Any], *, headers: dict[str, str] | None = None
) -> SseReply:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, json={**body, "stream": True}, headers=headers) as resp,
    ):
        raw = await resp.text()
        events = parse_sse(raw) if resp.content_type == "text/event-stream" else [json.loads(raw)]
        return SseReply(resp.status, CIMultiDict(resp.headers), events, raw)

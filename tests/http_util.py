"""Small HTTP helpers for end-to-end tests (real sockets, real processes)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

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

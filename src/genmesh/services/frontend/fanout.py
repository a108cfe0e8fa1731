"""Admin orders to every worker of the namespace, over NATS: aborts by client ID, and
cache flushes gathered with a timeout (`docs/protocol.md` §8.1, §8.2)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client

from genmesh.codecs import CodecError, UnknownCodecError, get_codec
from genmesh.shared.abort import AbortOrder
from genmesh.shared.bus import message_codec, publish


@dataclass(slots=True)
class FlushReport:
    """What the workers answered to a flush."""

    expected: list[str]
    flushed: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)

    @property
    def missing(self) -> list[str]:
        answered = set(self.flushed) | set(self.failed)
        return [w for w in self.expected if w not in answered]

    @property
    def ok(self) -> bool:
        return bool(self.expected) and not self.failed and not self.missing


async def gather(
    nc: Client, subject: str, payload: dict[str, Any], expected: set[str], timeout_s: float
) -> list[dict[str, Any]]:
    """Publish `payload` with a reply subject and collect the answers (maps with a string
    `worker`) until every worker in `expected` has answered or `timeout_s` has passed."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    answers: list[dict[str, Any]] = []
    waiting = set(expected)
    try:
        await publish(nc, subject, get_codec(None), payload, reply=inbox)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while waiting:
                    msg = await sub.next_msg(timeout=None)
                    try:
                        answer = message_codec(msg).decode(msg.data)
                    except (UnknownCodecError, CodecError):
                        continue
                    if isinstance(answer, dict) and isinstance(answer.get("worker"), str):
                        answers.append(answer)
                        waiting.discard(answer["worker"])
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    return answers


async def broadcast_abort(
    nc: Client, subject: str, order: AbortOrder, expected: set[str], timeout_s: float
) -> list[str] | None:
    """Publish an abort order. With `expected` workers to hear from, wait for their
    answers and return the client IDs they aborted; without, fire and forget (None)."""
    if not expected:
        await publish(nc, subject, get_codec(None), order.to_wire())
        return None
    answers = await gather(nc, subject, order.to_wire(), expected, timeout_s)
    aborted: list[str] = []
    for answer in answers:
        ids = answer.get("aborted")
        if isinstance(ids, list):
            aborted += [i for i in ids if isinstance(i, str)]
    return aborted


async def flush_all(nc: Client, subject: str, expected: set[str], timeout_s: float) -> FlushReport:
    report = FlushReport(sorted(expected))
    for answer in await gather(nc, subject, {"v": 1}, expected, timeout_s):
        worker = answer["worker"]
        if answer.get("ok") is True:
            report.flushed.append(worker)
        else:
            report.failed[worker] = str(answer.get("message") or "failed")
    return report

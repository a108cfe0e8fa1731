"""Asking a mesh's `$SRV` (NATS micro) services as the NATS CLI does: one request, every
reply gathered until a short quiet interval, each checked against the CLI's JSON schema
of its type (tests/micro_schemas/, from nats-io/jsm.go)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import jsonschema
from nats.aio.client import Client
from nats.aio.msg import Msg

from genmesh.shared.bus import is_no_responders

SCHEMAS = Path(__file__).parent / "micro_schemas"
# The quiet interval that ends a gathering: the NATS CLI waits about as long for more
# services after the last answer.
QUIET_S = 0.3
# How long to wait for the first answer.
FIRST_S = 3.0


def schema(kind: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((SCHEMAS / f"{kind}_response.json").read_text())
    return loaded


async def gather(nc: Client, subject: str, *, kind: str, namespace: str) -> list[dict[str, Any]]:
    """Every answer to one request on `subject` until none came for QUIET_S, each valid
    under the CLI's schema for `kind` (`ping`, `info`, `stats`); those of `namespace`'s
    mesh (a test server hosts other tests' meshes too, which answer `$SRV.PING` as well)."""
    replies: asyncio.Queue[Msg] = asyncio.Queue()

    async def on_reply(msg: Msg) -> None:
        replies.put_nowait(msg)

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=on_reply)
    answers = []
    try:
        await nc.publish(subject, b"", reply=inbox)
        while True:
            try:
                msg = await asyncio.wait_for(replies.get(), QUIET_S if answers else FIRST_S)
            except TimeoutError:
                break
            if is_no_responders(msg):  # the server's: nobody answers that subject
                continue
            answer = json.loads(msg.data)
            jsonschema.validate(answer, schema(kind), format_checker=jsonschema.FormatChecker())
            answers.append(answer)
    finally:
        await sub.unsubscribe()
    return [a for a in answers if (a.get("metadata") or {}).get("namespace") == namespace]


def by_role(answers: list[dict[str, Any]], role: str) -> list[dict[str, Any]]:
    return [a for a in answers if a["metadata"]["role"] == role]


def endpoint(answer: dict[str, Any], name: str) -> dict[str, Any]:
    """The endpoint `name` of one service's INFO or STATS answer."""
    (found,) = [e for e in answer["endpoints"] if e["name"] == name]
    return found

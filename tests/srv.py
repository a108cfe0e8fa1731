"""Asking a mesh's `$SRV` (NATS micro) services as the NATS CLI does: one request, every
reply gathered until a short quiet interval, each checked against the CLI's JSON schema
of its type (tests/micro_schemas/, from nats-io/jsm.go)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
from nats.aio.client import Client

from genmesh.status.srv import gather as gather_payloads

SCHEMAS = Path(__file__).parent / "micro_schemas"
# How long a gathering may take (the first answer is awaited up to that).
FIRST_S = 3.0


def schema(kind: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((SCHEMAS / f"{kind}_response.json").read_text())
    return loaded


async def gather(nc: Client, subject: str, *, kind: str, namespace: str) -> list[dict[str, Any]]:
    """Every answer to one request on `subject`, gathered as the CLI gathers them
    (`genmesh status` does the same: `status.srv.gather`), each valid under the CLI's
    schema for `kind` (`ping`, `info`, `stats`); those of `namespace`'s mesh (a test
    server hosts other tests' meshes too, which answer `$SRV.PING` as well)."""
    answers = [json.loads(data) for data in await gather_payloads(nc, subject, FIRST_S)]
    for answer in answers:
        jsonschema.validate(answer, schema(kind), format_checker=jsonschema.FormatChecker())
    return [a for a in answers if (a.get("metadata") or {}).get("namespace") == namespace]


def by_role(answers: list[dict[str, Any]], role: str) -> list[dict[str, Any]]:
    return [a for a in answers if a["metadata"]["role"] == role]


def endpoint(answer: dict[str, Any], name: str) -> dict[str, Any]:
    """The endpoint `name` of one service's INFO or STATS answer."""
    (found,) = [e for e in answer["endpoints"] if e["name"] == name]
    return found

"""The client side of `$SRV`, the NATS micro protocol (ADR-32, "Service API") that every
genmesh process answers (docs/protocol.md): ask every `genmesh` service for its info and
its stats, and read the answers as `nats micro info|stats genmesh` reads them.

Replies are gathered as the NATS CLI gathers them (natscli's `doReqAsync`, nats-io/natscli
`internal/util/util.go`): one request with a reply inbox; the first answer is awaited up to
the timeout, and after each answer the next one up to 300 ms (the timeout still bounding
the whole); a no-responders status (503) means that nothing answers. The answers are parsed
with nats-py's own `nats.micro` types, so a reply `nats micro` would refuse is refused here
too (and counted, not shown).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.micro.service import (
    INFO_RESPONSE_TYPE,
    STATS_RESPONSE_TYPE,
    EndpointStats,
    ServiceInfo,
)

from genmesh.shared.bus import is_no_responders, unsubscribe_quietly
from genmesh.shared.micro import SERVICE_NAME

# natscli's quiet interval: no further answer within it ends the gathering.
QUIET_S = 0.3
# An endpoint's stats fields a responder may leave out (ADR-32 marks them optional).
_OPTIONAL: dict[str, Any] = {"queue_group": "", "last_error": "", "data": None}


@dataclass(slots=True)
class SrvService:
    """One genmesh process as `$SRV` describes it: its INFO and STATS answers, by id."""

    id: str
    version: str = ""
    description: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    # By endpoint name: the STATS counters (num_requests, num_errors, data, ...).
    endpoints: dict[str, EndpointStats] = field(default_factory=dict)

    @property
    def namespace(self) -> str | None:
        return self.metadata.get("namespace")

    @property
    def role(self) -> str | None:
        return self.metadata.get("role")

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "version": self.version,
            "description": self.description,
            "metadata": self.metadata,
            "endpoints": {name: stats.to_dict() for name, stats in self.endpoints.items()},
        }


@dataclass(slots=True)
class SrvSurvey:
    """Every `genmesh` service that answered, and how many answers could not be read."""

    services: dict[str, SrvService] = field(default_factory=dict)
    unreadable: int = 0


async def gather(nc: Client, subject: str, timeout_s: float) -> list[bytes]:
    """The payloads of every answer to one request on `subject` (see the module's doc)."""
    loop = asyncio.get_running_loop()
    sub = await nc.subscribe(nc.new_inbox())
    answers: list[bytes] = []
    try:
        await nc.publish(subject, b"", reply=sub.subject)
        deadline = loop.time() + timeout_s
        wait = timeout_s
        while (left := deadline - loop.time()) > 0:
            try:
                msg: Msg = await sub.next_msg(timeout=min(wait, left))
            except NatsTimeout:
                break
            if is_no_responders(msg):
                break
            answers.append(msg.data)
            wait = QUIET_S
    finally:
        await unsubscribe_quietly(sub)
    return answers


async def survey(nc: Client, timeout_s: float) -> SrvSurvey:
    """Ask `$SRV.INFO.genmesh` and `$SRV.STATS.genmesh` at once; merge the answers by id."""
    infos, stats = await asyncio.gather(
        gather(nc, f"$SRV.INFO.{SERVICE_NAME}", timeout_s),
        gather(nc, f"$SRV.STATS.{SERVICE_NAME}", timeout_s),
    )
    result = SrvSurvey()
    for data in infos:
        if not _read_info(result, data):
            result.unreadable += 1
    for data in stats:
        if not _read_stats(result, data):
            result.unreadable += 1
    return result


def _answer(data: bytes, kind: str) -> dict[str, Any] | None:
    """A reply's JSON object if it is a `kind` answer of a genmesh service."""
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("type") != kind or obj.get("name") != SERVICE_NAME:
        return None
    if not isinstance(obj.get("id"), str) or not _string_map(obj.get("metadata")):
        return None
    return obj


def _string_map(value: object) -> bool:
    """ADR-32 metadata: a map of strings to strings."""
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )


def _read_info(result: SrvSurvey, data: bytes) -> bool:
    obj = _answer(data, INFO_RESPONSE_TYPE)
    if obj is None:
        return False
    try:
        info = ServiceInfo.from_dict(obj)
    except (KeyError, TypeError):
        return False
    service = result.services.setdefault(info.id, SrvService(info.id))
    service.version = info.version
    service.description = info.description or ""
    service.metadata = info.metadata
    return True


def _read_stats(result: SrvSurvey, data: bytes) -> bool:
    obj = _answer(data, STATS_RESPONSE_TYPE)
    if obj is None or not isinstance(obj.get("endpoints"), list):
        return False
    try:
        # Not `ServiceStats.from_dict`: it reads `started` with one exact format, which a
        # Go service's nanoseconds break; nothing here needs `started`.
        # Go's micro leaves out an empty `data`, `last_error` or `queue_group`.
        endpoints = [EndpointStats.from_dict(_OPTIONAL | e) for e in obj["endpoints"]]
    except (KeyError, TypeError):
        return False
    service = result.services.setdefault(obj["id"], SrvService(obj["id"]))
    service.version = service.version or str(obj.get("version", ""))
    service.metadata = service.metadata or obj["metadata"]
    service.endpoints = {e.name: e for e in endpoints}
    return True

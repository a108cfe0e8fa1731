"""What the HTTP engine adapters (SGLang, vLLM) share: the session, SSE reading, errors."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from genmesh.engines.base import KvUsage
from genmesh.engines.zmq_events import ZmqEventsConfig, ZmqKvEvents
from genmesh.shared.errors import ErrorCode, MeshError
from genmesh.shared.kv_events import KvEventBatch

log = logging.getLogger(__name__)

INCOMPLETE = "stream_incomplete"
# An engine's answer that cannot be read: the engine still runs the request (abort it).
MALFORMED = "malformed_response"


@dataclass(frozen=True, slots=True)
class HttpEngineConfig:
    url: str
    # Seconds to establish a connection; beyond it the engine counts as unreachable.
    connect_timeout_s: float = 5.0
    # Seconds of silence on an open stream (long prefills included) before giving up.
    read_timeout_s: float = 600.0
    # Seconds an abort call may take; aborts are best effort.
    abort_timeout_s: float = 2.0
    health_timeout_s: float = 2.0
    # Where the server publishes its KV events (none unless its endpoint is given).
    kv_events: ZmqEventsConfig = field(default_factory=ZmqEventsConfig)

    @property
    def base(self) -> str:
        return self.url.rstrip("/")


class HttpEngineBase:
    """The HTTP session every HTTP engine adapter owns: made inside the running loop on
    first use, closed (and made again if needed) by close(); and the subscription to the
    server's KV events when it publishes them."""

    def __init__(self, config: HttpEngineConfig) -> None:
        self.config = config
        self._session: aiohttp.ClientSession | None = None
        self._kv_events = ZmqKvEvents(config.kv_events) if config.kv_events.endpoint else None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = new_session(self.config)
        return self._session

    async def start(self) -> None:
        self.session  # noqa: B018 - created here, inside the running loop

    async def close(self) -> None:
        if self._kv_events is not None:
            self._kv_events.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def kv_events(self) -> AsyncIterator[KvEventBatch] | None:
        return self._kv_events.batches() if self._kv_events is not None else None

    def kv_usage(self) -> KvUsage | None:
        # The servers say it only over HTTP (SGLang's /get_load, vLLM's /metrics): a round
        # trip per load announcement is not cheap, so their workers' cards leave it out.
        return None

    async def post_admin(self, path: str, payload: Any = None) -> tuple[int, str]:
        """POST one of the server's admin routes (abort, flush): its status and body text,
        within `abort_timeout_s`. Raises `unavailable` when the server cannot be reached."""
        timeout = aiohttp.ClientTimeout(total=self.config.abort_timeout_s)
        try:
            async with self.session.post(
                f"{self.config.base}{path}", json=payload, timeout=timeout
            ) as r:
                return r.status, await r.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise unavailable(f"{path} on {self.config.url} failed: {exc}") from None


def new_session(config: HttpEngineConfig) -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(
        total=None, connect=config.connect_timeout_s, sock_read=config.read_timeout_s
    )
    # No pool limit: every in-flight request holds one streaming connection.
    return aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))


def unavailable(message: str, **detail: Any) -> MeshError:
    """A failure of the engine or the way to it: another worker may well succeed."""
    return MeshError(ErrorCode.UNAVAILABLE, message, detail=detail or None)


def incomplete(message: str) -> MeshError:
    return unavailable(message, reason=INCOMPLETE)


def malformed(message: str) -> MeshError:
    return unavailable(message, reason=MALFORMED)


def is_malformed(error: MeshError) -> bool:
    return error.detail.get("reason") == MALFORMED


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[Any]:
    """Decoded `data:` payloads of an SSE response, `"[DONE]"` kept as the string."""
    data: list[bytes] = []
    async for raw in response.content:
        line = raw.rstrip(b"\r\n")
        if line.startswith(b"data:"):
            data.append(line[5:].lstrip(b" "))
        elif not line and data:
            yield _sse_payload(data)
            data = []
    if data:  # a last event without its blank line
        yield _sse_payload(data)


def _sse_payload(data: list[bytes]) -> Any:
    payload = b"\n".join(data)
    if payload == b"[DONE]":
        return "[DONE]"
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise malformed(f"engine sent an event that is not JSON: {exc}") from None


def error_message(body: bytes) -> tuple[str, str | None]:
    """The message (and type) of an engine's error body, whatever its shape."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode(errors="replace").strip()[:500] or "no message", None
    if isinstance(obj, dict):
        inner = obj.get("error")
        if isinstance(inner, dict):
            return str(inner.get("message", "")), _str_or_none(inner.get("type"))
        if isinstance(inner, str):
            return inner, None
        if "message" in obj:
            return str(obj["message"]), _str_or_none(obj.get("type"))
        if "detail" in obj:
            return str(obj["detail"]), None
    return str(obj)[:500], None


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


async def http_error(response: aiohttp.ClientResponse, engine: str) -> MeshError:
    """An engine's non-2xx answer: 4xx = the request is wrong, anything else = try elsewhere."""
    message, err_type = error_message(await response.read())
    status = response.status
    if 400 <= status < 500 and status not in (401, 403, 408, 429):
        return MeshError(
            ErrorCode.INVALID_ARGUMENT,
            message,
            detail={"status_code": status, "err_type": err_type},
        )
    return unavailable(f"{engine} answered HTTP {status}: {message}", status_code=status)

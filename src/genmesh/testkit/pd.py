"""Prefill/decode disaggregation between two mock servers: the KV handles a prefill server
holds until its decode server takes them (reference `engine-apis.md` §C).

A real prefill engine keeps a request's KV blocks until the decode engine has pulled them
(SGLang: over the bootstrap server and RDMA, keyed by `bootstrap_room`; vLLM's NIXL
connector: by request id, the blocks freed after `VLLM_NIXL_ABORT_REQUEST_TIMEOUT` if
nobody reads them). The mocks stand the transfer in with one HTTP call on the prefill
server's own port: `GET /testkit/pd/kv/{key}?wait_s=S` waits up to S seconds for the
handle to be offered, then answers it once (200 `{"payload"}`) and forgets it; 404
`{"error"}` if it never came or has expired, 410 `{"error"}` if its prefill failed or its
payload differs from the other query parameters (the handle then stays).
`GET /testkit/pd` answers `{"mode", "handles": [keys]}`: what a test checks for leaks.
"""

from __future__ import annotations

import asyncio
import time
from asyncio import FIRST_COMPLETED
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

# What a decode paired with an aborted prefill is told (SGLang's KVTransferError text).
ABORTED = "Aborted by AbortReq."


class TransferFailed(Exception):
    """The decode side could not take the handle: the reason, as the prefill side said,
    and the status the prefill's route answers it with (404: no such handle)."""

    def __init__(self, reason: str, status: int = 410) -> None:
        super().__init__(reason)
        self.status = status


@dataclass(slots=True)
class _Handle:
    payload: dict[str, Any] | None = None
    failure: str | None = None
    expires: float = 0.0  # monotonic; set when offered
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    taken: asyncio.Event = field(default_factory=asyncio.Event)


class Handles:
    """The prefill side's KV handles by key (a bootstrap room, a NIXL request id)."""

    def __init__(self, mode: str, ttl_s: float) -> None:
        self.mode = mode
        self.ttl_s = ttl_s
        self._handles: dict[str, _Handle] = {}

    def _slot(self, key: str) -> _Handle:
        return self._handles.setdefault(key, _Handle())

    def offer(self, key: str, payload: dict[str, Any]) -> None:
        """The prefill is done: its KV waits for the decode side, at most `ttl_s`."""
        handle = self._slot(key)
        handle.payload = payload
        handle.expires = time.monotonic() + self.ttl_s
        handle.ready.set()

    def fail(self, key: str, reason: str) -> None:
        """The prefill failed: a decode waiting for (or asking after) `key` learns why."""
        handle = self._slot(key)
        handle.failure = reason
        handle.expires = time.monotonic() + self.ttl_s
        handle.ready.set()

    async def wait_taken(self, key: str, timeout: float, aborted: asyncio.Event) -> str | None:
        """Until the decode side took `key` (None), or the reason the transfer failed:
        `timeout` passed (the handle is freed) or the prefill was aborted (a decode that
        still comes learns so, until `ttl_s`)."""
        handle = self._slot(key)
        taken = asyncio.ensure_future(handle.taken.wait())
        abort = asyncio.ensure_future(aborted.wait())
        try:
            await asyncio.wait({taken, abort}, timeout=timeout, return_when=FIRST_COMPLETED)
        except asyncio.CancelledError:  # the prefill's client went away: SGLang aborts it
            self.fail(key, ABORTED)
            raise
        finally:
            taken.cancel()
            abort.cancel()
        if handle.taken.is_set():
            return None
        if aborted.is_set():
            self.fail(key, ABORTED)
            return ABORTED
        self._forget(key, handle)
        return f"timed out after {timeout:g}s waiting for the decode instance to take the KV"

    async def take(
        self, key: str, wait_s: float, match: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """The handle for `key`, once, after waiting up to `wait_s` for it to be offered.
        A handle whose payload differs from `match` stays (vLLM's NIXL handshake refuses
        another engine before any read)."""
        self._expire()
        handle = self._slot(key)
        try:
            if not handle.ready.is_set():  # (wait_for with 0 s times out even when it is)
                await asyncio.wait_for(handle.ready.wait(), wait_s)
        except TimeoutError:
            raise TransferFailed(f"no KV handle for {key}", 404) from None
        finally:
            if not handle.ready.is_set():
                self._forget(key, handle)
        payload = handle.payload or {}
        if handle.failure is None and any(
            str(payload.get(k)) != v for k, v in (match or {}).items()
        ):
            raise TransferFailed(f"the KV handle for {key} belongs to another engine")
        self._forget(key, handle)
        handle.taken.set()
        if handle.failure is not None:
            raise TransferFailed(handle.failure)
        assert handle.payload is not None
        return handle.payload

    def _forget(self, key: str, handle: _Handle) -> None:
        if self._handles.get(key) is handle:
            del self._handles[key]

    def _expire(self) -> None:
        """Handles nobody took in time are freed (NIXL's abort timeout)."""
        now = time.monotonic()
        for key, handle in list(self._handles.items()):
            if handle.ready.is_set() and handle.expires <= now:
                del self._handles[key]

    def keys(self) -> list[str]:
        self._expire()
        return sorted(self._handles)


HANDLES = web.AppKey("testkit_pd_handles", Handles)


def add_pd_routes(app: web.Application, handles: Handles) -> None:
    app[HANDLES] = handles
    app.router.add_get("/testkit/pd", _pd_state)
    app.router.add_get("/testkit/pd/kv/{key}", _take)


async def _pd_state(request: web.Request) -> web.Response:
    handles = request.app[HANDLES]
    return web.json_response({"mode": handles.mode, "handles": handles.keys()})


async def _take(request: web.Request) -> web.Response:
    handles = request.app[HANDLES]
    if handles.mode != "prefill":
        return web.json_response({"error": "not a prefill server"}, status=404)
    try:
        wait_s = float(request.query.get("wait_s", "0"))
        match = {k: v for k, v in request.query.items() if k != "wait_s"}
        payload = await handles.take(request.match_info["key"], wait_s, match)
    except ValueError:
        return web.json_response({"error": "wait_s must be a number"}, status=400)
    except TransferFailed as exc:
        return web.json_response({"error": str(exc)}, status=exc.status)
    return web.json_response({"payload": payload})


async def fetch(
    host: str, port: int, key: str, wait_s: float, match: dict[str, str] | None = None
) -> dict[str, Any]:
    """The decode side: take `key`'s handle from the prefill server at host:port, waiting
    up to `wait_s` for it (only if its payload has the fields `match` names); `TransferFailed`
    with the reason otherwise (also when the prefill server cannot be reached: a dead
    prefill instance)."""
    url = f"http://{host}:{port}/testkit/pd/kv/{key}"
    timeout = aiohttp.ClientTimeout(total=wait_s + 5)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(url, params={**(match or {}), "wait_s": str(wait_s)}) as resp,
        ):
            body = await resp.json()
            if resp.status != 200:
                raise TransferFailed(str(body.get("error")))
            payload: dict[str, Any] = body["payload"]
            return payload
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise TransferFailed(f"prefill server unreachable: {exc!r}") from exc

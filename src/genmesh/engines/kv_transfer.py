"""The mock's KV transfer between a prefill and a decode worker, over NATS
(docs/protocol.md §15, docs/disaggregation.md "The mock's P/D").

A real prefill engine keeps a finished prefill's KV blocks until its decode engine has
read them, and frees them if nobody does in time: vLLM's NIXL connector holds them
(`request_finished` delays their free) until the decode side's read notification or
`VLLM_NIXL_ABORT_REQUEST_TIMEOUT` (vllm/distributed/kv_transfer/kv_connector/v1/
nixl_connector.py); SGLang's prefill server keeps them per bootstrap room until its decode
server has pulled them. The mock stands that in with handles: `KvHandles` keeps each one
(what the decode needs, and a call that frees what it holds) until it is pulled once or its
time-to-live passes; a prefill worker answers pulls on `genmesh.<ns>.worker.<wid>.kv_pull`
(`serve_kv_pull`), a decode worker pulls there (`pull_kv`).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from genmesh.codecs import Codec, CodecError, UnknownCodecError, get_codec
from genmesh.shared.bus import (
    check_subscriptions,
    codec_headers,
    message_codec,
    unsubscribe_quietly,
)
from genmesh.shared.micro import MicroEndpoint
from genmesh.shared.tasks import keep_cancel

BAD_PULL = 'a KV pull request is {"handle": a string}'


class TransferFailed(Exception):
    """A pull that brought no KV: the reason, in words a decode engine's error can carry."""


@dataclass(slots=True)
class _Held:
    payload: dict[str, Any]
    free: Callable[[], None]
    expiry: asyncio.TimerHandle


class KvHandles:
    """The KV handles a prefill engine keeps for its decode workers, by handle id."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._held: dict[str, _Held] = {}

    def __len__(self) -> int:
        return len(self._held)

    def keep(self, payload: dict[str, Any], free: Callable[[], None]) -> str:
        """Keep `payload` until it is taken or `ttl_s` has passed; `free` is called once,
        either way (or on `close`). Returns the handle's id."""
        handle = secrets.token_hex(8)
        expiry = asyncio.get_running_loop().call_later(self.ttl_s, self._drop, handle)
        self._held[handle] = _Held(payload, free, expiry)
        return handle

    def take(self, handle: str) -> dict[str, Any]:
        """The handle's payload, once: the handle is freed."""
        held = self._held.get(handle)
        if held is None:
            raise TransferFailed(
                f"unknown KV handle {handle!r} (never made here, already pulled, "
                f"or expired after {self.ttl_s:g}s)"
            )
        self._drop(handle)
        return held.payload

    def close(self) -> None:
        """Free every handle (the engine is closing)."""
        for handle in list(self._held):
            self._drop(handle)

    def _drop(self, handle: str) -> None:
        held = self._held.pop(handle, None)
        if held is not None:
            held.expiry.cancel()
            held.free()


async def serve_kv_pull(
    nc: Client, subject: str, handles: KvHandles, micro: MicroEndpoint
) -> Subscription:
    """Answer pulls of `handles` on `subject` (the caller unsubscribes): a request
    `{"handle": id}` gets the handle's payload, or `{"error": why}`; in its own codec.
    `micro` counts them for `$SRV`, an `error` answer as an error.
    `NatsPermissionDenied` if the server refuses the subscription."""

    async def on_pull(msg: Msg) -> None:
        if not msg.reply:
            return
        codec: Codec
        try:
            codec = message_codec(msg)
        except UnknownCodecError:
            codec = get_codec("json")  # what any client can read
        answer: dict[str, Any]
        try:
            request = codec.decode(msg.data)
            handle = request.get("handle") if isinstance(request, dict) else None
            if not isinstance(handle, str):
                raise TransferFailed(BAD_PULL)
            answer = handles.take(handle)
        except CodecError:
            answer = {"error": BAD_PULL}
        except TransferFailed as exc:
            answer = {"error": str(exc)}
        if "error" in answer:
            micro.failed(answer["error"])
        await nc.publish(msg.reply, codec.encode(answer), headers=codec_headers(codec))

    sub = await nc.subscribe(subject, cb=micro.counted(on_pull))
    try:
        # Live at the server when this returns (a decode may pull at once), and refused
        # loudly on a secured server whose user may not serve pulls.
        await check_subscriptions(nc, sub)
    except BaseException:
        await unsubscribe_quietly(sub)
        raise
    return sub


async def pull_kv(nc: Client, subject: str, handle: str, timeout_s: float) -> dict[str, Any]:
    """Take handle `handle` from the prefill worker answering on `subject`; its payload, or
    `TransferFailed` with the reason."""
    codec = get_codec(None)
    try:
        reply = await keep_cancel(
            nc.request(
                subject,
                codec.encode({"handle": handle}),
                timeout=timeout_s,
                headers=codec_headers(codec),
            )
        )
    except NoRespondersError:
        raise TransferFailed("the prefill worker is gone (no responders)") from None
    except NatsTimeoutError:
        raise TransferFailed(f"no answer within {timeout_s:g}s") from None
    try:
        answer = message_codec(reply).decode(reply.data)
    except (UnknownCodecError, CodecError) as exc:
        raise TransferFailed(f"an unreadable answer: {exc}") from None
    if not isinstance(answer, dict):
        raise TransferFailed(f"an unreadable answer: {answer!r}")
    if "error" in answer:
        raise TransferFailed(str(answer["error"]))
    return answer

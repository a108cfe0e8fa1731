"""NATS plumbing shared by every service: connecting, headers, encoding messages."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from genmesh.codecs import Codec, get_codec

log = logging.getLogger(__name__)

CODEC_HEADER = "genmesh-codec"
STATUS_HEADER = "Status"
NO_RESPONDERS = "503"
CONNECT_TIMEOUT_S = 2.0
# Sent after a stream's terminal frame: an empty message with no headers, which is where
# `nats req --wait-for-empty` stops. genmesh clients stop at the terminal frame already.
STREAM_TERMINATOR = b""
# A worker's answer to a ping naming a request it does not run (any other answer: alive).
PING_NOT_RUNNING = b"not running"


# Run after a connection made by `connect` is back from an outage (its subscriptions are
# restored and what was buffered meanwhile is sent by then).
_reconnect_hooks: weakref.WeakKeyDictionary[Client, list[Callable[[], Awaitable[None]]]] = (
    weakref.WeakKeyDictionary()
)


def on_reconnect(nc: Client, hook: Callable[[], Awaitable[None]]) -> None:
    """Call `hook()` every time `nc` reconnects (only for connections made by `connect`)."""
    _reconnect_hooks.setdefault(nc, []).append(hook)


class NatsUnreachable(ConnectionError):
    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"cannot reach NATS at {url}: {reason}")
        self.url = url


def header(msg: Msg, name: str) -> str | None:
    """A header of `msg`, matched case-insensitively (other clients may capitalise keys)."""
    headers = msg.headers
    if not headers:
        return None
    value = headers.get(name)
    if value is not None:
        return value
    lowered = name.lower()
    for key, val in headers.items():
        if str(key).lower() == lowered:
            return val
    return None


def is_no_responders(msg: Msg) -> bool:
    """The server's reply to a request that reached no subscriber."""
    return not msg.data and header(msg, STATUS_HEADER) == NO_RESPONDERS


def codec_headers(codec: Codec) -> dict[str, str] | None:
    # The default codec needs no header: one less thing per message on the hot path.
    if codec.name == "msgpack":
        return None
    return {CODEC_HEADER: codec.name}


def message_codec(msg: Msg) -> Codec:
    """The codec named by `msg`'s header; raises UnknownCodecError."""
    return get_codec(header(msg, CODEC_HEADER))


async def connect(
    url: str,
    *,
    name: str,
    inbox_prefix: str = "_INBOX",
    reconnect_wait_s: float = 0.5,
) -> Client:
    """Connect, failing fast when NATS is unreachable; once up, reconnect forever.

    nats-py runs its reconnect loop on the first connect too (60 tries, 2 s apart, with
    the defaults), so the first connect gets two quick tries and reconnection without
    limit is switched on only once connected.
    """
    connected = False
    nc: Client
    first_errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        if connected:
            log.warning("NATS (%s): %s", name, exc)
        else:  # reported once, as NatsUnreachable, by the caller
            first_errors.append(exc)

    async def on_disconnected() -> None:
        if not (nc.is_closed or nc.is_draining):  # a deliberate close is no news
            log.warning("NATS (%s): disconnected from %s", name, url)

    async def on_reconnected() -> None:
        log.info("NATS (%s): reconnected", name)
        for hook in list(_reconnect_hooks.get(nc, ())):
            try:
                await hook()
            except Exception as exc:
                log.warning("NATS (%s): after reconnecting: %s", name, exc)

    try:
        nc = await nats.connect(
            url,
            name=name,
            inbox_prefix=inbox_prefix,
            connect_timeout=CONNECT_TIMEOUT_S,
            max_reconnect_attempts=1,
            reconnect_time_wait=0.1,
            error_cb=on_error,
            disconnected_cb=on_disconnected,
            reconnected_cb=on_reconnected,
        )
    except Exception as exc:
        cause = first_errors[-1] if first_errors else exc
        raise NatsUnreachable(url, str(cause) or type(cause).__name__) from exc
    connected = True
    nc.options["max_reconnect_attempts"] = -1
    nc.options["reconnect_time_wait"] = reconnect_wait_s
    return nc


async def unsubscribe_quietly(sub: Subscription | None) -> None:
    """Unsubscribe on shutdown, when the connection may already be gone."""
    if sub is None:
        return
    try:
        await sub.unsubscribe()
    except Exception as exc:
        log.debug("unsubscribe from %s failed: %s", sub.subject, exc)


async def publish(nc: Client, subject: str, codec: Codec, obj: Any, *, reply: str = "") -> None:
    await nc.publish(subject, codec.encode(obj), reply=reply, headers=codec_headers(codec))

"""NATS plumbing shared by every service: connecting, headers, encoding messages."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import weakref
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import AuthorizationError, MaxPayloadError

from genmesh.codecs import Codec, get_codec
from genmesh.shared.credentials import NO_AUTH, NatsAuth
from genmesh.shared.tasks import keep_cancel

log = logging.getLogger(__name__)

CODEC_HEADER = "genmesh-codec"
# On a request to a decode worker: the worker id of the prefill worker the router paired it
# with (docs/protocol.md §14). Routers forward the envelope's bytes untouched, so the
# pairing travels beside them.
PREFILL_HEADER = "genmesh-prefill"
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


# Run when the server refuses a publish of `nc` (a permissions violation), with the subject
# as nats-py reports it: lowercased.
_denied_hooks: weakref.WeakKeyDictionary[Client, list[Callable[[str], None]]] = (
    weakref.WeakKeyDictionary()
)
# Subjects the server refused `nc` a subscription to, as nats-py reports them (lowercased).
_denied_subscriptions: weakref.WeakKeyDictionary[Client, set[str]] = weakref.WeakKeyDictionary()
_DENIED = re.compile(
    r'permissions violation for (publish|subscription) to "([^"]+)"', re.IGNORECASE
)


def on_publish_denied(nc: Client, hook: Callable[[str], None]) -> None:
    """Call `hook(subject)` whenever the server refuses a publish of `nc` (only for
    connections made by `connect`). nats-py lowercases the subject in its report.

    A responder needs this: with `allow_responses` the right to answer a request belongs
    to the connection that received it, so after a reconnect (to another cluster node, or
    the same server) the rest of a stream is refused."""
    _denied_hooks.setdefault(nc, []).append(hook)


async def flush_in_order(nc: Client, timeout: int = 10) -> None:
    """Return once the server has processed everything `nc` sent before the call.

    `nc.flush()` alone does not promise that: nats-py writes the flush's PING straight to
    the socket, ahead of commands its flusher task has not written yet (a SUB or PUB just
    made), so the PONG can come back before the server has seen them, and a message
    another connection publishes next can miss a subscription made "before" it. The first
    round trip lets the flusher run; the second is ordered after what it wrote."""
    await keep_cancel(nc.flush(timeout=timeout))
    await keep_cancel(nc.flush(timeout=timeout))


async def check_subscriptions(nc: Client, *subs: Subscription) -> None:
    """Raise NatsPermissionDenied if the server refused any of `subs` (only for connections
    made by `connect`).

    The server refuses a subscription with an asynchronous error, after which the
    subscription just stays silent: a requester whose inbox is refused would wait for
    answers that never come. The server answers in order, so once it has processed the
    SUBs and a PING after them, every refusal has arrived."""
    await flush_in_order(nc)
    denied = _denied_subscriptions.get(nc, set())
    for sub in subs:
        if sub.subject.lower() in denied:
            raise NatsPermissionDenied(sub.subject)


class NatsPermissionDenied(PermissionError):
    def __init__(self, subject: str) -> None:
        super().__init__(
            f'the NATS server refused a subscription to "{subject}": this NATS user may not '
            "subscribe there (check --nats-user and, for reply inboxes, --nats-inbox-prefix; "
            "docs/deploy.md)"
        )


class NatsUnreachable(ConnectionError):
    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"cannot reach NATS at {url}: {reason}")
        self.url = url


def server_list(url: str) -> list[str]:
    """`--nats-url` may list several servers (a cluster), comma-separated."""
    servers = [part.strip() for part in url.split(",") if part.strip()]
    if not servers:
        raise ValueError("no NATS server URL given")
    return servers


def redact(url: str) -> str:
    """A server URL (or list) without the password or token it may carry."""
    return re.sub(r"//[^/@,]*@", "//***@", url)


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


class PayloadTooLarge(MaxPayloadError):
    """A message that the server would refuse for its size, headers included."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__()
        self.size = size
        self.limit = limit

    def __str__(self) -> str:
        return f"a message of {self.size} bytes exceeds the server's max_payload of {self.limit}"


def check_fits(max_payload: int, data: bytes, headers: dict[str, str] | None) -> None:
    """Raise PayloadTooLarge if `data` with `headers` exceeds `max_payload` (the server's,
    `nc.max_payload`).

    nats-py checks the payload alone, but the server counts headers and payload together
    and, for a message over the limit, answers `-ERR 'Maximum Payload Violation'` and
    closes the connection (nats-server `server/client.go`, `processHeaderPub` and
    `maxPayloadViolation`); nats-py then closes the client for good (`_process_err`). One
    frame that only just fits its payload would cut a service off the mesh."""
    size = len(data)
    if headers:
        # NATS/1.0 headers as nats-py writes them: the status line, `key: value` lines, a
        # blank line, each ended by CRLF.
        size += len(b"NATS/1.0\r\n\r\n") + sum(
            len(key.encode()) + len(value.encode()) + 4 for key, value in headers.items()
        )
    if size > max_payload:
        raise PayloadTooLarge(size, max_payload)


def message_codec(msg: Msg) -> Codec:
    """The codec named by `msg`'s header; raises UnknownCodecError."""
    return get_codec(header(msg, CODEC_HEADER))


async def connect(
    url: str,
    *,
    name: str,
    inbox_prefix: str = "_INBOX",
    reconnect_wait_s: float = 0.5,
    auth: NatsAuth | None = None,
    options: Mapping[str, Any] | None = None,
) -> Client:
    """Connect, failing fast when NATS is unreachable; once up, reconnect forever.

    `url` may list several servers, comma-separated (a cluster; nats-py also learns the
    cluster's other servers from the one it reaches). `auth`: credentials and TLS, and
    the inbox prefix if it overrides `inbox_prefix` (the role's). `options`: more keyword
    arguments for `nats.connect` (tests).

    nats-py runs its reconnect loop on the first connect too (60 tries, 2 s apart, with
    the defaults), so the first connect gets two quick tries and reconnection without
    limit is switched on only once connected.
    """
    servers = server_list(url)
    shown = redact(url)
    extra = (auth or NO_AUTH).connect_options()  # NatsAuthError: before any network
    if options:
        extra.update(options)
    user_error_cb = extra.pop("error_cb", None)
    connected = False
    nc: Client
    first_errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        if connected:
            log.warning("NATS (%s): %s", name, exc)
            denied = _DENIED.search(str(exc))
            if denied and denied.group(1).lower() == "subscription":
                _denied_subscriptions.setdefault(nc, set()).add(denied.group(2).lower())
            elif denied:
                for hook in list(_denied_hooks.get(nc, ())):
                    try:
                        hook(denied.group(2).lower())
                    except Exception as hook_exc:
                        log.warning("NATS (%s): on a refused publish: %s", name, hook_exc)
        else:  # reported once, as NatsUnreachable, by the caller
            first_errors.append(exc)
        if user_error_cb is not None:
            await user_error_cb(exc)

    async def on_disconnected() -> None:
        if not (nc.is_closed or nc.is_draining):  # a deliberate close is no news
            log.warning("NATS (%s): disconnected from %s", name, _server_of(nc) or shown)

    async def on_reconnected() -> None:
        log.info("NATS (%s): reconnected to %s", name, _server_of(nc) or shown)
        for hook in list(_reconnect_hooks.get(nc, ())):
            try:
                await hook()
            except Exception as exc:
                log.warning("NATS (%s): after reconnecting: %s", name, exc)

    # nats-py can wait forever on a TLS handshake that fails verification: bound it.
    limit_s = (CONNECT_TIMEOUT_S + 1.0) * 2 * len(servers)
    try:
        async with asyncio.timeout(limit_s):
            nc = await nats.connect(
                servers,
                name=name,
                inbox_prefix=(auth or NO_AUTH).inbox_prefix or inbox_prefix,
                connect_timeout=CONNECT_TIMEOUT_S,
                max_reconnect_attempts=1,
                reconnect_time_wait=0.1,
                error_cb=on_error,
                disconnected_cb=on_disconnected,
                reconnected_cb=on_reconnected,
                **extra,
            )
    except TimeoutError as exc:
        cause = first_errors[-1] if first_errors else exc
        why = str(cause) or f"no connection within {limit_s:g}s"
        raise NatsUnreachable(shown, why) from exc
    except Exception as exc:
        cause = first_errors[-1] if first_errors else exc
        if any(_is_auth_error(e) for e in [*first_errors, exc]):
            raise NatsUnreachable(
                shown, "the server refused the credentials (authorization violation)"
            ) from exc
        raise NatsUnreachable(shown, str(cause) or type(cause).__name__) from exc
    connected = True
    nc.options["max_reconnect_attempts"] = -1
    nc.options["reconnect_time_wait"] = reconnect_wait_s
    return nc


def _is_auth_error(exc: BaseException) -> bool:
    return isinstance(exc, AuthorizationError) or "authorization violation" in str(exc).lower()


def _server_of(nc: Client) -> str | None:
    """The server `nc` is connected to now (host:port)."""
    uri = getattr(nc, "connected_url", None)
    if uri is None:
        return None
    return f"{uri.hostname}:{uri.port}"


async def drain_or_close(nc: Client) -> None:
    """Drain the connection (pending publishes and callbacks finish), or close it when
    there is no server to drain to (an outage): a service asked to stop, stops."""
    try:
        await nc.drain()
        return
    except Exception as exc:
        log.debug("NATS: could not drain (%s); closing", exc)
    # nats-py flushes into the socket that is gone: asyncio's transport then fails with an
    # OSError, uvloop's (shared/loop.py) with a RuntimeError ("the handler is closed").
    with contextlib.suppress(OSError, RuntimeError):
        await nc.close()


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

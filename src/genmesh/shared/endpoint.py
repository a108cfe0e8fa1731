"""One NATS endpoint that receives request envelopes: the skeleton routers and workers share.

In the spirit of nats-py's `nats.micro` endpoint wrapper, it owns everything between the
message and the service's decision: the codec named by the `genmesh-codec` header, the
decode, the envelope's version and fields (`Envelope.from_wire`), and the answer to a
request that cannot be served: one `err` frame with `seq` 0, then the empty terminator
(`docs/protocol.md` §6.7 rows 1-4, §6.8), logged and counted by error code. Its `micro`
counts what `$SRV.STATS` reports of the subject: every message a request, every refusal
an error, the callback's time its processing time (`shared/micro.py`). The service's
handler receives a `Request` and refuses it by raising `MeshError`; whatever it sends on
admission (the worker's frames, the router's forward) is its own.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from genmesh.codecs import Codec, CodecError, UnknownCodecError, get_codec
from genmesh.shared import frames, tracing
from genmesh.shared.bus import STREAM_TERMINATOR, codec_headers, message_codec
from genmesh.shared.envelope import Envelope, EnvelopeError, peek_id
from genmesh.shared.errors import ErrorCode, MeshError
from genmesh.shared.micro import MicroEndpoint

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Request:
    """A request envelope that decoded, with the message it came in."""

    msg: Msg
    codec: Codec  # replies use the request's codec
    envelope: Envelope

    @property
    def reply(self) -> str:
        return self.msg.reply


Handler = Callable[[Request], Awaitable[None]]
# Told of every refusal: the request's id (None if unreadable) and the error.
RejectHook = Callable[[str | None, MeshError], None]


class EnvelopeEndpoint:
    """Subscribes `handler` to `subject` (in `queue`, if given) once started."""

    def __init__(
        self,
        nc: Client,
        subject: str,
        handler: Handler,
        *,
        queue: str = "",
        on_reject: RejectHook | None = None,
        micro_data: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.nc = nc
        self.subject = subject
        self.queue = queue
        self.handler = handler
        self.on_reject = on_reject
        # Requests answered with an `err` frame here, by error code (for metrics).
        self.rejections: Counter[str] = Counter()
        # The subject as `$SRV` reports it (the service lists it in its MicroService).
        self.micro = MicroEndpoint("generate", subject, queue, micro_data)

    async def subscribe(self) -> Subscription:
        # With tracing on, the requester's trace context is current while a message is
        # handled (the handler's spans, and tasks it spawns, become its children); off,
        # the callback is the bare one.
        callback = self._on_message if tracing.tracer() is None else self._on_message_traced
        return await self.nc.subscribe(self.subject, queue=self.queue, cb=callback)

    async def _on_message_traced(self, msg: Msg) -> None:
        with tracing.remote_parent(msg.headers):
            await self._on_message(msg)

    async def _on_message(self, msg: Msg) -> None:
        since = self.micro.received()
        try:
            try:
                codec = message_codec(msg)
            except UnknownCodecError as exc:
                # Nobody can read a reply in a codec we do not know; JSON is the lingua franca.
                await self.reject(msg.reply, get_codec("json"), None, ErrorCode.UNKNOWN_CODEC, exc)
                return
            try:
                obj = codec.decode(msg.data)
            except CodecError as exc:
                await self.reject(msg.reply, codec, None, ErrorCode.BAD_ENVELOPE, exc)
                return
            try:
                envelope = Envelope.from_wire(obj)
            except EnvelopeError as exc:
                await self.reject(msg.reply, codec, peek_id(obj), ErrorCode.BAD_ENVELOPE, exc)
                return
            if not msg.reply:
                log.warning("request %s has no reply subject; dropped", envelope.id)
                self.micro.failed(f"request {envelope.id} has no reply subject")
                return
            try:
                await self.handler(Request(msg, codec, envelope))
            except MeshError as error:
                await self.refuse(msg.reply, codec, envelope.id, error)
        finally:
            self.micro.handled(since)

    async def reject(
        self, reply: str, codec: Codec, rid: str | None, code: ErrorCode, exc: Exception
    ) -> None:
        await self.refuse(reply, codec, rid, MeshError(code, str(exc)))

    async def refuse(self, reply: str, codec: Codec, rid: str | None, error: MeshError) -> None:
        """Answer a request that will not be served: its `err` frame, then the terminator."""
        log.info("rejected request %s: %s: %s", rid, error.code.value, error.message)
        self.rejections[error.code.value] += 1
        self.micro.failed(f"{error.code.value}: {error.message}")
        if self.on_reject is not None:
            self.on_reject(rid, error)
        if not reply:
            return
        frame = frames.err(rid, 0, error)
        try:
            await self.nc.publish(reply, codec.encode(frame), headers=codec_headers(codec))
            await self.nc.publish(reply, STREAM_TERMINATOR)
        except Exception as exc:
            log.warning("could not send the refusal of %s: %s", rid, exc)

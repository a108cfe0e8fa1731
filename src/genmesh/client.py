"""The NATS-level client of the mesh. The HTTP frontend dispatches through it too.

    from genmesh.client import MeshClient, request

    async with await MeshClient.connect("nats://127.0.0.1:4222") as client:
        async for frame in client.generate(request([1, 2, 3], max_tokens=8)):
            print(frame)

`generate` yields every reply frame (`ack`, `out`, `ka`, `end`, `err`) and always ends with
exactly one terminal frame, `end` or `err`: failures the client detects itself (no
responders, a worker that never acknowledges or falls silent, lost frames) arrive as `err`
frames with `"origin": "client"`. Leaving the loop early, or cancelling the task, publishes
a cancel so the engine stops.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncGenerator
from types import TracebackType
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError

from genmesh.codecs import Codec, CodecError, UnknownCodecError, get_codec
from genmesh.shared import frames
from genmesh.shared.bus import (
    codec_headers,
    connect,
    is_no_responders,
    message_codec,
    publish,
    unsubscribe_quietly,
)
from genmesh.shared.envelope import Envelope, OutputOptions, Routing, Sampling
from genmesh.shared.errors import ErrorCode
from genmesh.shared.ids import new_request_id
from genmesh.shared.subjects import Subjects

log = logging.getLogger(__name__)

DEFAULT_ACK_TIMEOUT_S = 2.0
DEFAULT_IDLE_TIMEOUT_S = 60.0
# A reply inbox carries every stream of this client; let it queue generously.
_INBOX_PENDING_MSGS = 1_000_000
_INBOX_PENDING_BYTES = 1 << 30


def request(
    token_ids: list[int],
    *,
    max_tokens: int | None = 16,
    min_tokens: int = 0,
    seed: int | None = None,
    stop_token_ids: list[int] | None = None,
    ignore_eos: bool = False,
    logprobs: bool = False,
    top_logprobs: int = 0,
    prompt_logprobs_start: int | None = None,
    worker: str | None = None,
    model: str | None = None,
    client_id: str | None = None,
) -> Envelope:
    """A request envelope with a fresh private ID, for the common knobs."""
    return Envelope(
        id=new_request_id(),
        token_ids=list(token_ids),
        format="tokens",
        model=model,
        client_id=client_id,
        sampling=Sampling(
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            seed=seed,
            stop_token_ids=list(stop_token_ids or []),
            ignore_eos=ignore_eos,
        ),
        output=OutputOptions(
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            prompt_logprobs_start=prompt_logprobs_start,
        ),
        routing=Routing(worker=worker),
    )


class MeshClient:
    """Sends request envelopes and demultiplexes reply frames from one wildcard inbox."""

    def __init__(
        self,
        nc: Client,
        namespace: str = "default",
        *,
        codec: str | None = None,
        ack_timeout_s: float = DEFAULT_ACK_TIMEOUT_S,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        owns_connection: bool = False,
    ) -> None:
        self.nc = nc
        self.subjects = Subjects(namespace)
        self.codec: Codec = get_codec(codec)
        self.ack_timeout_s = ack_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self._owns_connection = owns_connection
        self._inbox = nc.new_inbox()
        self._streams: dict[str, asyncio.Queue[Msg]] = {}
        self._tokens = itertools.count()
        self._sub: Subscription | None = None

    @classmethod
    async def connect(
        cls,
        url: str,
        namespace: str = "default",
        *,
        name: str = "genmesh-client",
        inbox_prefix: str = "_INBOX_client",
        **kwargs: Any,
    ) -> MeshClient:
        """Connect to NATS (failing fast if unreachable) and start a client on it."""
        nc = await connect(url, name=name, inbox_prefix=inbox_prefix)
        client = cls(nc, namespace, owns_connection=True, **kwargs)
        await client.start()
        return client

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(
            f"{self._inbox}.*",
            cb=self._on_reply,
            pending_msgs_limit=_INBOX_PENDING_MSGS,
            pending_bytes_limit=_INBOX_PENDING_BYTES,
        )

    async def close(self) -> None:
        await unsubscribe_quietly(self._sub)
        self._sub = None
        if self._owns_connection:
            await self.nc.drain()

    async def __aenter__(self) -> MeshClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def active_streams(self) -> int:
        return len(self._streams)

    async def _on_reply(self, msg: Msg) -> None:
        queue = self._streams.get(msg.subject[len(self._inbox) + 1 :])
        if queue is not None:
            queue.put_nowait(msg)

    async def cancel(self, request_id: str, reason: str = "client") -> None:
        """Tell every worker to stop `request_id` (also before its request arrives)."""
        await publish(
            self.nc, self.subjects.cancel, self.codec, {"id": request_id, "reason": reason}
        )

    async def generate(
        self, envelope: Envelope, *, subject: str | None = None
    ) -> AsyncGenerator[frames.Frame, None]:
        """Dispatch `envelope` (to the routers unless `subject` says otherwise); yield frames."""
        if self._sub is None:
            raise RuntimeError("MeshClient.start() has not been called")
        rid = envelope.id
        token = str(next(self._tokens))
        queue: asyncio.Queue[Msg] = asyncio.Queue()
        self._streams[token] = queue
        finished = False
        target = subject or self.subjects.router_generate
        try:
            try:
                data = self.codec.encode(envelope.to_wire())
            except CodecError as exc:  # e.g. an integer beyond 64 bits in a native field
                finished = True
                yield frames.synthetic_err(
                    rid, ErrorCode.INVALID_ARGUMENT, f"the request cannot be encoded: {exc}"
                )
                return
            try:
                await self.nc.publish(
                    target, data, reply=f"{self._inbox}.{token}", headers=codec_headers(self.codec)
                )
            except NatsError as exc:  # closed, draining, or the reconnect buffer is full
                finished = True  # nothing went out, nothing to cancel
                yield frames.synthetic_err(
                    rid, ErrorCode.UNAVAILABLE, f"could not publish the request: {exc!r}"
                )
                return
            expected_seq = 0
            while True:
                timeout = self.ack_timeout_s if expected_seq == 0 else self.idle_timeout_s
                try:
                    if queue.empty():  # a timer only when there is something to wait for
                        async with asyncio.timeout(timeout):
                            msg = await queue.get()
                    else:
                        msg = queue.get_nowait()
                except TimeoutError:
                    what = "acknowledged the request" if expected_seq == 0 else "sent a frame"
                    yield frames.synthetic_err(
                        rid, ErrorCode.UNAVAILABLE, f"no worker {what} within {timeout:g}s"
                    )
                    return
                frame = self._read(rid, msg, target, expected_seq)
                expected_seq += 1
                if frame["t"] not in frames.TYPES:
                    continue  # a frame type from a newer protocol: numbered, not understood
                if frame["t"] not in frames.TERMINAL:
                    yield frame
                    continue
                # A terminal frame from a worker needs no cancel; one we made up does.
                finished = "origin" not in frame
                yield frame
                return
        finally:
            self._streams.pop(token, None)
            if not finished:
                try:
                    await self.cancel(rid)
                except Exception as exc:
                    log.warning("could not publish cancel for %s: %s", rid, exc)

    def _read(self, rid: str, msg: Msg, target: str, expected_seq: int) -> frames.Frame:
        """Decode and check one reply; problems become a terminal `err` frame."""
        if is_no_responders(msg):
            return frames.synthetic_err(
                rid, ErrorCode.NO_WORKER, f"nothing is subscribed to {target}"
            )
        try:
            frame = frames.check(message_codec(msg).decode(msg.data))
        except (UnknownCodecError, CodecError, frames.FrameError) as exc:
            return frames.synthetic_err(rid, ErrorCode.INTERNAL, f"unreadable reply frame: {exc}")
        # Rejections sent before a worker admitted the request carry seq 0 as well.
        if frame["seq"] != expected_seq and frame["t"] != frames.ERR:
            return frames.synthetic_err(
                rid,
                ErrorCode.UNAVAILABLE,
                f"reply frames lost: expected seq {expected_seq}, got {frame['seq']}",
            )
        return frame

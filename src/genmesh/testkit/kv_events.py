"""The mock servers' KV events: `--kv-events-config`, and a ZMQ publisher as the engines'.

SGLang and vLLM take `--kv-events-config JSON` and publish their prefix cache's events
with `ZmqEventPublisher` (sglang/srt/disaggregation/kv_events.py, vllm/distributed/
kv_events.py, the same class in both): a PUB socket sends `[topic, seq, payload]` per
scheduler step, `seq` 8 bytes big-endian from 0, the payload a msgpack `KVEventBatch`;
the last `buffer_steps` payloads are kept for a ROUTER socket (`replay_endpoint`) that
answers `[b"", start_seq]` with `[b"", seq, payload]` for each kept batch from that seq
on, then `[b"", -1, b""]`. An endpoint with `*`, `::`, `ipc://` or `inproc://` is bound,
any other connected to (the engines' heuristic); the replay endpoint is always bound.

Test hook (`POST /testkit/kv_events {"drop": n}`): the next `n` batches are numbered and
kept for replay but not sent on the PUB socket, as when a subscriber's queue overflows,
so tests can open a gap.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Literal

import zmq
import zmq.asyncio
from aiohttp import web
from pydantic import BaseModel, ConfigDict, ValidationError

from genmesh.shared.kv_events import KvEventBatch
from genmesh.shared.tasks import TaskOwner

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class SglangKvEventsConfig(BaseModel):
    """SGLang's `KVEventsConfig` (a pydantic model, unknown keys ignored). Its default
    publisher is "null": without `"publisher": "zmq"` nothing is published."""

    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def publishes(self) -> bool:
        return self.publisher == "zmq"


class VllmKvEventsConfig(BaseModel):
    """vLLM's `KVEventsConfig` (vllm/config/kv_events.py: a config dataclass, unknown keys
    refused). Events need `enable_kv_cache_events`; the publisher then defaults to zmq."""

    model_config = ConfigDict(extra="forbid")

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def publishes(self) -> bool:
        publisher = self.publisher or ("zmq" if self.enable_kv_cache_events else "null")
        return self.enable_kv_cache_events and publisher == "zmq"


KvEventsConfig = SglangKvEventsConfig | VllmKvEventsConfig


def parse_kv_events_config(engine: str, text: str) -> KvEventsConfig:
    """`--kv-events-config` as `engine` validates it; ValueError with pydantic's message
    (SGLang: an unknown publisher is refused as its factory refuses it)."""
    try:
        if engine == "sglang":
            config: KvEventsConfig = SglangKvEventsConfig.model_validate_json(text)
            if config.publisher not in ("null", "zmq"):
                raise ValueError(f"Unknown event publisher '{config.publisher}'")
            return config
        return VllmKvEventsConfig.model_validate_json(text)
    except ValidationError as exc:
        raise ValueError(f"--kv-events-config: {exc}") from None


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """The engines' `ZmqEventPublisher`, on asyncio: `publish` numbers, encodes and sends
    a batch at once (a PUB socket never blocks: past its high-water mark it drops);
    the replay socket is served by an owned task. The sockets are made by `start`, in
    the loop that serves them."""

    def __init__(self, config: KvEventsConfig, encode: Callable[[KvEventBatch], bytes]) -> None:
        self.config = config
        self._encode = encode
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._topic = config.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._tasks = TaskOwner("kv event publisher")
        # Batches still to leave out of the PUB stream (the test hook).
        self.drop = 0

    @property
    def endpoint(self) -> str:
        """Where the PUB socket is (a bound `*` port resolved, once started)."""
        if self._pub is None:
            return self.config.endpoint
        return str(self._pub.getsockopt_string(zmq.LAST_ENDPOINT))

    @property
    def published(self) -> int:
        """Batches numbered so far (the next seq)."""
        return self._seq

    @property
    def replay_endpoint(self) -> str | None:
        if self._replay is None:
            return self.config.replay_endpoint
        return str(self._replay.getsockopt_string(zmq.LAST_ENDPOINT))

    def start(self) -> None:
        """Bind (or connect) the sockets and serve replays."""
        config = self.config
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.sndhwm = config.hwm
        self._pub.linger = 0
        if _binds(config.endpoint):
            self._pub.bind(config.endpoint)
        else:
            self._pub.connect(config.endpoint)
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.linger = 0
            self._replay.bind(config.replay_endpoint)
            self._tasks.spawn(self._serve_replay(self._replay), name="replay")

    async def close(self) -> None:
        await self._tasks.close()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)

    def publish(self, batch: KvEventBatch) -> None:
        seq = self._seq
        self._seq += 1
        payload = self._encode(batch)
        self._buffer.append((seq, payload))
        if self._pub is None:  # not started: kept for replay only
            return
        if self.drop:
            self.drop -= 1
            return
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)

    async def _serve_replay(self, socket: zmq.asyncio.Socket) -> None:
        """`_service_replay`: every kept batch from the asked seq on, then the end mark."""
        while True:
            frames = await socket.recv_multipart()
            if len(frames) != 3:
                log.warning("Invalid replay request: %s", frames)
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await socket.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
            await socket.send_multipart([client, b"", END_SEQ, b""])


PUBLISHER = web.AppKey("kv_event_publisher", ZmqEventPublisher)


def add_kv_event_routes(app: web.Application, publisher: ZmqEventPublisher) -> None:
    """Run `publisher` with the app, and its test hook under `/testkit/kv_events`."""
    app[PUBLISHER] = publisher

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        publisher.start()
        yield
        await publisher.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/testkit/kv_events", _kv_events_hook)
    app.router.add_get("/testkit/kv_events", _kv_events_state)


async def _kv_events_hook(request: web.Request) -> web.Response:
    try:
        body = await request.json()
    except ValueError:
        body = None
    drop = body.get("drop") if isinstance(body, dict) else None
    if not isinstance(drop, int) or isinstance(drop, bool) or drop < 0:
        return web.json_response({"error": 'send {"drop": n}, n >= 0'}, status=400)
    request.app[PUBLISHER].drop = drop
    return await _kv_events_state(request)


async def _kv_events_state(request: web.Request) -> web.Response:
    publisher = request.app[PUBLISHER]
    return web.json_response(
        {
            "endpoint": publisher.endpoint,
            "replay_endpoint": publisher.replay_endpoint,
            "published": publisher.published,
            "drop": publisher.drop,
        }
    )

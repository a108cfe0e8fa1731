"""The wire protocol against real services: bad input never crashes or wedges them."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from genmesh.client import MIG, MeshClient, MigrationReason, request
from genmesh.codecs import get_codec
from genmesh.shared.bus import flush_in_order
from genmesh.shared.subjects import Subjects
from tests.http_util import post
from tests.inproc import AnyMesh

pytestmark = pytest.mark.inproc


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[Client]:
    conn = await nats.connect(nats_url, allow_reconnect=False)
    yield conn
    await conn.close()


async def ask(
    nc: Client, subject: str, data: bytes, headers: dict[str, str] | None = None
) -> tuple[dict[str, Any], dict[str, str]]:
    """Publish with a reply inbox; return the first reply decoded by its codec header."""
    msg = await nc.request(subject, data, timeout=5, headers=headers)
    codec = (msg.headers or {}).get("genmesh-codec", "msgpack")
    return get_codec(codec).decode(msg.data), dict(msg.headers or {})


def targets(mesh: AnyMesh) -> list[str]:
    subjects = Subjects(mesh.namespace)
    return [subjects.router_generate, subjects.worker_generate(mesh.workers[0].name)]


@pytest.mark.parametrize("garbage", [b"", b"\xc1\xff\x00garbage", b"\x93\x01\x02", b"\xa5hello"])
async def test_garbage_gets_an_err_frame(mesh: AnyMesh, nc: Client, garbage: bytes) -> None:
    for subject in targets(mesh):
        frame, _ = await ask(nc, subject, garbage)
        assert frame["t"] == "err"
        assert frame["code"] == "bad_envelope"
        assert frame["retryable"] is False
        assert frame["message"]


async def test_unknown_codec_is_answered_in_json(mesh: AnyMesh, nc: Client) -> None:
    for subject in targets(mesh):
        frame, headers = await ask(nc, subject, b"whatever", {"genmesh-codec": "klingon"})
        assert headers["genmesh-codec"] == "json"
        assert frame["code"] == "unknown_codec"
        assert "klingon" in frame["message"]
        assert "msgpack" in frame["message"]


@pytest.mark.parametrize(
    ("envelope", "fragment"),
    [
        ({"v": 1, "id": "x"}, "token_ids"),
        ({"v": 2, "id": "x", "token_ids": [1]}, "version"),
        ({"v": 1, "token_ids": [1]}, "id"),
        ({"v": 1, "id": "x", "token_ids": [1, -4]}, "token_ids[1]"),
        ({"v": 1, "id": "x", "token_ids": [1], "sampling": {"max_tokens": "many"}}, "max_tokens"),
        ({"v": 1, "id": "x", "token_ids": [1], "sampling": []}, "sampling"),
        ([1, 2, 3], "map"),
    ],
)
async def test_malformed_envelopes_name_the_field(
    mesh: AnyMesh, nc: Client, envelope: Any, fragment: str
) -> None:
    for codec_name in ("msgpack", "json"):
        codec = get_codec(codec_name)
        for subject in targets(mesh):
            frame, headers = await ask(
                nc, subject, codec.encode(envelope), {"genmesh-codec": codec_name}
            )
            assert frame["code"] == "bad_envelope", frame
            assert fragment in frame["message"]
            if codec_name == "json":
                assert headers["genmesh-codec"] == "json"  # replies use the request's codec
            if isinstance(envelope, dict) and "id" in envelope:
                assert frame["id"] == envelope["id"]


@pytest.mark.parametrize(
    ("token_ids", "message"),
    [
        (b"\x01\x00\x00", "token_ids: a bin of little-endian int32 must be a multiple of 4"),
        (b"\x01\x00\x00\x00\xff\xff\xff\xff", "token_ids[1]: expected a token id in [0, 2^31)"),
        (b"", "token_ids: must not be empty"),
    ],
)
async def test_bad_packed_prompts_name_the_field(
    mesh: AnyMesh, nc: Client, token_ids: bytes, message: str
) -> None:
    data = get_codec("msgpack").encode({"v": 1, "id": "x", "token_ids": token_ids})
    for subject in targets(mesh):
        frame, _ = await ask(nc, subject, data)
        assert frame["code"] == "bad_envelope", frame
        assert frame["message"].startswith(message)


async def test_a_packed_prompt_from_a_raw_client(mesh: AnyMesh, nc: Client) -> None:
    """What a client in another language sends: `token_ids` as a bin of little-endian int32."""
    packed = b"".join(t.to_bytes(4, "little") for t in (1, 2, 3))
    listed = [f async for f in _frames(nc, mesh, {"token_ids": [1, 2, 3]})]
    binned = [f async for f in _frames(nc, mesh, {"token_ids": packed})]
    assert [f["tokens"] for f in binned if "tokens" in f] == [
        f["tokens"] for f in listed if "tokens" in f
    ]
    assert binned[-1]["t"] == "end"


async def _frames(nc: Client, mesh: AnyMesh, fields: dict[str, Any]) -> AsyncIterator[Any]:
    """The frames of one raw msgpack request to the router, up to the terminal one."""
    envelope = {"v": 1, "id": f"raw-{id(fields)}", "sampling": {"max_tokens": 4}, **fields}
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        await nc.publish(
            Subjects(mesh.namespace).router_generate,
            get_codec("msgpack").encode(envelope),
            reply=inbox,
        )
        while True:
            msg = await sub.next_msg(timeout=5)
            if not msg.data:
                return
            frame = get_codec("msgpack").decode(msg.data)
            yield frame
            if frame["t"] in ("end", "err"):
                return
    finally:
        await sub.unsubscribe()


async def test_a_request_without_reply_subject_is_dropped_harmlessly(
    mesh: AnyMesh, nc: Client
) -> None:
    envelope = get_codec(None).encode(request([1, 2]).to_wire())
    for subject in targets(mesh):
        await nc.publish(subject, envelope)
    await flush_in_order(nc)
    await asyncio.sleep(0.1)
    assert all(s.alive for s in mesh.services)


async def test_services_still_serve_after_abuse(mesh: AnyMesh, nc: Client) -> None:
    for _ in range(50):
        for subject in targets(mesh):
            await nc.publish(subject, b"\xff" * 10, reply=nc.new_inbox())
    await nc.publish(Subjects(mesh.namespace).cancel, b"\x00garbage")
    await nc.publish(Subjects(mesh.namespace).announce, b"\x00garbage")
    await nc.publish(Subjects(mesh.namespace).announce, get_codec(None).encode({"id": "bad id!"}))
    await flush_in_order(nc)
    reply = await post(
        mesh.http_url + "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}}
    )
    assert reply.status == 200
    assert all(s.alive for s in mesh.services)


async def test_json_codec_end_to_end(mesh: AnyMesh, nats_url: str) -> None:
    async with await MeshClient.connect(nats_url, mesh.namespace, codec="json") as client:
        frames = [f async for f in client.generate(request([1, 2, 3], max_tokens=3, logprobs=True))]
    # The instant mock's first token goes alone; the other two come in one (end) frame.
    assert [f["t"] for f in frames] == ["ack", "out", "end"]
    assert [f["seq"] for f in frames] == [0, 1, 2]
    assert frames[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "cached_tokens": 0}
    assert frames[-1]["finish"] == {"reason": "length"}
    assert [len(f["tokens"]) for f in frames[1:]] == [1, 2]
    assert all(len(f["logprobs"]) == len(f["tokens"]) for f in frames[1:])


async def test_raw_json_request_like_natscli(mesh: AnyMesh, nc: Client) -> None:
    """What `nats req <router subject> '<json>' -H genmesh-codec:json` sends and gets."""
    inbox = nc.new_inbox()
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def on_msg(msg: Any) -> None:
        await queue.put(msg)

    await nc.subscribe(inbox, cb=on_msg)
    envelope = {"v": 1, "id": "natscli-1", "token_ids": [4, 5], "sampling": {"max_tokens": 2}}
    await nc.publish(
        Subjects(mesh.namespace).router_generate,
        json.dumps(envelope).encode(),
        reply=inbox,
        headers={"genmesh-codec": "json"},
    )
    replies = []
    while True:
        msg = await asyncio.wait_for(queue.get(), 5)
        replies.append(msg)
        if not msg.data:
            break  # the empty terminator that `nats req --wait-for-empty` waits for
    frames = [json.loads(m.data) for m in replies[:-1]]
    assert [f["t"] for f in frames] == ["ack", "out", "end"]
    assert all(f["id"] == "natscli-1" for f in frames)


async def test_router_errors_name_the_cause(mesh: AnyMesh, nats_url: str) -> None:
    async with await MeshClient.connect(nats_url, mesh.namespace) as client:
        unknown_model = request([1], model="no-such-model")
        frames = [f async for f in client.generate(unknown_model)]
        assert frames[-1]["code"] == "not_found"
        assert "no-such-model" in frames[-1]["message"]

        unknown_worker = request([1], worker="w-none")
        frames = [f async for f in client.generate(unknown_worker)]
        assert frames[-1]["code"] == "no_worker"
        assert frames[-1]["message"] == "worker 'w-none' is not known"


async def test_exclude_steers_but_never_refuses(mesh: AnyMesh, nats_url: str) -> None:
    """`routing.exclude` keeps a request off the listed workers while another is free, and
    falls back to them when every free worker is listed (protocol.md §10)."""
    first, second = (w.name for w in mesh.workers[:2])

    async def served_by(exclude: list[str], worker: str | None = None) -> str:
        env = request([1, 2], max_tokens=2, worker=worker)
        env.routing.exclude = exclude
        frames = [f async for f in client.generate(env)]
        assert frames[-1]["t"] == "end", frames[-1]
        return frames[0]["worker"]

    async with await MeshClient.connect(nats_url, mesh.namespace) as client:
        assert {await served_by([first]) for _ in range(6)} == {second}
        assert {await served_by([second]) for _ in range(6)} == {first}
        assert {await served_by([first, second]) for _ in range(6)} == {first, second}
        assert await served_by([first], worker=first) == first


class FakeWorker:
    """A hand-written worker on its own subject: the protocol as another language sees it."""

    def __init__(self, nc: Client, subject: str, script: list[dict[str, Any]]) -> None:
        self.nc = nc
        self.subject = subject
        self.script = script
        self.cancels: list[dict[str, Any]] = []

    async def start(self, cancel_subject: str) -> None:
        codec = get_codec(None)

        async def on_request(msg: Any) -> None:
            envelope = codec.decode(msg.data)
            for frame in self.script:
                await self.nc.publish(msg.reply, codec.encode({"id": envelope["id"], **frame}))

        async def on_cancel(msg: Any) -> None:
            self.cancels.append(codec.decode(msg.data))

        await self.nc.subscribe(self.subject, cb=on_request)
        await self.nc.subscribe(cancel_subject, cb=on_cancel)
        await flush_in_order(self.nc)


async def run_fake(
    nc: Client, nats_url: str, namespace: str, script: list[dict[str, Any]], **client_kwargs: Any
) -> tuple[list[dict[str, Any]], FakeWorker]:
    subjects = Subjects(namespace)
    fake = FakeWorker(nc, subjects.worker_generate("fake"), script)
    await fake.start(subjects.cancel)
    async with await MeshClient.connect(nats_url, namespace, **client_kwargs) as client:
        envelope = request([1, 2])
        frames = [f async for f in client.generate(envelope, subject=fake.subject)]
        await asyncio.sleep(0.2)  # let a cancel, if any, arrive
    return frames, fake


SHORT_ANSWER = [
    {"t": "ack", "seq": 0, "worker": "fake", "dispatch": "d"},
    {"t": "out", "seq": 1, "tokens": [5]},
    {"t": "end", "seq": 2, "tokens": [6], "finish": {"reason": "length"}, "usage": {}},
]


async def test_client_skips_frame_types_it_does_not_know(
    nc: Client, nats_url: str, namespace: str
) -> None:
    script = [
        {"t": "ack", "seq": 0, "worker": "fake", "dispatch": "d"},
        {"t": "hint-from-the-future", "seq": 1, "whatever": 1},
        {"t": "out", "seq": 2, "tokens": [5]},
        {"t": "end", "seq": 3, "tokens": [6], "finish": {"reason": "length"}, "usage": {}},
    ]
    frames, fake = await run_fake(nc, nats_url, namespace, script)
    assert [f["t"] for f in frames] == ["ack", "out", "end"]
    assert fake.cancels == []  # a stream that ended needs no cancel


async def test_client_detects_lost_frames_and_cancels(
    nc: Client, nats_url: str, namespace: str
) -> None:
    script = [
        {"t": "ack", "seq": 0, "worker": "fake", "dispatch": "d"},
        {"t": "out", "seq": 2, "tokens": [5]},
    ]
    frames, fake = await run_fake(nc, nats_url, namespace, script)
    assert frames[-1]["t"] == "err"
    assert frames[-1]["code"] == "unavailable"
    assert frames[-1]["retryable"] is True
    assert frames[-1]["origin"] == "client"
    assert "expected seq 1, got 2" in frames[-1]["message"]
    assert [c["reason"] for c in fake.cancels] == ["client"]


async def test_client_gives_up_on_a_silent_worker(
    nc: Client, nats_url: str, namespace: str
) -> None:
    frames, fake = await run_fake(nc, nats_url, namespace, [], ack_timeout_s=0.3)
    assert [f["t"] for f in frames] == ["err"]
    assert frames[0]["code"] == "unavailable"
    assert "no worker acknowledged the request within 0.3s" in frames[0]["message"]
    assert len(fake.cancels) == 1

    script = [{"t": "ack", "seq": 0, "worker": "fake", "dispatch": "d"}]
    frames, _ = await run_fake(nc, nats_url, namespace, script, idle_timeout_s=0.3)
    assert [f["t"] for f in frames] == ["ack", "err"]
    assert "no worker sent a frame within 0.3s" in frames[1]["message"]


async def test_a_cancel_that_arrives_with_a_ping_reply_is_not_lost(
    nc: Client, nats_url: str, namespace: str
) -> None:
    """The caller (a frontend handler whose client left) is cancelled just as the answer to
    a liveness ping comes back: the moment nats-py's `request` (asyncio.wait_for inside)
    loses a cancel on Python 3.11. The stream must still end, and its cancel go out."""
    script = [
        {"t": "ack", "seq": 0, "worker": "fake", "dispatch": "d"},
        {"t": "out", "seq": 1, "tokens": [5]},  # then silence: the client pings
    ]
    subjects = Subjects(namespace)
    fake = FakeWorker(nc, subjects.worker_generate("fake"), script)
    await fake.start(subjects.cancel)
    async with await MeshClient.connect(nats_url, namespace, ping_after_s=0.05) as client:
        pinged = asyncio.Event()

        async def ping_answered_while_cancelled(*args: Any, **kwargs: Any) -> Any:
            loop = asyncio.get_running_loop()
            answer: asyncio.Future[Any] = loop.create_future()
            consumer = asyncio.current_task()
            assert consumer is not None
            alive = Msg(client.nc, subject="", reply="", data=b"")
            loop.call_soon(answer.set_result, alive)  # the reply arrives...
            loop.call_soon(consumer.cancel)  # ...and so does the cancel, in the same step
            pinged.set()
            return await asyncio.wait_for(answer, 10)  # as nats-py's request does

        client.nc.request = ping_answered_while_cancelled  # type: ignore[method-assign]
        seen: list[str] = []

        async def consume() -> None:
            async for frame in client.generate(request([1, 2]), subject=fake.subject):
                seen.append(frame["t"])

        consumer = asyncio.create_task(consume())
        await asyncio.wait_for(pinged.wait(), 5)
        await asyncio.wait([consumer], timeout=2)
        assert consumer.done(), "the cancelled caller carried on after the ping"
        assert consumer.cancelled()
    await asyncio.sleep(0.2)  # let the cancel arrive
    assert seen == ["ack", "out"]
    assert [c["reason"] for c in fake.cancels] == ["client"]


async def test_a_request_waits_briefly_for_a_router_that_is_reconnecting(
    nc: Client, nats_url: str, namespace: str
) -> None:
    """A router is off its subject for a moment while it reconnects to NATS. No responders
    there is a refusal, retried after the refusal back-off (0.1, 0.2, 0.4 s): a router
    that subscribes 0.2 s after the request was sent still gets it."""
    subjects = Subjects(namespace)
    # The fake router answers as the worker it would forward to.
    late = FakeWorker(nc, subjects.router_generate, SHORT_ANSWER)

    async def subscribe_late() -> None:
        await asyncio.sleep(0.2)
        await late.start(subjects.cancel)

    async with await MeshClient.connect(nats_url, namespace) as client:
        router_back = asyncio.create_task(subscribe_late())
        frames = [f async for f in client.generate(request([1, 2]))]
        await router_back
    kinds = [f["t"] for f in frames]
    assert kinds[-3:] == ["ack", "out", "end"], frames
    migs = [f for f in frames if f["t"] == MIG]
    assert 1 <= len(migs) <= 2  # 0.1 s, then 0.3 s after the first refusal
    assert all(m["reason"] == MigrationReason.NO_ROUTER for m in migs)
    assert all(f"nothing is subscribed to {subjects.router_generate}" == m["message"] for m in migs)


async def test_no_router_at_all_ends_with_no_worker(nats_url: str, namespace: str) -> None:
    subject = Subjects(namespace).router_generate
    async with await MeshClient.connect(nats_url, namespace) as client:
        started = time.monotonic()
        frames = [f async for f in client.generate(request([1, 2]))]
        elapsed = time.monotonic() - started
    assert [f["t"] for f in frames] == [MIG, MIG, MIG, "err"]
    assert frames[-1]["code"] == "no_worker"
    assert frames[-1]["message"] == f"nothing is subscribed to {subject}"
    assert elapsed >= 0.1 + 0.2 + 0.4  # the back-off, spent in full


async def test_client_reports_no_responders(nc: Client, nats_url: str, namespace: str) -> None:
    async with await MeshClient.connect(nats_url, namespace) as client:
        subject = Subjects(namespace).worker_generate("ghost")
        frames = [f async for f in client.generate(request([1]), subject=subject)]
    assert [f["t"] for f in frames] == ["err"]
    assert frames[0]["code"] == "no_worker"
    assert subject in frames[0]["message"]

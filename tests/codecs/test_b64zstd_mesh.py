"""b64zstd end to end: a real nats-server, HTTP and raw NATS, the services in process.

One mesh: a router, two instant mock workers, and two frontends on the same workers:
- `plain`: the SGLang format, msgpack on the bus (the defaults);
- `packed`: `--generate-format sglang+b64zstd` and `--codec b64zstd`, so its clients
  send and receive Base64+zstd integer arrays and its NATS traffic is Base64 text.
The mock is deterministic, so the same request must give the same answer through both.
"""

from __future__ import annotations

import asyncio
import base64
import re
import struct
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgpack
import nats
import pytest
import zstandard
from nats.aio.client import Client
from nats.aio.msg import Msg

from genmesh.client import MeshClient, request
from genmesh.codecs import get_codec
from genmesh.shared.bus import flush_in_order
from genmesh.shared.subjects import Subjects
from genmesh_b64zstd import decode_int32, encode_int32
from tests.conftest import unique_namespace
from tests.http_util import post, stream
from tests.inproc import InProcessMesh

pytestmark = pytest.mark.inproc

BASE64_TEXT = re.compile(rb"[A-Za-z0-9+/]+={0,2}")


class Frontends:
    def __init__(self, mesh: InProcessMesh, plain: int, packed: int) -> None:
        self.mesh = mesh
        self.plain = f"http://127.0.0.1:{plain}/generate"
        self.packed = f"http://127.0.0.1:{packed}/generate"


@pytest.fixture(scope="module")
def fronts(nats_url: str) -> Iterator[Frontends]:
    mesh = InProcessMesh(nats_url, unique_namespace("z"))
    try:
        mesh.add_router()
        ids = [mesh.add_worker(vocab_size=1000, eos_token_id=7, wait=False).name for _ in "ab"]
        ports = []
        for args in ((), ("--codec", "b64zstd", "--generate-format", "sglang+b64zstd")):
            mesh.add_frontend(*args)
            ports.append(mesh.http_port)
            mesh.wait_for_workers(lambda known: set(ids) <= known, what=f"workers {ids}")
        yield Frontends(mesh, *ports)
    except BaseException:
        print(mesh.logs())
        raise
    finally:
        mesh.stop()


@pytest.fixture
def mesh(fronts: Frontends) -> InProcessMesh:
    """For conftest's failure hook, which attaches the `mesh` fixture's logs."""
    return fronts.mesh


# ---------------------------------------------------------------- helpers


async def eventually(predicate: Any, what: str, timeout: float = 5.0) -> None:
    """Like tests.mesh.wait_until, without blocking the event loop (NATS callbacks run)."""
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def experts_plain(text: str) -> list[int]:
    raw = base64.b64decode(text, validate=True)
    return list(struct.unpack(f"<{len(raw) // 4}i", raw))


def experts_packed(text: str) -> list[int]:
    raw = zstandard.ZstdDecompressor().decompress(base64.b64decode(text, validate=True))
    return list(struct.unpack(f"<{len(raw) // 4}i", raw))


def unpack_record(record: dict[str, Any]) -> dict[str, Any]:
    """A `packed` record in plain SGLang terms (e2e_latency dropped: it is a timing)."""
    assert isinstance(record["output_ids"], str)
    meta = {k: v for k, v in record["meta_info"].items() if k != "e2e_latency"}
    if "routed_experts" in meta:
        meta["routed_experts"] = experts_packed(meta["routed_experts"])
    return {**record, "output_ids": decode_int32(record["output_ids"]), "meta_info": meta}


def plain_record(record: dict[str, Any]) -> dict[str, Any]:
    meta = {k: v for k, v in record["meta_info"].items() if k != "e2e_latency"}
    if "routed_experts" in meta:
        meta["routed_experts"] = experts_plain(meta["routed_experts"])
    return {**record, "meta_info": meta}


def unpack(body: Any) -> Any:
    return [unpack_record(r) for r in body] if isinstance(body, list) else unpack_record(body)


def plain(body: Any) -> Any:
    return [plain_record(r) for r in body] if isinstance(body, list) else plain_record(body)


BASE = {"sampling_params": {"max_new_tokens": 8, "ignore_eos": True}, "rid": "same-id"}

# ---------------------------------------------------------------- (i) the client codec over HTTP


async def test_unary_matches_plain_sglang(fronts: Frontends) -> None:
    prompt = [3, 1, 4, 1, 5, 9]
    a = await post(fronts.plain, {**BASE, "input_ids": prompt, "return_logprob": True})
    b = await post(
        fronts.packed, {**BASE, "input_ids": encode_int32(prompt), "return_logprob": True}
    )
    assert a.status == b.status == 200, (a.body, b.body)
    assert isinstance(b.body["output_ids"], str)
    assert len(decode_int32(b.body["output_ids"])) == 8
    assert unpack(b.body) == plain(a.body)
    assert b.headers["x-request-id"] == "same-id"


@pytest.mark.parametrize("ids", [[1, 2, 3], [[1, 2, 3], [4]]], ids=["prompt", "batch"])
async def test_plain_input_ids_get_sglangs_plain_answer(fronts: Frontends, ids: Any) -> None:
    """The answer mirrors the request: a client that sent no Base64 gets none back
    (routed experts as the SGLang format's own plain Base64, not compressed)."""
    body = {**BASE, "input_ids": ids, "return_routed_experts": True}
    a = await post(fronts.plain, body)
    b = await post(fronts.packed, body)
    assert a.status == b.status == 200, (a.body, b.body)
    records = b.body if isinstance(b.body, list) else [b.body]
    assert all(isinstance(r["output_ids"], list) for r in records)
    assert plain(b.body) == plain(a.body)
    sa = await stream(fronts.plain, {**body, "stream": True})
    sb = await stream(fronts.packed, {**body, "stream": True})
    assert all(isinstance(c["output_ids"], list) for c in sb.events[:-1])

    def by_item(events: list[Any]) -> list[Any]:  # a batch's items interleave as they come
        return sorted((plain_record(c) for c in events[:-1]), key=lambda c: c.get("index", 0))

    assert by_item(sb.events) == by_item(sa.events)


async def test_sse_chunks_match_plain_sglang(fronts: Frontends) -> None:
    prompt = [21, 22, 23]
    a = await stream(fronts.plain, {**BASE, "input_ids": prompt, "return_routed_experts": True})
    b = await stream(
        fronts.packed,
        {**BASE, "input_ids": encode_int32(prompt), "return_routed_experts": True},
    )
    assert a.status == b.status == 200
    assert b.raw.endswith("data: [DONE]\n\n")
    assert a.events[-1] == b.events[-1] == "[DONE]"
    chunks_a, chunks_b = a.events[:-1], b.events[:-1]
    # (The instant mock sends the first token alone, then the other seven as one frame.)
    assert len(chunks_b) == len(chunks_a) == 2
    assert all(isinstance(c["output_ids"], str) for c in chunks_b)
    assert all(isinstance(c["meta_info"]["routed_experts"], str) for c in chunks_b)
    assert [unpack_record(c) for c in chunks_b] == [plain_record(c) for c in chunks_a]
    # The stream folds to the unary answer.
    unary = await post(
        fronts.packed,
        {**BASE, "input_ids": encode_int32(prompt), "return_routed_experts": True},
    )
    tokens = [t for c in chunks_b for t in decode_int32(c["output_ids"])]
    assert decode_int32(unary.body["output_ids"]) == tokens
    experts = [e for c in chunks_b for e in experts_packed(c["meta_info"]["routed_experts"])]
    assert experts_packed(unary.body["meta_info"]["routed_experts"]) == experts


async def test_routed_experts_unary(fronts: Frontends) -> None:
    body = {**BASE, "return_routed_experts": True, "routed_experts_start_len": 1}
    a = await post(fronts.plain, {**body, "input_ids": [5, 6, 7, 8]})
    b = await post(fronts.packed, {**body, "input_ids": encode_int32([5, 6, 7, 8])})
    assert a.status == b.status == 200, (a.body, b.body)
    experts = experts_packed(b.body["meta_info"]["routed_experts"])
    assert experts  # prompt rows from position 1, then one row per generated token
    assert experts == experts_plain(a.body["meta_info"]["routed_experts"])
    assert unpack(b.body) == plain(a.body)


@pytest.mark.parametrize("streaming", [False, True])
async def test_batch_of_encoded_prompts(fronts: Frontends, streaming: bool) -> None:
    prompts = [[1, 2, 3], [4, 5], [6]]
    body = {"sampling_params": {"max_new_tokens": 5, "ignore_eos": True}, "rid": "batch"}
    packed_ids = [encode_int32(prompts[0]), prompts[1], encode_int32(prompts[2])]  # mixed
    if not streaming:
        a = await post(fronts.plain, {**body, "input_ids": prompts})
        b = await post(fronts.packed, {**body, "input_ids": packed_ids})
        assert a.status == b.status == 200, (a.body, b.body)
        assert isinstance(b.body, list)
        assert len(b.body) == 3
        assert unpack(b.body) == plain(a.body)
        return
    sa = await stream(fronts.plain, {**body, "input_ids": prompts})
    sb = await stream(fronts.packed, {**body, "input_ids": packed_ids})
    assert sa.status == sb.status == 200

    def per_item(events: list[Any], decode: Any) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for e in events[:-1]:
            out.setdefault(e["index"], []).extend(decode(e["output_ids"]))
        return out

    assert per_item(sb.events, decode_int32) == per_item(sa.events, list)


@pytest.mark.parametrize(
    ("ids", "field"),
    [
        ("this is not base64!", "input_ids"),
        (base64.b64encode(b"plain int32 bytes, no zstd").decode(), "input_ids"),
        ([encode_int32([1, 2]), "%%%"], "input_ids[1]"),
    ],
)
@pytest.mark.parametrize("streaming", [False, True])
async def test_bad_encoded_input_is_a_400_in_sglang_shape(
    fronts: Frontends, ids: Any, field: str, streaming: bool
) -> None:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}
    reply = await (stream if streaming else post)(fronts.packed, body)
    assert reply.status == 400
    error = reply.body if not streaming else reply.events[0]  # type: ignore[union-attr]
    assert set(error) == {"error"}
    assert error["error"]["message"].startswith(f"b64zstd: {field}: expected Base64")


async def test_format_errors_keep_their_sglang_shape(fronts: Frontends) -> None:
    reply = await post(fronts.packed, {"input_ids": encode_int32([1, 2**31 - 1, -1])})
    assert reply.status == 400
    assert reply.body == {"error": {"message": "input_ids[2]: token id -1 is out of range"}}


# ---------------------------------------------------------------- (ii) two bus codecs, one mesh


async def test_msgpack_and_b64zstd_clients_share_the_workers(fronts: Frontends) -> None:
    ns = fronts.mesh.namespace
    nats_url = fronts.mesh.nats_url
    results: dict[str, list[dict[str, Any]]] = {}
    for codec in ("msgpack", "b64zstd"):
        async with await MeshClient.connect(nats_url, ns, codec=codec) as client:
            env = request([9, 8, 7], max_tokens=6, logprobs=True, top_logprobs=2)
            frames = [f async for f in client.generate(env)]
        assert [f["t"] for f in frames] == ["ack", "out", "end"]  # 1 token, then 5
        results[codec] = [{k: v for k, v in f.items() if k not in ("id", "worker", "dispatch")}
                          for f in frames]  # fmt: skip
    assert results["msgpack"] == results["b64zstd"]


@pytest.fixture
async def nc(fronts: Frontends) -> AsyncIterator[Client]:
    conn = await nats.connect(fronts.mesh.nats_url, allow_reconnect=False)
    yield conn
    await conn.close()


async def test_frames_on_the_wire_are_base64_text(fronts: Frontends, nc: Client) -> None:
    """A raw NATS client speaks b64zstd to the router; every reply is Base64 text."""
    subjects = Subjects(fronts.mesh.namespace)
    codec = get_codec("b64zstd")
    env = request([1, 2, 3], max_tokens=4, logprobs=True).to_wire()
    inbox = nc.new_inbox()
    replies: asyncio.Queue[Msg] = asyncio.Queue()

    async def on_reply(msg: Msg) -> None:
        replies.put_nowait(msg)

    await nc.subscribe(inbox, cb=on_reply)
    data = codec.encode(env)
    assert BASE64_TEXT.fullmatch(data)
    await nc.publish(
        subjects.router_generate, data, reply=inbox, headers={"genmesh-codec": "b64zstd"}
    )
    kinds = []
    while True:
        msg = await asyncio.wait_for(replies.get(), 10)
        if not msg.data:  # the empty terminator, without headers
            assert not msg.headers
            break
        assert (msg.headers or {}).get("genmesh-codec") == "b64zstd"
        assert BASE64_TEXT.fullmatch(msg.data), msg.data
        assert msg.data.decode("ascii")  # ASCII only
        frame = codec.decode(msg.data)
        assert frame["id"] == env["id"]
        kinds.append(frame["t"])
    assert kinds == ["ack", "out", "end"]  # the instant mock: the first token, then the rest


async def test_the_packed_frontend_publishes_b64zstd_and_the_plain_one_msgpack(
    fronts: Frontends, nc: Client
) -> None:
    """Tap the workers' subjects (the frontends route themselves) and the frontends'
    inboxes while both frontends serve."""
    subjects = Subjects(fronts.mesh.namespace)
    requests: list[Msg] = []
    frames: list[Msg] = []

    async def on_request(msg: Msg) -> None:
        requests.append(msg)

    async def on_frame(msg: Msg) -> None:
        frames.append(msg)

    # Plain subscriptions see a copy of everything sent to the workers.
    await nc.subscribe(subjects.worker_generate("*"), cb=on_request)
    await nc.subscribe("_INBOX_frontend.>", cb=on_frame)
    await flush_in_order(nc)
    a = await post(fronts.plain, {**BASE, "input_ids": [4, 4, 4]})
    b = await post(fronts.packed, {**BASE, "input_ids": encode_int32([4, 4, 4])})
    assert a.status == b.status == 200
    assert unpack(b.body) == plain(a.body)
    await eventually(lambda: len(requests) >= 2, "both requests on the tap")

    by_codec: dict[str, Any] = {}
    for msg in requests:
        name = (msg.headers or {}).get("genmesh-codec", "msgpack")
        by_codec[name] = msg
    assert set(by_codec) == {"msgpack", "b64zstd"}
    packed = by_codec["b64zstd"]
    assert BASE64_TEXT.fullmatch(packed.data)
    envelope = get_codec("b64zstd").decode(packed.data)
    # The prompt travels packed: one bin of little-endian int32 (protocol.md §5.1).
    assert envelope["token_ids"] == struct.pack("<3i", 4, 4, 4)
    assert envelope["format"] == "sglang"
    plain_env = msgpack.unpackb(by_codec["msgpack"].data)
    assert plain_env["token_ids"] == struct.pack("<3i", 4, 4, 4)
    assert not BASE64_TEXT.fullmatch(by_codec["msgpack"].data)

    # The worker answered each frontend in its own codec.
    def frames_of(request_id: str) -> list[Msg]:
        out = []
        for msg in frames:
            if not msg.data:
                continue
            name = (msg.headers or {}).get("genmesh-codec", "msgpack")
            if get_codec(name).decode(msg.data)["id"] == request_id:
                out.append(msg)
        return out

    # ack, out (the instant mock's first token), end (the other 7)
    await eventually(lambda: len(frames_of(envelope["id"])) == 3, "the packed frames")
    await eventually(lambda: len(frames_of(plain_env["id"])) == 3, "the plain frames")
    for msg in frames_of(envelope["id"]):
        assert (msg.headers or {})["genmesh-codec"] == "b64zstd"
        assert BASE64_TEXT.fullmatch(msg.data)
    for msg in frames_of(plain_env["id"]):
        assert not msg.headers
        assert not BASE64_TEXT.fullmatch(msg.data)

"""Abort by ID, /flush_cache and the API keys, end to end: two frontends on one mesh of
slow mock workers (real NATS, real HTTP), requests through one, admin calls through the
other, as behind a load balancer."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest

from genmesh.client import MIG, MeshClient
from genmesh.codecs import get_codec
from genmesh.shared import frames
from genmesh.shared.bus import flush_in_order
from genmesh.shared.envelope import Envelope, Sampling
from genmesh.shared.ids import new_request_id
from genmesh.shared.subjects import Subjects
from tests.conftest import unique_namespace
from tests.http_util import post, stream
from tests.inproc import InProcessMesh, start_inproc_mesh

pytestmark = pytest.mark.inproc

# Real-time mock: ~6 ms a token, so LONG tokens run for many seconds unless aborted.
LONG = 3000
JSON = {"Content-Type": "application/json"}
SGLANG_ABORT = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
FLUSH_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


@pytest.fixture(scope="module")
def two_fronts(nats_url: str) -> Iterator[tuple[InProcessMesh, str, str]]:
    """A mesh of 2 real-time mock workers with prefix caches, and two frontends."""
    mesh = start_inproc_mesh(
        nats_url,
        namespace=unique_namespace("adm"),
        worker_opts={"speedup": 1.0, "extra_args": ("--mock-prefix-cache",)},
        frontend_args=("--admin-timeout", "2"),
    )
    first = mesh.http_url
    mesh.add_frontend("--admin-timeout", "2", name="frontend2")
    second = mesh.http_url
    try:
        yield mesh, first, second
    finally:
        mesh.stop()


async def inflight(url: str) -> int:
    async with aiohttp.ClientSession() as s, s.get(url + "/get_server_info") as r:
        info = await r.json()
    return sum(w.get("inflight", 0) for w in info["genmesh"]["workers"])


async def wait_inflight(url: str, count: int, timeout: float = 10.0) -> None:
    """Until the workers' cards say `count` requests are admitted (cards follow load
    changes within ~50 ms)."""
    deadline = time.monotonic() + timeout
    while await inflight(url) != count:
        assert time.monotonic() < deadline, f"never {count} requests in flight"
        await asyncio.sleep(0.05)


async def wait_ready(url: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
            if r.status == 200:
                return
        assert time.monotonic() < deadline, "the frontend never became ready"
        await asyncio.sleep(0.05)


@pytest.fixture(autouse=True)
async def idle(two_fronts: Any) -> None:
    """Every test starts on idle workers, so that its in-flight counts are its own."""
    await wait_inflight(two_fronts[1], 0)


def long_sglang(rid: str | list[str] | None = None, **more: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True},
    }
    if rid is not None:
        body["rid"] = rid
    return body | more


# ------------------------------------------------------------------------ SGLang


async def test_abort_unary_through_another_frontend(two_fronts: Any) -> None:
    _mesh, first, second = two_fronts
    task = asyncio.create_task(post(first + "/generate", long_sglang("u-1")))
    await wait_inflight(first, 1)
    reply = await post(second + "/abort_request", {"rid": "u-1"})
    assert (reply.status, reply.body) == (200, "")
    result = await asyncio.wait_for(task, 10)
    assert result.status == 200
    meta = result.body["meta_info"]
    assert meta["id"] == "u-1"
    assert meta["finish_reason"] == SGLANG_ABORT
    assert 0 < meta["completion_tokens"] < LONG
    assert len(result.body["output_ids"]) == meta["completion_tokens"]


async def test_abort_sse_through_the_same_frontend(two_fronts: Any) -> None:
    _mesh, first, _ = two_fronts
    task = asyncio.create_task(stream(first + "/generate", long_sglang("s-1")))
    await wait_inflight(first, 1)
    assert (await post(first + "/abort_request", {"rid": "s-1"})).status == 200
    result = await asyncio.wait_for(task, 10)
    assert result.status == 200
    assert result.events[-1] == "[DONE]"
    last = result.events[-2]
    assert last["meta_info"]["finish_reason"] == SGLANG_ABORT
    assert all(e["meta_info"]["finish_reason"] is None for e in result.events[:-2])


async def test_abort_matches_prefixes_across_workers(two_fronts: Any) -> None:
    """SGLang's scheduler aborts every rid starting with the one given, once the
    tokenizer manager has found that exact rid: here on the other worker too."""
    _mesh, first, second = two_fronts
    a = asyncio.create_task(post(first + "/generate", long_sglang("px-1")))
    b = asyncio.create_task(post(first + "/generate", long_sglang("px-12")))
    await wait_inflight(first, 2)
    assert (await post(second + "/abort_request", {"rid": "px-1"})).status == 200
    for task in (a, b):
        reply = await asyncio.wait_for(task, 10)
        assert reply.body["meta_info"]["finish_reason"] == SGLANG_ABORT


async def test_batch_items_are_reached_by_their_own_rids(two_fronts: Any) -> None:
    """A batch with rid "bt" runs items "bt_0" and "bt_1": SGLang does not know "bt" itself
    (ignored), while "bt_0" aborts item 0 and leaves item 1 to finish."""
    _mesh, first, second = two_fronts
    body = {
        "input_ids": [[1, 2, 3], [4, 5, 6]],
        "rid": "bt",
        "sampling_params": [
            {"max_new_tokens": LONG, "ignore_eos": True},
            {"max_new_tokens": 200, "ignore_eos": True},
        ],
    }
    task = asyncio.create_task(post(first + "/generate", body))
    await wait_inflight(first, 2)
    assert (await post(second + "/abort_request", {"rid": "bt"})).status == 200
    assert (await post(second + "/abort_request", {"rid": "bt_0"})).status == 200
    reply = await asyncio.wait_for(task, 15)
    assert reply.status == 200
    metas = [item["meta_info"] for item in reply.body]
    assert [m["id"] for m in metas] == ["bt_0", "bt_1"]
    assert metas[0]["finish_reason"] == SGLANG_ABORT
    assert metas[1]["finish_reason"] == {"type": "length", "length": 200}


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[Any]:
    """The `data:` payloads of an SSE response as they arrive."""
    async for raw in response.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            yield payload if payload == "[DONE]" else json.loads(payload)


async def test_parallel_samples_are_reached_by_the_ids_they_report(two_fronts: Any) -> None:
    """With n > 1 SGLang gives every sample a fresh rid (its meta_info.id): aborting one
    sample by that rid stops it and leaves the other running."""
    _mesh, first, second = two_fronts
    body = long_sglang(
        "par", sampling_params={"max_new_tokens": LONG, "ignore_eos": True, "n": 2}, stream=True
    )
    finals: dict[str, Any] = {}
    async with aiohttp.ClientSession() as s, s.post(first + "/generate", json=body) as r:
        assert r.status == 200
        events = sse_events(r)
        ids: set[str] = set()
        async for event in events:
            ids.add(event["meta_info"]["id"])
            if len(ids) == 2:
                break
        victim, survivor = sorted(ids)
        assert "par" not in ids  # not reached by the request's own rid
        assert (await post(second + "/abort_request", {"rid": victim})).status == 200
        async for event in events:
            if event == "[DONE]":
                break
            meta = event["meta_info"]
            if meta["finish_reason"] is not None:
                finals[meta["id"]] = meta["finish_reason"]
                if meta["id"] == victim:
                    # The survivor is still running: end it, and the test, by abort_all.
                    assert survivor not in finals
                    stop_all = await post(second + "/abort_request", {"abort_all": True})
                    assert stop_all.status == 200
    assert finals == {victim: SGLANG_ABORT, survivor: SGLANG_ABORT}


async def test_abort_all_ends_every_request(two_fronts: Any) -> None:
    _mesh, first, second = two_fronts
    tasks = [asyncio.create_task(post(first + "/generate", long_sglang())) for _ in range(3)]
    await wait_inflight(first, 3)
    assert (await post(second + "/abort_request", {"abort_all": True})).status == 200
    for task in tasks:
        reply = await asyncio.wait_for(task, 10)
        assert reply.body["meta_info"]["finish_reason"] == SGLANG_ABORT


async def test_unknown_and_empty_rids_are_ignored_bad_ones_refused(two_fronts: Any) -> None:
    _, first, _ = two_fronts
    assert (await post(first + "/abort_request", {"rid": "nobody"})).status == 200
    assert (await post(first + "/abort_request", {})).status == 200
    bad = await post(first + "/abort_request", {"rid": 5})
    assert bad.status == 400
    assert bad.body["object"] == "error"
    assert "rid" in bad.body["message"]


async def test_an_aborted_request_ends_with_its_end_frame_and_is_not_migrated(
    two_fronts: Any, nats_url: str
) -> None:
    mesh, first, _ = two_fronts
    envelope = Envelope(
        id=new_request_id(),
        token_ids=[1, 2, 3],
        format="sglang",
        client_id="nm-1",
        sampling=Sampling(max_tokens=LONG, ignore_eos=True),
    )
    seen: list[Any] = []
    async with await MeshClient.connect(nats_url, mesh.namespace) as client:

        async def run() -> None:
            async for frame in client.generate(envelope):
                seen.append(frame)

        task = asyncio.create_task(run())
        await wait_inflight(first, 1)
        assert (await post(first + "/abort_request", {"rid": "nm-1"})).status == 200
        await asyncio.wait_for(task, 10)
    kinds = [f["t"] for f in seen]
    assert MIG not in kinds
    assert frames.ERR not in kinds
    assert seen[-1]["t"] == frames.END
    assert seen[-1]["finish"] == {"reason": "abort", "message": "Aborted"}


# ------------------------------------------------------------------------ vLLM


def long_vllm(**more: Any) -> dict[str, Any]:
    return {
        "token_ids": [1, 2, 3],
        "sampling_params": {"max_tokens": LONG, "ignore_eos": True},
    } | more


async def test_vllm_abort_requests(two_fronts: Any) -> None:
    """vLLM's cancel router answers /abort_requests (it is mounted before the tokens-only
    router, serve/cancel/api_router.py): JSON listing what it cancelled. The tokens-only
    route's own answers (200 empty, 400 without request_ids) stay at
    /inference/v1/abort_requests."""
    _mesh, first, second = two_fronts
    missing = await post(second + "/inference/v1/abort_requests", {})
    assert missing.status == 400
    assert missing.body == {
        "error": {
            "message": "Missing 'request_ids' in request body",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    }
    body = long_vllm(sampling_params={"max_tokens": LONG, "ignore_eos": True, "n": 2})
    task = asyncio.create_task(
        stream(first + "/inference/v1/generate", body, headers={"X-Request-Id": "v-1"})
    )
    await wait_inflight(first, 2)
    reply = await post(
        second + "/abort_requests", {"request_ids": ["generate-tokens-v-1", "generate-tokens-no"]}
    )
    assert (reply.status, reply.body) == (
        200,
        {"status": "cancelled", "cancelled_request_ids": ["generate-tokens-v-1"]},
    )
    result = await asyncio.wait_for(task, 10)
    assert result.status == 200
    finals = [
        c["finish_reason"]
        for e in result.events
        if isinstance(e, dict)
        for c in e.get("choices", [])
        if c["finish_reason"] is not None
    ]
    assert finals == ["abort", "abort"]


async def test_vllm_tokens_only_abort_answers_empty(two_fronts: Any) -> None:
    _mesh, first, second = two_fronts
    task = asyncio.create_task(
        stream(first + "/inference/v1/generate", long_vllm(), headers={"X-Request-Id": "t-1"})
    )
    await wait_inflight(first, 1)
    reply = await post(
        second + "/inference/v1/abort_requests", {"request_ids": ["generate-tokens-t-1"]}
    )
    assert (reply.status, reply.body) == (200, "")
    result = await asyncio.wait_for(task, 10)
    assert [e for e in result.events if isinstance(e, dict)][-1]["choices"][0][
        "finish_reason"
    ] == "abort"


@pytest.mark.parametrize("body", [{}, {"request_ids": []}, None], ids=["empty", "no-ids", "none"])
async def test_vllm_abort_requests_without_ids_aborts_everything(
    two_fronts: Any, body: Any
) -> None:
    """No IDs on the cancel router's /abort_requests: every in-flight request, of any
    format and through any frontend, is aborted and listed."""
    _mesh, first, second = two_fronts
    vllm = asyncio.create_task(
        stream(first + "/inference/v1/generate", long_vllm(), headers={"X-Request-Id": "all-v"})
    )
    sglang = asyncio.create_task(
        post(first + "/generate", {"input_ids": [1, 2, 3], "rid": "all-s",
                                   "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}})
    )  # fmt: skip
    await wait_inflight(first, 2)
    reply = await post(second + "/abort_requests", body)
    assert reply.status == 200, reply.body
    assert reply.body["status"] == "cancelled"
    assert sorted(reply.body["cancelled_request_ids"]) == ["all-s", "all-v"]
    vllm_result = await asyncio.wait_for(vllm, 10)
    events = [e for e in vllm_result.events if isinstance(e, dict)]
    assert events[-1]["choices"][0]["finish_reason"] == "abort"
    sglang_result = await asyncio.wait_for(sglang, 10)
    assert sglang_result.body["meta_info"]["finish_reason"]["type"] == "abort"


async def test_vllm_batch_cancel_refuses_a_body_that_is_not_a_cancel_request(
    two_fronts: Any,
) -> None:
    _mesh, _first, second = two_fronts
    reply = await post(second + "/v1/requests/cancel", {"request_ids": "generate-tokens-x"})
    assert reply.status == 400
    assert reply.body["error"]["param"] == "body.request_ids"
    assert reply.body["error"]["type"] == "Bad Request"
    assert reply.body["error"]["message"].startswith("1 validation error:\n")
    assert "'type': 'list_type'" in reply.body["error"]["message"]


async def test_vllm_cancel_route(two_fronts: Any) -> None:
    _mesh, first, second = two_fronts
    unknown = await post(second + "/v1/requests/generate-tokens-nobody/cancel", {})
    assert unknown.status == 404
    assert unknown.body["error"]["type"] == "NotFoundError"
    assert unknown.body["error"]["message"] == (
        "Request generate-tokens-nobody not found or already completed."
    )
    generate = post(first + "/inference/v1/generate", long_vllm(request_id="c-1"), headers=JSON)
    task = asyncio.create_task(generate)
    await wait_inflight(first, 1)
    reply = await post(second + "/v1/requests/generate-tokens-c-1", None, method="DELETE")
    assert reply.status == 200
    assert reply.body == {"status": "cancelled", "request_id": "generate-tokens-c-1"}
    result = await asyncio.wait_for(task, 10)
    assert result.body["choices"][0]["finish_reason"] == "abort"


# ------------------------------------------------------------------------ flush_cache


async def cached(url: str, prompt: list[int]) -> int:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}}
    reply = await post(url + "/generate", body)
    assert reply.status == 200, reply.body
    value: int = reply.body["meta_info"]["cached_tokens"]
    return value


async def test_flush_cache_empties_every_workers_cache(two_fronts: Any) -> None:
    _mesh, first, second = two_fronts
    prompt = list(range(100, 164))  # 4 blocks of 16
    # Round robin over two workers: by the third run both have seen the prompt.
    warm = [await cached(first, prompt) for _ in range(4)]
    assert warm[2:] == [48, 48]  # a whole-prompt hit keeps its last block to compute
    for method in ("POST", "GET"):
        async with aiohttp.ClientSession() as s, s.request(method, second + "/flush_cache") as r:
            assert r.status == 200
            assert await r.text() == FLUSH_TEXT + "Flushed on 2 of 2 workers.\n"
    after = [await cached(first, list(range(300, 364)))]  # a fresh prompt: a miss anyway
    after += [await cached(first, prompt) for _ in range(2)]
    assert after == [0, 0, 0]


async def test_flush_is_refused_while_requests_run(two_fronts: Any) -> None:
    _mesh, first, second = two_fronts
    task = asyncio.create_task(post(first + "/generate", long_sglang("busy")))
    await wait_inflight(first, 1)
    async with aiohttp.ClientSession() as s, s.post(second + "/flush_cache") as r:
        text = await r.text()
        assert r.status == 400
    assert text.startswith(FLUSH_TEXT + "Flushed on 1 of 2 workers.\n")
    assert "did not flush: Cache not flushed because there are pending requests" in text
    await post(first + "/abort_request", {"rid": "busy"})
    await asyncio.wait_for(task, 10)


async def test_flush_with_a_silent_worker_fails_within_the_timeout(
    two_fronts: Any, nats_url: str
) -> None:
    """A worker the frontend knows but that never answers (it announced, then hung)."""
    import nats

    mesh, _first, second = two_fronts
    async with aiohttp.ClientSession() as s, s.get(second + "/get_server_info") as r:
        card = (await r.json())["genmesh"]["workers"][0]
    ghost = card | {"id": "ghost", "subject": Subjects(mesh.namespace).worker_generate("ghost")}
    nc = await nats.connect(nats_url)
    try:
        await nc.publish(Subjects(mesh.namespace).announce, get_codec(None).encode(ghost))
        await flush_in_order(nc)
        deadline = time.monotonic() + 5
        while "ghost" not in mesh.worker_ids():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        started = time.monotonic()
        async with aiohttp.ClientSession() as s, s.post(second + "/flush_cache") as r:
            text = await r.text()
            assert r.status == 400
        assert time.monotonic() - started < 4  # --admin-timeout 2
        assert "Flushed on 2 of 3 workers." in text
        assert "Worker ghost did not answer in time." in text
    finally:
        await nc.publish(Subjects(mesh.namespace).leave, get_codec(None).encode({"id": "ghost"}))
        await nc.close()


# ------------------------------------------------------------------------ API keys


async def test_admin_api_key_guards_the_admin_routes(two_fronts: Any) -> None:
    mesh, _, _ = two_fronts
    mesh.add_frontend("--admin-api-key", "adm-secret", name="frontend-keyed")
    url = mesh.http_url
    await wait_ready(url)
    for path, body in (("/abort_request", {"rid": "x"}), ("/abort_requests", {"request_ids": []})):
        refused = await post(url + path, body)
        assert (refused.status, refused.body) == (401, {"error": "Unauthorized"})
        wrong = await post(url + path, body, headers={"Authorization": "Bearer nope"})
        assert wrong.status == 401
        ok = await post(url + path, body, headers={"Authorization": "Bearer adm-secret"})
        assert ok.status == 200
    assert (await post(url + "/flush_cache", {})).status == 401
    # Only the admin routes: generation and probes stay open (no --api-key).
    gen = await post(
        url + "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}
    )
    assert gen.status == 200


async def test_api_key_guards_everything_but_probes(two_fronts: Any) -> None:
    mesh, _, _ = two_fronts
    mesh.add_frontend("--api-key", "k1", name="frontend-api-key")
    url = mesh.http_url
    await wait_ready(url)  # probes need no key
    body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}
    assert (await post(url + "/generate", body)).status == 401
    assert (await post(url + "/generate", body, headers={"x-api-key": "k1"})).status == 200
    assert (await post(url + "/abort_request", {"rid": "x"})).status == 401
    keyed = {"Authorization": "Bearer k1"}
    assert (await post(url + "/abort_request", {"rid": "x"}, headers=keyed)).status == 200
    async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
        assert r.status == 200

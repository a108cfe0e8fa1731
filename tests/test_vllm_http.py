"""vLLM /inference/v1/generate end to end: HTTP client -> frontend -> NATS -> router ->
worker -> back. The shared mesh serves SGLang on /generate and vLLM on its native path."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest
from multidict import CIMultiDict

from genmesh.client import MeshClient, request
from genmesh.engines.base import EngineOutput
from genmesh.engines.mock import (
    MockConfig,
    MockEngine,
    TokenModel,
    advance,
    initial_state,
)
from genmesh.shared.envelope import Envelope
from tests.conftest import unique_namespace
from tests.http_util import Reply, SseReply, parse_sse
from tests.inproc import AnyMesh, worker_requests
from tests.mesh import Mesh, wait_until

pytestmark = pytest.mark.inproc

VOCAB, EOS = 1000, 7  # the shared mesh's mock settings (tests/conftest.py)
PATH = "/inference/v1/generate"
JSON = {"Content-Type": "application/json"}


async def reference(prompt: list[int], **kwargs: Any) -> list[EngineOutput]:
    """What the mock engine generates in-process, for comparison with the mesh."""
    engine = MockEngine(MockConfig(vocab_size=VOCAB, eos_token_id=EOS))
    return [out async for out in engine.generate(request(prompt, **kwargs))]


def tokens_of(outputs: list[EngineOutput]) -> list[int]:
    return [t for out in outputs for t in out.tokens]


async def post(
    mesh: AnyMesh, body: Any, *, headers: dict[str, str] | None = None, path: str = PATH
) -> Reply:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with (
        aiohttp.ClientSession() as session,
        session.post(mesh.http_url + path, data=data, headers={**JSON, **(headers or {})}) as r,
    ):
        text = await r.text()
        try:
            parsed: Any = json.loads(text)
        except ValueError:
            parsed = text
        return Reply(r.status, CIMultiDict(r.headers), parsed)


async def stream(
    mesh: AnyMesh, body: dict[str, Any], headers: dict[str, str] | None = None
) -> SseReply:
    async with (
        aiohttp.ClientSession() as session,
        session.post(mesh.http_url + PATH, json={**body, "stream": True}, headers=headers) as r,
    ):
        raw = await r.text()
        events = parse_sse(raw) if r.content_type == "text/event-stream" else [json.loads(raw)]
        return SseReply(r.status, CIMultiDict(r.headers), events, raw)


def assert_vllm_error(body: Any, status: int, kind: str) -> dict[str, Any]:
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == kind
    assert err["code"] == status
    assert isinstance(err["message"], str)
    assert err["message"]
    return dict(err)


async def test_unary_matches_the_engine(mesh: AnyMesh) -> None:
    prompt = [11, 12, 13, 14]
    reply = await post(
        mesh, {"token_ids": prompt, "sampling_params": {"max_tokens": 12, "ignore_eos": True}}
    )
    assert reply.status == 200, reply.body
    expected = await reference(prompt, max_tokens=12, ignore_eos=True)
    body = reply.body
    assert set(body) == {"request_id", "choices", "usage", "prompt_logprobs", "kv_transfer_params"}
    assert body["choices"] == [
        {
            "index": 0,
            "token_ids": tokens_of(expected),
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
        }
    ]
    assert body["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 12,
        "total_tokens": 16,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert body["prompt_logprobs"] is None
    assert body["kv_transfer_params"] is None
    assert re.fullmatch(r"generate-tokens-[0-9a-f]{32}", body["request_id"])
    assert body["request_id"] == "generate-tokens-" + reply.headers["x-request-id"]


def seed_ending_by_eos_between(prompt: list[int], low: int, high: int) -> tuple[int, int]:
    """A seed whose free run emits EOS first at a position in [low, high)."""
    model = TokenModel(VOCAB)
    for seed in range(1, 100_000):
        state = initial_state(seed)
        for tid in prompt:
            state = advance(state, tid)
        for n in range(high):
            token = model.top(state, 1)[0][0]
            if token == EOS:
                if n >= low:
                    return seed, n + 1
                break
            state = advance(state, token)
    raise AssertionError("no seed found")


async def test_omitted_max_tokens_is_the_server_default_not_16(mesh: AnyMesh) -> None:
    prompt = [3, 3, 3]
    seed, length = seed_ending_by_eos_between(prompt, 20, 200)
    reply = await post(mesh, {"token_ids": prompt, "sampling_params": {"seed": seed}})
    assert reply.status == 200, reply.body
    expected = tokens_of(await reference(prompt, max_tokens=None, seed=seed))
    choice = reply.body["choices"][0]
    assert choice["token_ids"] == expected
    assert len(expected) == length > 16
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] is None  # EOS, not a stop token id


async def test_sse_deltas_without_usage(mesh: AnyMesh) -> None:
    body = {"token_ids": [21, 22, 23], "sampling_params": {"max_tokens": 5, "ignore_eos": True}}
    sse = await stream(mesh, body, headers={"X-Request-Id": "sse-1"})
    assert sse.status == 200
    assert sse.headers["Content-Type"].startswith("text/event-stream")
    assert sse.headers["x-request-id"] == "sse-1"
    assert sse.raw.endswith("data: [DONE]\n\n")
    assert "event:" not in sse.raw
    *chunks, done = sse.events
    assert done == "[DONE]"
    # One chunk per frame (the instant mock: the first token, then the other 4), no usage.
    assert [len(c["choices"][0]["token_ids"]) for c in chunks] == [1, 4]
    for chunk in chunks:
        assert chunk["request_id"] == "generate-tokens-sse-1"
        assert chunk["usage"] is None
        (choice,) = chunk["choices"]
        assert choice["index"] == 0
        assert choice["logprobs"] is None
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "length"]
    unary = await post(mesh, body)
    assert unary.body["choices"][0]["token_ids"] == [
        t for c in chunks for t in c["choices"][0]["token_ids"]
    ]


async def test_sse_usage_chunk_when_stream_options_are_sent(mesh: AnyMesh) -> None:
    body = {
        "token_ids": [21, 22, 23],
        "sampling_params": {"max_tokens": 4, "ignore_eos": True},
        "stream_options": {},
    }
    *chunks, usage_chunk, done = (await stream(mesh, body)).events
    assert done == "[DONE]"
    assert all(c["usage"] is None for c in chunks)
    assert usage_chunk["choices"] == []
    assert usage_chunk["request_id"] == chunks[0]["request_id"]
    assert usage_chunk["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }

    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    *chunks, usage_chunk, done = (await stream(mesh, body)).events
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 4]  # running totals
    assert usage_chunk["usage"]["total_tokens"] == 7

    body["stream_options"] = {"include_usage": False}
    events = (await stream(mesh, body)).events
    assert len(events) == 3  # two chunks and [DONE]: no usage chunk
    assert all(e["choices"] for e in events[:-1])


async def test_logprobs_and_prompt_logprobs_match_the_engine(mesh: AnyMesh) -> None:
    prompt = [40, 41, 42, 43, 44]
    body = {
        "token_ids": prompt,
        "sampling_params": {
            "max_tokens": 4,
            "ignore_eos": True,
            "logprobs": 2,
            "prompt_logprobs": 3,
        },
    }
    reply = await post(mesh, body)
    assert reply.status == 200, reply.body
    expected = await reference(
        prompt,
        max_tokens=4,
        ignore_eos=True,
        logprobs=True,
        top_logprobs=3,
        prompt_logprobs_start=0,
    )
    first = expected[0]
    assert first.prompt_logprobs is not None
    assert first.prompt_top_logprobs is not None
    assert first.prompt_ranks is not None
    plp = reply.body["prompt_logprobs"]
    assert len(plp) == len(prompt)
    assert plp[0] is None
    for pos in range(1, len(prompt)):
        entry = plp[pos]
        token = {"logprob": first.prompt_logprobs[pos], "rank": first.prompt_ranks[pos]}
        want = {str(prompt[pos]): {**token, "decoded_token": None}}
        for place, (tid, lp) in enumerate(first.prompt_top_logprobs[pos] or [], start=1):
            want.setdefault(str(tid), {"logprob": lp, "rank": place, "decoded_token": None})
        assert entry == want
        assert next(iter(entry)) == str(prompt[pos])

    choice = reply.body["choices"][0]
    assert choice["token_ids"] == tokens_of(expected)
    lps = [lp for out in expected for lp in out.logprobs or []]
    tops = [top for out in expected for top in out.top_logprobs or []]
    for entry, token, lp, top in zip(
        choice["logprobs"]["content"], choice["token_ids"], lps, tops, strict=True
    ):
        assert (entry["token_id"], entry["logprob"], entry["rank"]) == (token, lp, 1)
        assert entry["top_logprobs"] == [
            {"token_id": tid, "logprob": alt, "rank": place}
            for place, (tid, alt) in enumerate(top[:2], start=1)
        ]

    # The stream carries the same, as deltas plus the prompt logprobs once.
    events = (await stream(mesh, body)).events
    chunks = [e for e in events if e != "[DONE]"]
    assert chunks[0]["prompt_logprobs"] == plp
    assert [e for c in chunks for e in c["choices"][0]["logprobs"]["content"]] == choice[
        "logprobs"
    ]["content"]


async def test_one_token_prompt_logprobs(mesh: AnyMesh) -> None:
    reply = await post(
        mesh, {"token_ids": [9], "sampling_params": {"max_tokens": 2, "prompt_logprobs": 2}}
    )
    assert reply.status == 200, reply.body
    assert reply.body["prompt_logprobs"] == [None]


async def test_stop_token_ids_set_stop_reason(mesh: AnyMesh) -> None:
    prompt = [100, 200, 300]
    free_run = tokens_of(await reference(prompt, max_tokens=10, ignore_eos=True))
    stop = free_run[3]
    assert stop not in free_run[:3]
    reply = await post(
        mesh, {"token_ids": prompt, "sampling_params": {"max_tokens": 10, "stop_token_ids": [stop]}}
    )
    choice = reply.body["choices"][0]
    assert choice["token_ids"] == free_run[:4]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)


async def test_n_samples(mesh: AnyMesh) -> None:
    prompt = [5, 6, 7, 8]
    params = {"max_tokens": 6, "n": 2, "seed": 41, "ignore_eos": True, "logprobs": 0}
    body = {"token_ids": prompt, "sampling_params": params}
    reply = await post(mesh, body)
    assert reply.status == 200, reply.body
    choices = reply.body["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for i, choice in enumerate(choices):
        # Sample i is what vLLM V1 gives child i: seed + i.
        expected = await reference(prompt, max_tokens=6, ignore_eos=True, seed=41 + i)
        assert choice["token_ids"] == tokens_of(expected)
        assert len(choice["logprobs"]["content"]) == 6
    assert choices[0]["token_ids"] != choices[1]["token_ids"]
    assert reply.body["usage"]["completion_tokens"] == 12
    assert reply.body["usage"]["prompt_tokens"] == 4

    sse = await stream(mesh, {**body, "stream_options": {}})
    *chunks, usage_chunk, done = sse.events
    assert done == "[DONE]"
    for i in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert [t for c in mine for t in c["token_ids"]] == choices[i]["token_ids"]
        assert mine[-1]["finish_reason"] == "length"
    assert usage_chunk["usage"]["completion_tokens"] == 12


async def test_model_is_checked(mesh: AnyMesh) -> None:
    body = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}}
    ok = await post(mesh, {**body, "model": "genmesh-mock"})
    assert ok.status == 200, ok.body
    for reply in (
        await post(mesh, {**body, "model": "no-such-model"}),
        await stream(mesh, {**body, "model": "no-such-model"}),
    ):
        assert reply.status == 404
        body_json = reply.body if isinstance(reply, Reply) else reply.events[0]
        err = assert_vllm_error(body_json, 404, "NotFoundError")
        assert err["message"] == "The model `no-such-model` does not exist."
        assert err["param"] == "model"


async def test_request_id_echo(mesh: AnyMesh) -> None:
    body = {"token_ids": [1], "sampling_params": {"max_tokens": 1}, "request_id": "body-id"}
    reply = await post(mesh, body)
    assert reply.body["request_id"] == "generate-tokens-body-id"
    assert reply.headers["x-request-id"] == "body-id"

    reply = await post(mesh, body, headers={"X-Request-Id": "  header-id "})
    assert reply.body["request_id"] == "generate-tokens-header-id"
    assert reply.headers["x-request-id"] == "header-id"

    a = await post(mesh, {"token_ids": [1], "sampling_params": {"max_tokens": 1}})
    b = await post(mesh, {"token_ids": [1], "sampling_params": {"max_tokens": 1}})
    assert a.body["request_id"] != b.body["request_id"]
    public = a.headers["x-request-id"]
    assert a.body["request_id"] == f"generate-tokens-{public}"
    # vLLM's random_uuid(): a UUID4, as 32 hex digits.
    assert re.fullmatch(r"[0-9a-f]{32}", public)
    assert uuid.UUID(hex=public).version == 4
    # The public ID is minted at the frontend and never addresses anything: workers see it
    # only as the envelope's client_id (what an abort by ID matches), never as its id.
    async with worker_requests(mesh.nats_url, mesh.namespace) as seen:
        c = await post(mesh, {"token_ids": [1], "sampling_params": {"max_tokens": 1}})
    assert c.status == 200
    assert seen  # the request did reach a worker
    public_c = c.headers["x-request-id"]
    envelopes = [msgpack.unpackb(data) for data in seen]
    assert [e["client_id"] for e in envelopes] == [public_c] * len(envelopes)
    assert all(e["id"] != public_c for e in envelopes)


async def test_routing_headers_and_fields_are_accepted(mesh: AnyMesh) -> None:
    reply = await post(
        mesh,
        {
            "token_ids": [1, 2],
            "sampling_params": {"max_tokens": 2, "structured_outputs": None, "extra_args": {}},
            "priority": -5,
            "cache_salt": "tenant",
            "kv_transfer_params": {"do_remote_decode": False},
        },
        headers={"X-data-parallel-rank": "not-a-number"},
    )
    assert reply.status == 200, reply.body
    # The mock reports no KV transfer: only what an engine returns is echoed.
    assert reply.body["kv_transfer_params"] is None


# vLLM validates the body with pydantic: a failure is its RequestValidationError
# handler's answer (type "Bad Request", every pydantic error listed, param = the location).
@pytest.mark.parametrize(
    ("body", "fragment", "param"),
    [
        ({"token_ids": [], "sampling_params": {}}, "at least 1 item", "body.token_ids"),
        ({"token_ids": [1, -2], "sampling_params": {}}, "token_ids must not contain negative",
         "body.token_ids"),
        ({"token_ids": [1]}, "'loc': 'body.sampling_params', 'msg': 'Field required'",
         "body.sampling_params"),
        ({"sampling_params": {}}, "'loc': 'body.token_ids', 'msg': 'Field required'",
         "body.token_ids"),
        ({"token_ids": [1], "sampling_params": {"top_p": 1.5}}, "top_p must be in (0, 1]",
         "top_p"),
        ({"token_ids": [1], "sampling_params": {"max_tokens": 0}},
         "max_tokens must be at least 1", "max_tokens"),
        ({"token_ids": [1], "sampling_params": {"n": 0}}, "n must be at least 1",
         "body.sampling_params"),
        ({"token_ids": [1], "sampling_params": {"temperature": "x"}},
         "unable to parse string as a number", "body.sampling_params"),
        ({"token_ids": [1], "sampling_params": {}, "priority": "high"},
         "unable to parse string as an integer", "body.priority"),
        ({"token_ids": [1], "sampling_params": {}, "priority": 2**70},
         "less than or equal to 9223372036854775807", "body.priority"),
    ],
)  # fmt: skip
async def test_invalid_requests_get_vllms_validation_errors(
    mesh: AnyMesh, body: dict[str, Any], fragment: str, param: str
) -> None:
    for streaming in (False, True):
        reply = await post(mesh, {**body, "stream": streaming})
        assert reply.status == 400, reply.body
        err = assert_vllm_error(reply.body, 400, "Bad Request")
        assert re.match(r"[0-9]+ validation errors?:\n", err["message"])
        assert fragment in err["message"]
        assert err["param"] == param


async def test_unknown_fields_are_ignored_as_vllm_ignores_them(mesh: AnyMesh) -> None:
    """What sglang-router or a newer client adds (`return_bytes`, a new sampling key, a new
    stream option) does not fail the request: vLLM drops what it does not know."""
    body = {
        "token_ids": [5, 6],
        "sampling_params": {"max_tokens": 3, "max_new_tokens": 9, "seed": 1},
        "return_bytes": False,
        "bogus": 1,
        "stream_options": {"include_usage": True, "future_option": 1},
    }
    reply = await post(mesh, body)
    assert reply.status == 200, reply.body
    assert reply.body["choices"][0]["token_ids"] == tokens_of(
        await reference([5, 6], max_tokens=3, seed=1)
    )


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        # Accepted by vLLM, refused here by value: this server cannot deliver it.
        ({"token_ids": [1], "sampling_params": {"stop": ["x"]}}, "stop strings"),
        ({"token_ids": [1], "sampling_params": {"n": 257}}, "max_num_seqs (256)"),
        # Refused by the engine (the mock), after dispatch, still in vLLM's envelope.
        ({"token_ids": [1, 5000], "sampling_params": {}}, "outside the vocabulary"),
        (
            {"token_ids": [1], "sampling_params": {"structured_outputs": {"regex": "a+"}}},
            "guided decoding",
        ),
        # vLLM's own refusal: the mock states max_logprobs 20 in its card.
        (
            {"token_ids": [1], "sampling_params": {"logprobs": 21}},
            "Requested sample logprobs of 21, which is greater than max allowed: 20",
        ),
        (
            {"token_ids": [1], "sampling_params": {"prompt_logprobs": -1}},
            "Requested prompt logprobs of 1000, which is greater than max allowed: 20",
        ),
    ],
)
async def test_bad_requests_get_vllm_errors(
    mesh: AnyMesh, body: dict[str, Any], fragment: str
) -> None:
    for streaming in (False, True):
        reply = await post(mesh, {**body, "stream": streaming})
        assert reply.status == 400, reply.body
        err = assert_vllm_error(reply.body, 400, "BadRequestError")
        assert fragment in err["message"]


@pytest.mark.parametrize(
    ("data", "headers"),
    [
        (b"{not json", JSON),
        (b"[1, 2]", JSON),
        (b'{"token_ids": "abc", "sampling_params": {}}', JSON),
        (b'{"token_ids": [1], "sampling_params": {}, "stream": "maybe"}', JSON),
        (b'{"token_ids": [1], "sampling_params": {}}', {"Content-Type": "text/plain"}),
    ],
)
async def test_malformed_bodies(mesh: AnyMesh, data: bytes, headers: dict[str, str]) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.post(mesh.http_url + PATH, data=data, headers=headers) as r,
    ):
        assert r.status == 400
        assert_vllm_error(await r.json(), 400, "Bad Request")


async def test_get_is_not_served(mesh: AnyMesh) -> None:
    async with aiohttp.ClientSession() as session, session.get(mesh.http_url + PATH) as r:
        assert r.status == 405


async def test_sglang_is_still_served_on_generate(mesh: AnyMesh) -> None:
    reply = await post(
        mesh, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}, path="/generate"
    )
    assert reply.status == 200, reply.body
    assert len(reply.body["output_ids"]) == 2


# ------------------------------------------------------------------ cancellation


@pytest.fixture
def slow_mesh(nats_url: str, tmp_path: Path) -> Iterator[Mesh]:
    mesh = Mesh(nats_url, tmp_path, unique_namespace("vllm"))
    mesh.add_router()
    mesh.add_frontend()
    yield mesh
    mesh.stop()


def _card(mesh: AnyMesh, worker_id: str) -> dict[str, Any]:
    for worker in mesh.server_info()["genmesh"]["workers"]:
        if worker["id"] == worker_id:
            return dict(worker)
    raise KeyError(worker_id)


@pytest.mark.process
async def test_client_disconnect_cancels_at_the_worker(slow_mesh: Mesh) -> None:
    worker = slow_mesh.add_worker(speedup=0.05)
    body = {
        "token_ids": [1, 2],
        "sampling_params": {"max_tokens": 2000, "ignore_eos": True},
        "stream": True,
    }
    async with (
        aiohttp.ClientSession() as s,
        s.post(slow_mesh.http_url + PATH, json=body) as r,
    ):
        assert r.status == 200
        first = await r.content.readuntil(b"\n\n")
        assert first.startswith(b"data: {")
        # Leaving the block drops the connection mid-stream.

    def cancelled() -> bool:
        card = _card(slow_mesh, worker.name)
        return bool(card["stats"]["cancelled"] > 0 and card["inflight"] == 0)

    await asyncio.to_thread(wait_until, cancelled, 5.0, 0.02, "the worker to cancel")
    assert _card(slow_mesh, worker.name)["stats"]["completed"] == 0


async def test_max_tokens_beyond_the_context_is_refused_as_newest_vllm_does(mesh: AnyMesh) -> None:
    """The workers advertise their context length (the mock: 32768); vLLM's tokens route
    answers 400 for a max_tokens that does not fit instead of capping it (it guards an
    int32 overflow that once killed vLLM's engine, vllm-project/vllm#54175)."""
    for streaming in (False, True):
        body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 32766}}
        reply = await post(mesh, {**body, "stream": streaming})
        assert reply.status == 400, reply.body
        err = assert_vllm_error(reply.body, 400, "BadRequestError")
        assert err["message"] == (
            "'max_tokens' or 'max_completion_tokens' is too large: 32766. This model's "
            "maximum context length is 32768 tokens and your request has 3 input tokens "
            "(32766 > 32768 - 3)."
        )
        reply = await post(mesh, {"token_ids": [1] * 32769, "sampling_params": {}})
        assert reply.status == 400, reply.body
        err = assert_vllm_error(reply.body, 400, "BadRequestError")
        assert (
            err["message"] == "Input length (32769) exceeds model's maximum context length (32768)."
        )
    # What fits is served.
    body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 32765, "seed": 3}}
    reply = await post(mesh, body)
    assert reply.status == 200, reply.body


async def test_return_token_ids_gives_the_prompt_back(mesh: AnyMesh) -> None:
    """Newest vLLM: `return_token_ids` puts `prompt_token_ids` in the unary body and in the
    first SSE chunk only; without it there is no such field (as before)."""
    body = {"token_ids": [31, 32, 33], "sampling_params": {"max_tokens": 3, "ignore_eos": True}}
    plain = await post(mesh, body)
    assert "prompt_token_ids" not in plain.body
    unary = await post(mesh, {**body, "return_token_ids": True})
    assert unary.status == 200, unary.body
    assert unary.body["prompt_token_ids"] == [31, 32, 33]
    assert unary.body["choices"] == plain.body["choices"]
    sse = await stream(mesh, {**body, "return_token_ids": True})
    *chunks, done = sse.events
    assert done == "[DONE]"
    assert [c.get("prompt_token_ids") for c in chunks] == [[31, 32, 33]] + [None] * (
        len(chunks) - 1
    )
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == (
        plain.body["choices"][0]["token_ids"]
    )


# Two images on a 40-token prompt, as vLLM's /render gives them.
MM_FEATURES: dict[str, Any] = {
    "mm_hashes": {"image": ["a" * 64, "b" * 64]},
    "mm_placeholders": {"image": [{"offset": 4, "length": 8}, {"offset": 20, "length": 8}]},
    "kwargs_data": {"image": ["YQ==", "Yg=="]},
}
MM_PROMPT = list(range(100, 140))


async def test_multimodal_features_are_served_and_reach_the_worker(mesh: AnyMesh) -> None:
    """The mock has no vision model: it answers a features request with the tokens of its
    prompt alone; the worker receives the features as the client sent them."""
    body = {"token_ids": MM_PROMPT, "sampling_params": {"max_tokens": 5, "ignore_eos": True}}
    text_only = await post(mesh, body)
    async with worker_requests(mesh.nats_url, mesh.namespace) as seen:
        reply = await post(mesh, {**body, "features": MM_FEATURES, "return_token_ids": True})
    assert reply.status == 200, reply.body
    assert reply.body["choices"] == text_only.body["choices"]
    assert reply.body["prompt_token_ids"] == MM_PROMPT
    assert reply.body["mm_placeholders"] == MM_FEATURES["mm_placeholders"]
    envelopes = [msgpack.unpackb(data) for data in seen]
    assert [e["engine"]["features"] for e in envelopes] == [MM_FEATURES]


async def test_overlapping_placeholders_are_refused_as_vllm_refuses_them(mesh: AnyMesh) -> None:
    features = {
        **MM_FEATURES,
        "mm_placeholders": {"image": [{"offset": 4, "length": 8}, {"offset": 8, "length": 8}]},
    }
    reply = await post(
        mesh, {"token_ids": MM_PROMPT, "sampling_params": {"max_tokens": 5}, "features": features}
    )
    message = "mm_placeholders must be globally non-overlapping and sorted"
    assert reply.status == 400
    assert reply.body == {
        "error": {
            "message": "1 validation error:\n  {'type': 'value_error', 'loc': 'body.features', "
            f"'msg': 'Value error, {message}', 'input': '<dict of 3 items>', "
            f"'ctx': {{'error': ValueError('{message}')}}}}",
            "type": "Bad Request",
            "param": "body.features",
            "code": 400,
        }
    }


async def test_a_nats_clients_bad_features_are_refused_by_the_mock_in_vllms_words(
    mesh: AnyMesh,
) -> None:
    """No format checks an envelope a NATS-level client sends: the router routes it (on
    its tokens alone) and the mock engine refuses the layout as vLLM would."""

    def envelope(features: dict[str, Any]) -> Envelope:
        env = request(MM_PROMPT, max_tokens=2)
        env.format = "vllm"
        env.engine = {"features": features}
        return env

    bad = {**MM_FEATURES, "mm_hashes": {"image": ["a" * 64]}}
    async with await MeshClient.connect(mesh.nats_url, mesh.namespace) as client:
        frames = [f async for f in client.generate(envelope(bad))]
        served = [f async for f in client.generate(envelope(MM_FEATURES))]
    assert frames[-1]["t"] == "err"
    assert frames[-1]["code"] == "invalid_argument"
    assert frames[-1]["message"] == "image mm_hashes and mm_placeholders must have the same length"
    assert served[-1]["t"] == "end", served[-1]

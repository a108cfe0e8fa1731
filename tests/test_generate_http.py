"""SGLang /generate end to end: HTTP client -> frontend -> NATS -> router -> worker -> back."""

from __future__ import annotations

import base64
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from genmesh.client import request
from genmesh.engines.base import EngineOutput
from genmesh.engines.mock import (
    MockConfig,
    MockEngine,
    TokenModel,
    advance,
    initial_state,
)
from tests.conftest import unique_namespace
from tests.http_util import post, stream
from tests.inproc import AnyMesh, worker_requests
from tests.mesh import Mesh, start_mesh, wait_until

pytestmark = pytest.mark.inproc

VOCAB, EOS = 1000, 7  # the shared mesh's mock settings (tests/conftest.py)


@pytest.fixture
def own_worker_mesh(nats_url: str, tmp_path: Path) -> Iterator[Mesh]:
    """A mesh of its own with one slow worker, for tests that watch worker counters."""
    own = start_mesh(
        nats_url,
        tmp_path,
        namespace=unique_namespace("slow"),
        workers=1,
        worker_opts={"speedup": 0.05},
    )
    yield own
    own.stop()


async def reference(prompt: list[int], **kwargs: Any) -> list[EngineOutput]:
    """What the mock engine generates in-process, for comparison with the mesh."""
    engine = MockEngine(MockConfig(vocab_size=VOCAB, eos_token_id=EOS))
    return [out async for out in engine.generate(request(prompt, **kwargs))]


def tokens_of(outputs: list[EngineOutput]) -> list[int]:
    return [t for out in outputs for t in out.tokens]


def seed_whose_first_token_is(token: int, prompt: list[int]) -> int:
    model = TokenModel(VOCAB)
    for seed in range(1, 200_000):
        state = initial_state(seed)
        for tid in prompt:
            state = advance(state, tid)
        if model.top(state, 1)[0][0] == token:
            return seed
    raise AssertionError("no seed found")


async def test_unary_matches_the_engine(mesh: AnyMesh) -> None:
    prompt = [11, 12, 13, 14]
    reply = await post(
        mesh.http_url + "/generate",
        {"input_ids": prompt, "sampling_params": {"max_new_tokens": 12, "ignore_eos": True}},
    )
    assert reply.status == 200, reply.body
    expected = await reference(prompt, max_tokens=12, ignore_eos=True)
    assert reply.body["output_ids"] == tokens_of(expected)
    meta = reply.body["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["prompt_tokens"] == 4
    assert meta["completion_tokens"] == 12
    assert meta["cached_tokens"] == 0
    assert isinstance(meta["e2e_latency"], float)
    assert meta["e2e_latency"] >= 0
    assert "text" not in reply.body  # a tokenizer-less server sends no text
    assert "input_token_logprobs" not in meta  # no logprob keys unless asked


async def test_put_is_served_like_post(mesh: AnyMesh) -> None:
    body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3}}
    a = await post(mesh.http_url + "/generate", body)
    b = await post(mesh.http_url + "/generate", body, method="PUT")
    assert a.status == b.status == 200
    assert a.body["output_ids"] == b.body["output_ids"]


async def test_every_worker_gives_the_same_answer(mesh: AnyMesh) -> None:
    body = {"input_ids": [3, 1, 4, 1, 5], "sampling_params": {"max_new_tokens": 8}}
    before = {w["id"]: w["stats"]["admitted"] for w in mesh.server_info()["genmesh"]["workers"]}
    outputs = {
        tuple((await post(mesh.http_url + "/generate", body)).body["output_ids"]) for _ in range(6)
    }
    assert len(outputs) == 1

    def every_worker_served() -> bool:
        workers = mesh.server_info()["genmesh"]["workers"]
        return all(w["stats"]["admitted"] > before[w["id"]] for w in workers)

    wait_until(every_worker_served, timeout=5, what="round robin to use every worker")


async def test_sse_is_incremental_and_folds_to_the_unary_body(mesh: AnyMesh) -> None:
    body = {
        "input_ids": [21, 22, 23],
        "sampling_params": {"max_new_tokens": 6, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": 2,
    }
    sse = await stream(mesh.http_url + "/generate", body)
    assert sse.status == 200
    assert sse.headers["Content-Type"].startswith("text/event-stream")
    assert sse.raw.endswith("data: [DONE]\n\n")
    assert "event:" not in sse.raw
    assert "\nid:" not in sse.raw
    events = sse.events
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    # Deltas, one per frame: the instant mock sends the first token alone, then the rest.
    assert [len(c["output_ids"]) for c in chunks] == [1, 5]
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == [1, 6]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert all("e2e_latency" not in c["meta_info"] for c in chunks[:-1])
    assert "e2e_latency" in chunks[-1]["meta_info"]
    for c in chunks:
        meta = c["meta_info"]
        assert len(meta["output_token_logprobs"]) == len(c["output_ids"])
        assert [t for _, t, _ in meta["output_token_logprobs"]] == c["output_ids"]
        assert meta["input_token_logprobs"] == [[None, 23, None]]  # repeated on every chunk
    unary = await post(mesh.http_url + "/generate", body)
    assert unary.status == 200
    assert unary.body["output_ids"] == [t for c in chunks for t in c["output_ids"]]
    meta = unary.body["meta_info"]
    assert meta["output_token_logprobs"] == [
        lp for c in chunks for lp in c["meta_info"]["output_token_logprobs"]
    ]
    assert meta["output_top_logprobs"] == [
        top for c in chunks for top in c["meta_info"]["output_top_logprobs"]
    ]
    assert meta["completion_tokens"] == 6
    assert meta["input_token_logprobs"] == [[None, 23, None]]


async def test_a_32k_token_prompt_streams_through_the_mesh(mesh: AnyMesh) -> None:
    """The prompt crosses the bus as one packed bin; the mock's answer is what it was when
    the prompt crossed as a list (the golden tokens were computed before the change)."""
    prompt = [(7 * i + 1) % VOCAB for i in range(32_000)]
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 8, "ignore_eos": True, "sampling_seed": 5},
        "return_logprob": True,
        "logprob_start_len": 31_990,
        "return_prompt_token_ids": True,
    }
    sse = await stream(mesh.http_url + "/generate", body)
    assert sse.status == 200, sse.raw[:300]
    chunks = sse.events[:-1]
    assert [t for c in chunks for t in c["output_ids"]] == [640, 885, 826, 392, 912, 751, 604, 563]
    meta = chunks[-1]["meta_info"]
    assert meta["prompt_tokens"] == 32_000
    assert [lp for lp, _, _ in meta["input_token_logprobs"][:3]] == [None, -6.502, -9.867]
    assert [tid for _, tid, _ in meta["input_token_logprobs"]] == prompt[31_990:]
    assert all(c["prompt_token_ids"] == prompt for c in chunks)
    expected = await reference(prompt, max_tokens=8, ignore_eos=True, seed=5)
    assert tokens_of(expected) == [640, 885, 826, 392, 912, 751, 604, 563]


async def test_logprobs_match_the_engine(mesh: AnyMesh) -> None:
    prompt = [40, 41, 42, 43, 44]
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 3,
    }
    reply = await post(mesh.http_url + "/generate", body)
    assert reply.status == 200, reply.body
    meta = reply.body["meta_info"]
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
    assert meta["input_token_logprobs"] == [
        [lp, tid, None] for lp, tid in zip(first.prompt_logprobs, prompt, strict=True)
    ]
    assert meta["input_token_logprobs"][0][0] is None
    assert meta["input_top_logprobs"][0] is None
    assert meta["input_top_logprobs"][1] == [
        [lp, t, None] for t, lp in first.prompt_top_logprobs[1] or []
    ]
    out_lps = [lp for out in expected for lp in out.logprobs or []]
    assert meta["output_token_logprobs"] == [
        [lp, t, None] for lp, t in zip(out_lps, tokens_of(expected), strict=True)
    ]
    for top, (_, token, _) in zip(
        meta["output_top_logprobs"], meta["output_token_logprobs"], strict=True
    ):
        assert len(top) == 3
        assert top[0][1] == token  # the mock decodes greedily
        assert top[0][0] >= top[1][0] >= top[2][0]


async def test_logprob_start_len_default_gives_one_input_entry(mesh: AnyMesh) -> None:
    reply = await post(
        mesh.http_url + "/generate",
        {"input_ids": [1, 2, 9], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True},
    )
    assert reply.status == 200
    meta = reply.body["meta_info"]
    assert meta["input_token_logprobs"] == [[None, 9, None]]
    assert "input_top_logprobs" not in meta  # only with top_logprobs_num > 0


async def test_stop_token_ids_end_generation(mesh: AnyMesh) -> None:
    prompt = [100, 200, 300]
    free_run = tokens_of(await reference(prompt, max_tokens=10, ignore_eos=True))
    stop = free_run[3]
    assert stop not in free_run[:3], "pick a prompt whose 4th token is new"
    reply = await post(
        mesh.http_url + "/generate",
        {"input_ids": prompt, "sampling_params": {"max_new_tokens": 10, "stop_token_ids": [stop]}},
    )
    assert reply.status == 200
    assert reply.body["output_ids"] == free_run[:4]  # the matched token is included
    assert reply.body["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert reply.body["meta_info"]["completion_tokens"] == 4


async def test_min_new_tokens_masks_stop_tokens(mesh: AnyMesh) -> None:
    prompt = [100, 200, 300]
    free_run = tokens_of(await reference(prompt, max_tokens=10, ignore_eos=True))
    stop = free_run[0]
    reply = await post(
        mesh.http_url + "/generate",
        {
            "input_ids": prompt,
            "sampling_params": {
                "max_new_tokens": 10,
                "min_new_tokens": 3,
                "stop_token_ids": [stop],
            },
        },
    )
    assert reply.status == 200
    out = reply.body["output_ids"]
    assert stop not in out[:3]
    assert len(out) >= 3


async def test_eos_ends_generation_unless_ignored(mesh: AnyMesh) -> None:
    prompt = [5, 5, 5]
    seed = seed_whose_first_token_is(EOS, prompt)
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 5, "sampling_seed": seed}}
    reply = await post(mesh.http_url + "/generate", body)
    assert reply.status == 200
    assert reply.body["output_ids"] == [EOS]
    assert reply.body["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}
    body["sampling_params"]["ignore_eos"] = True
    reply = await post(mesh.http_url + "/generate", body)
    assert len(reply.body["output_ids"]) == 5
    assert reply.body["output_ids"][0] == EOS


async def test_zero_new_tokens(mesh: AnyMesh) -> None:
    reply = await post(
        mesh.http_url + "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}}
    )
    assert reply.status == 200
    assert reply.body["output_ids"] == []
    assert reply.body["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert reply.body["meta_info"]["completion_tokens"] == 0


async def test_rid_is_echoed_and_private_id_stays_inside(mesh: AnyMesh) -> None:
    reply = await post(
        mesh.http_url + "/generate",
        {"rid": "my-request-1", "input_ids": [1], "sampling_params": {"max_new_tokens": 1}},
    )
    assert reply.body["meta_info"]["id"] == "my-request-1"
    assert reply.headers["x-request-id"] == "my-request-1"

    reply = await post(
        mesh.http_url + "/generate",
        {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}},
        headers={"X-Request-Id": "from-header"},
    )
    assert reply.body["meta_info"]["id"] == "from-header"
    assert reply.headers["x-request-id"] == "from-header"

    a = await post(
        mesh.http_url + "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}
    )
    b = await post(
        mesh.http_url + "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}
    )
    public_a, public_b = a.body["meta_info"]["id"], b.body["meta_info"]["id"]
    assert re.fullmatch(r"[0-9a-f]{32}", public_a)
    assert public_a != public_b
    assert a.headers["x-request-id"] == public_a
    # The public ID is minted at the frontend and never addresses anything: workers see it
    # only as the envelope's client_id (what an abort by ID matches), never as its id.
    async with worker_requests(mesh.nats_url, mesh.namespace) as seen:
        c = await post(
            mesh.http_url + "/generate",
            {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}},
        )
    assert c.status == 200
    assert seen  # the request did reach a worker
    public_c = c.body["meta_info"]["id"]
    envelopes = [msgpack.unpackb(data) for data in seen]
    assert [e["client_id"] for e in envelopes] == [public_c] * len(envelopes)
    assert all(e["id"] != public_c for e in envelopes)


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        ({"text": "hello"}, 400, "cannot accept text prompts"),
        ({}, 400, "Either text, input_ids or input_embeds should be provided."),
        ({"input_ids": []}, 400, "input_ids cannot be empty."),
        ({"input_ids": [[1, 2], []]}, 400, "input_ids cannot be empty."),
        ({"input_ids": [1], "sampling_params": [{}, {}]}, 400, "should be a scalar"),
        ({"input_ids": [[1], [2]], "sampling_params": [{}]}, 400, "equal to the batch size"),
        ({"input_ids": [[1], [2]], "rid": ["a", "a"]}, 400, "Duplicate request IDs"),
        (
            {"input_ids": [[1], [2]], "sampling_params": [{"n": 1}, {"n": 2}]},
            400,
            "parallel_sample_num should be the same",
        ),
        ({"input_ids": [1], "sampling_params": {"n": 0}}, 400, "n must be at least 1"),
        ({"input_ids": [1], "bootstrap_room": 5}, 400, "bootstrap_room"),
        (
            {"input_ids": [1], "sampling_params": {"top_p": 1.5}},
            400,
            "top_p must be in (0, 1], got 1.5.",
        ),
        ({"input_ids": [1], "sampling_params": {"stop": ["x"]}}, 400, "skip_tokenizer_init=True"),
        (
            {"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 3}},
            400,
            "min_new_tokens must be in [0, max_new_tokens(2)], got 3.",
        ),
        (
            {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2},
            400,
            "req.logprob_start_len=2 is higher than the number of input tokens",
        ),
        ({"input_ids": [1, 5000]}, 400, "outside the vocabulary"),
        ({"input_ids": [1], "sampling_params": {"json_schema": "{}"}}, 400, "guided decoding"),
        ({"input_ids": [1], "lora_path": "x"}, 400, "lora_path"),
    ],
)
async def test_bad_requests_get_sglang_errors(
    mesh: AnyMesh, body: dict[str, Any], status: int, fragment: str
) -> None:
    for streaming in (False, True):
        reply = await post(mesh.http_url + "/generate", {**body, "stream": streaming})
        assert reply.status == status, reply.body
        assert set(reply.body) == {"error"}, reply.body
        assert fragment in reply.body["error"]["message"]


@pytest.mark.parametrize(
    "raw",
    [
        b"{not json",
        b"[1, 2]",
        b'{"input_ids": "abc"}',
        b'{"input_ids": [1, "x"]}',
        b'{"input_ids": [1], "stream": "maybe"}',
        b'{"input_ids": [1], "sampling_params": {"max_new_tokens": "many"}}',
    ],
)
async def test_malformed_bodies_get_the_legacy_shape(mesh: AnyMesh, raw: bytes) -> None:
    reply = await post(mesh.http_url + "/generate", raw)
    assert reply.status == 400
    assert reply.body["object"] == "error"
    assert reply.body["type"] == "Bad Request"
    assert reply.body["code"] == 400
    assert reply.body["param"] is None
    assert reply.body["message"]


async def test_engine_rejection_before_streaming_keeps_its_status(mesh: AnyMesh) -> None:
    sse = await stream(mesh.http_url + "/generate", {"input_ids": [999_999]})
    assert sse.status == 400
    assert "vocabulary" in sse.events[0]["error"]["message"]


async def test_info_endpoints_look_like_sglang(mesh: AnyMesh) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        async with s.get(mesh.http_url + "/health") as r:
            assert r.status == 200
        async with s.get(mesh.http_url + "/health_generate") as r:
            assert r.status == 200
        for path in ("/get_model_info", "/model_info"):
            async with s.get(mesh.http_url + path) as r:
                info = await r.json()
            assert info["model_path"] == "genmesh-mock"
            assert info["is_generation"] is True
            assert {"tokenizer_path", "preferred_sampling_params", "weight_version"} <= set(info)
        for path in ("/get_server_info", "/server_info"):
            async with s.get(mesh.http_url + path) as r:
                info = await r.json()
            assert info["skip_tokenizer_init"] is True
            assert info["incremental_streaming_output"] is True
            assert info["disaggregation_mode"] == "null"
            assert len(info["genmesh"]["workers"]) == 2
        async with s.get(mesh.http_url + "/v1/models") as r:
            models = await r.json()
        assert models["object"] == "list"
        assert models["data"][0]["id"] == "genmesh-mock"


async def test_batch_answers_in_input_order_with_rid_suffixes(mesh: AnyMesh) -> None:
    prompts = [[1, 2, 3], [4, 5], [6]]
    reply = await post(
        mesh.http_url + "/generate",
        {"input_ids": prompts, "rid": "job", "sampling_params": {"max_new_tokens": 4}},
    )
    assert reply.status == 200, reply.body
    assert isinstance(reply.body, list)
    assert [item["meta_info"]["id"] for item in reply.body] == ["job_0", "job_1", "job_2"]
    assert reply.headers["x-request-id"] == "job"
    for prompt, item in zip(prompts, reply.body, strict=True):
        assert item["output_ids"] == tokens_of(await reference(prompt, max_tokens=4))
        assert item["meta_info"]["prompt_tokens"] == len(prompt)


async def test_batch_with_per_prompt_fields(mesh: AnyMesh) -> None:
    reply = await post(
        mesh.http_url + "/generate",
        {
            "input_ids": [[1, 2], [3, 4]],
            "rid": ["a", "b"],
            "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 3}],
            "return_logprob": [False, True],
        },
    )
    assert reply.status == 200, reply.body
    first, second = reply.body
    assert (first["meta_info"]["id"], second["meta_info"]["id"]) == ("a", "b")
    assert len(first["output_ids"]) == 1
    assert len(second["output_ids"]) == 3
    assert "output_token_logprobs" not in first["meta_info"]
    assert len(second["meta_info"]["output_token_logprobs"]) == 3


async def test_n_samples_are_contiguous_per_prompt(mesh: AnyMesh) -> None:
    reply = await post(
        mesh.http_url + "/generate",
        {"input_ids": [[1, 2], [3]], "rid": "r", "sampling_params": {"max_new_tokens": 2, "n": 3}},
    )
    assert reply.status == 200, reply.body
    assert len(reply.body) == 6
    assert [item["meta_info"]["prompt_tokens"] for item in reply.body] == [2, 2, 2, 1, 1, 1]
    ids = [item["meta_info"]["id"] for item in reply.body]
    assert len(set(ids)) == 6  # with n > 1 SGLang gives every sample a fresh id
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)


async def test_batch_stream_interleaves_with_index(mesh: AnyMesh) -> None:
    body = {"input_ids": [[1, 2], [3, 4, 5]], "sampling_params": {"max_new_tokens": 5}}
    sse = await stream(mesh.http_url + "/generate", body)
    assert sse.status == 200
    assert sse.events[-1] == "[DONE]"
    chunks = sse.events[:-1]
    assert {c["index"] for c in chunks} == {0, 1}
    unary = await post(mesh.http_url + "/generate", body)
    for index in (0, 1):
        mine = [c for c in chunks if c["index"] == index]
        assert [t for c in mine for t in c["output_ids"]] == unary.body[index]["output_ids"]
        assert mine[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


async def test_routed_experts_match_the_engine(mesh: AnyMesh) -> None:
    prompt = [7, 8, 9, 10]
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 5, "ignore_eos": True},
        "return_routed_experts": True,
        "routed_experts_start_len": 1,
    }
    reply = await post(mesh.http_url + "/generate", body)
    assert reply.status == 200, reply.body
    outputs = await reference(prompt, max_tokens=5, ignore_eos=True)
    engine = MockEngine(MockConfig())
    layers, top_k = engine.config.moe_layers, engine.config.moe_top_k
    raw = base64.b64decode(reply.body["meta_info"]["routed_experts"])
    values = list(struct.unpack(f"<{len(raw) // 4}i", raw))
    seqlen = len(prompt) + 5
    assert len(values) == (seqlen - 1 - 1) * layers * top_k  # SGLang's shape
    # The rows are deterministic: compute them from the same states the engine visits.
    state = initial_state(0)
    expected: list[int] = []
    for i, tid in enumerate(prompt + tokens_of(outputs)[:-1]):
        state = advance(state, tid)
        if i >= 1:
            expected += engine.experts.row(state)
    assert values == expected
    sse = await stream(mesh.http_url + "/generate", body)
    joined = b"".join(base64.b64decode(c["meta_info"]["routed_experts"]) for c in sse.events[:-1])
    assert joined == raw  # stream deltas join to the unary value


@pytest.mark.process
async def test_batch_disconnect_cancels_every_item(own_worker_mesh: Mesh) -> None:
    import aiohttp

    mesh = own_worker_mesh
    body = {
        "input_ids": [[1], [2], [3]],
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
        "stream": True,
    }
    async with aiohttp.ClientSession() as s, s.post(mesh.http_url + "/generate", json=body) as r:
        assert r.status == 200
        await r.content.readuntil(b"\n\n")

    def all_cancelled() -> bool:
        workers = mesh.server_info()["genmesh"]["workers"]
        stats = [w["stats"] for w in workers]
        return sum(s["cancelled"] for s in stats) == 3 and all(w["inflight"] == 0 for w in workers)

    wait_until(all_cancelled, timeout=5, what="all three items to be cancelled")

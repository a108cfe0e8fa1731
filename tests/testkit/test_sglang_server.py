"""The mock SGLang server (`genmesh.testkit.sglang`) against SGLang's wire contract.

Reference: `engine-apis.md` §A and the checklist §E "SGLang mock". Every test runs the
app in-process on a real socket and talks to it with aiohttp.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import re
import signal
import struct
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from genmesh.client import request
from genmesh.engines.base import EngineOutput
from genmesh.engines.mock import (
    MockConfig,
    MockEngine,
    TokenModel,
    advance,
    initial_state,
)
from genmesh.testkit.common import serving
from genmesh.testkit.config import MockServerConfig
from genmesh.testkit.sglang import build_app
from tests.mesh import free_port

pytestmark = pytest.mark.inproc

VOCAB = 1000
EOS = 7
CONFIG = MockServerConfig(vocab_size=VOCAB, eos_token_id=EOS, max_model_len=4096)
# Layers and top-k of the routed-expert rows (the mock engine's defaults).
MOE = MockConfig()
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
WAITING = {"type": "abort", "message": "Abort in waiting queue"}
ALWAYS_META = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens"}


# ---------------------------------------------------------------- helpers


@contextlib.asynccontextmanager
async def sglang(config: MockServerConfig = CONFIG) -> AsyncIterator[str]:
    async with serving(build_app(config)) as url:
        yield url


@dataclasses.dataclass
class Reply:
    status: int
    headers: Any
    text: str

    @property
    def body(self) -> Any:
        return json.loads(self.text)

    @property
    def events(self) -> list[Any]:
        return parse_sse(self.text)


def parse_sse(raw: str) -> list[Any]:
    events: list[Any] = []
    for block in raw.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def call(
    url: str, path: str, body: Any = None, *, method: str = "POST", raw: bytes | None = None
) -> Reply:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, url + path, data=data) as resp,
    ):
        return Reply(resp.status, resp.headers, await resp.text())


async def generate(url: str, body: dict[str, Any], *, method: str = "POST") -> Reply:
    return await call(url, "/generate", body, method=method)


async def server_state(url: str) -> dict[str, Any]:
    return (await call(url, "/testkit/state", method="GET")).body  # type: ignore[no-any-return]


async def add_fault(url: str, **fault: Any) -> None:
    reply = await call(url, "/testkit/faults", fault)
    assert reply.status == 200, reply.text


async def set_config(url: str, **config: Any) -> None:
    reply = await call(url, "/testkit/config", config)
    assert reply.status == 200, reply.text


async def abort(url: str, body: dict[str, Any]) -> Reply:
    reply = await call(url, "/abort_request", body)
    assert reply.status == 200
    assert reply.text == ""
    return reply


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


async def registered(url: str, *rids: str) -> None:
    """Until the server holds these rids (waiting or running)."""

    async def check() -> bool:
        return set(rids) <= set((await server_state(url))["running"])

    await eventually(check)


async def running(url: str, *rids: str) -> None:
    """Until these rids are past their prefill, i.e. out of the waiting queue."""
    await registered(url, *rids)

    async def no_waiting() -> bool:
        info = (await call(url, "/get_server_info", method="GET")).body
        return info["internal_states"][0]["num_waiting_reqs"] == 0  # type: ignore[no-any-return]

    await eventually(no_waiting)


async def next_event(resp: aiohttp.ClientResponse) -> Any:
    block = (await resp.content.readuntil(b"\n\n")).decode()
    assert block.startswith("data: "), block
    assert block.endswith("\n\n"), block
    payload = block[len("data: ") : -2]
    return payload if payload == "[DONE]" else json.loads(payload)


async def rest_of_stream(resp: aiohttp.ClientResponse) -> list[Any]:
    return parse_sse((await resp.read()).decode())


async def engine(
    prompt: list[int],
    config: MockServerConfig = CONFIG,
    *,
    routed_from: int | None = None,
    **knobs: Any,
) -> list[EngineOutput]:
    """What genmesh's mock worker engine produces for the same request."""
    env = request(prompt, **knobs)
    if routed_from is not None:
        env.output.routed_experts_start = routed_from
    mock = MockEngine(
        MockConfig(
            vocab_size=config.vocab_size,
            eos_token_id=config.eos_token_id,
            max_model_len=config.max_model_len,
        )
    )
    return [out async for out in mock.generate(env)]


def tokens_of(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.tokens]


def free_run(prompt: list[int], seed: int, steps: int, vocab: int = VOCAB) -> list[int]:
    """The greedy tokens of the token model, ignoring every stop condition."""
    model = TokenModel(vocab)
    state = initial_state(seed)
    for tid in prompt:
        state = advance(state, tid)
    out = []
    for _ in range(steps):
        token = model.top(state, 1)[0][0]
        out.append(token)
        state = advance(state, token)
    return out


def seed_with_eos_at(prompt: list[int], low: int, high: int) -> tuple[int, int]:
    """A seed whose free run emits EOS first at a position in [low, high)."""
    for seed in range(1, 200_000):
        run = free_run(prompt, seed, high)
        if EOS in run and run.index(EOS) >= low:
            return seed, run.index(EOS)
    raise AssertionError("no seed found")


def assert_triple(entry: Any, token: int, *, null: bool = False) -> None:
    assert isinstance(entry, list)
    assert len(entry) == 3
    assert entry[1] == token
    assert entry[2] is None
    if null:
        assert entry[0] is None
    else:
        assert isinstance(entry[0], float)


def decode_experts(encoded: str) -> list[list[list[int]]]:
    raw = base64.b64decode(encoded)
    flat = list(struct.unpack(f"<{len(raw) // 4}i", raw))
    per_row = MOE.moe_layers * MOE.moe_top_k
    rows = [flat[i : i + per_row] for i in range(0, len(flat), per_row)]
    return [[row[j : j + MOE.moe_top_k] for j in range(0, per_row, MOE.moe_top_k)] for row in rows]


# ---------------------------------------------------------------- /generate basics


@pytest.mark.parametrize("method", ["POST", "PUT"])
async def test_post_and_put_generate_return_one_object(method: str) -> None:
    async with sglang() as url:
        reply = await generate(
            url,
            {"input_ids": [1, 2, 3], "rid": "r1", "sampling_params": {"max_new_tokens": 5}},
            method=method,
        )
    assert reply.status == 200
    assert reply.headers["Content-Type"].startswith("application/json")
    body = reply.body
    assert set(body) == {"output_ids", "meta_info"}  # no "text" under --skip-tokenizer-init
    meta = body["meta_info"]
    assert set(meta) >= ALWAYS_META
    assert meta["id"] == "r1"
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["prompt_tokens"] == 3
    assert meta["completion_tokens"] == 5 == len(body["output_ids"])
    assert meta["cached_tokens"] == 0
    assert meta["weight_version"] == "default"
    assert isinstance(meta["e2e_latency"], float)
    assert not any("logprob" in key for key in meta)


@pytest.mark.parametrize(
    "knobs",
    [
        {"max_tokens": 20, "seed": 0},
        {"max_tokens": 20, "seed": 12345},
        {"max_tokens": 30, "seed": 3, "min_tokens": 10},
        {"max_tokens": 30, "seed": 9, "stop_token_ids": [5, 6]},
        {"max_tokens": 25, "seed": 1, "ignore_eos": True},
    ],
)
async def test_tokens_and_logprobs_equal_the_mock_engine(knobs: dict[str, Any]) -> None:
    prompt = [11, 12, 13, 14]
    sampling: dict[str, Any] = {"max_new_tokens": knobs["max_tokens"]}
    if knobs.get("seed"):
        sampling["sampling_seed"] = knobs["seed"]
    if "min_tokens" in knobs:
        sampling["min_new_tokens"] = knobs["min_tokens"]
    if "stop_token_ids" in knobs:
        sampling["stop_token_ids"] = knobs["stop_token_ids"]
    if "ignore_eos" in knobs:
        sampling["ignore_eos"] = knobs["ignore_eos"]
    async with sglang() as url:
        reply = await generate(
            url,
            {
                "input_ids": prompt,
                "sampling_params": sampling,
                "return_logprob": True,
                "top_logprobs_num": 3,
                "logprob_start_len": 0,
            },
        )
    assert reply.status == 200, reply.text
    meta = reply.body["meta_info"]
    outs = await engine(prompt, logprobs=True, top_logprobs=3, prompt_logprobs_start=0, **knobs)
    assert reply.body["output_ids"] == tokens_of(outs)
    logprobs = [lp for o in outs for lp in o.logprobs or []]
    assert [e[0] for e in meta["output_token_logprobs"]] == logprobs
    tops = [top for o in outs for top in o.top_logprobs or []]
    assert meta["output_top_logprobs"] == [[[lp, t, None] for t, lp in top] for top in tops]
    assert [e[0] for e in meta["input_token_logprobs"]] == outs[0].prompt_logprobs
    expected_input_tops = [
        None if top is None else [[lp, t, None] for t, lp in top]
        for top in outs[0].prompt_top_logprobs or []
    ]
    assert meta["input_top_logprobs"] == expected_input_tops


async def test_seed_zero_equals_no_seed_and_seeds_differ() -> None:
    async with sglang() as url:
        base = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 8}}
        none = (await generate(url, base)).body["output_ids"]
        zero = (
            await generate(
                url, {**base, "sampling_params": {"max_new_tokens": 8, "sampling_seed": 0}}
            )
        ).body["output_ids"]
        other = (
            await generate(
                url, {**base, "sampling_params": {"max_new_tokens": 8, "sampling_seed": 5}}
            )
        ).body["output_ids"]
    assert none == zero != other


async def test_default_max_new_tokens_is_128() -> None:
    async with sglang() as url:
        reply = await generate(url, {"input_ids": [3], "sampling_params": {"ignore_eos": True}})
    assert reply.body["meta_info"]["finish_reason"] == {"type": "length", "length": 128}
    assert len(reply.body["output_ids"]) == 128


async def test_null_max_new_tokens_runs_to_the_context_length() -> None:
    config = dataclasses.replace(CONFIG, max_model_len=40)
    async with sglang(config) as url:
        reply = await generate(
            url,
            {
                "input_ids": [1] * 10,
                "sampling_params": {"max_new_tokens": None, "ignore_eos": True},
            },
        )
    # The scheduler clamps an uncapped request to context_len - prompt_len - 1.
    assert reply.body["meta_info"]["finish_reason"] == {"type": "length", "length": 29}
    assert len(reply.body["output_ids"]) == 29


async def test_zero_max_new_tokens_is_a_prefill_only_request() -> None:
    async with sglang() as url:
        reply = await generate(url, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}})
    assert reply.status == 200
    assert reply.body["output_ids"] == []
    assert reply.body["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert reply.body["meta_info"]["completion_tokens"] == 0


async def test_missing_rid_gets_a_fresh_hex_id() -> None:
    async with sglang() as url:
        a = (await generate(url, {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}})).body
        b = (await generate(url, {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}})).body
    assert re.fullmatch(r"[0-9a-f]{32}", a["meta_info"]["id"])
    assert a["meta_info"]["id"] != b["meta_info"]["id"]


async def test_unknown_sampling_keys_and_top_level_fields_are_tolerated() -> None:
    async with sglang() as url:
        reply = await generate(
            url,
            {
                "input_ids": [1, 2],
                "sampling_params": {"max_new_tokens": 2, "no_such_knob": 1, "temperature": 0},
                "some_future_field": {"x": 1},
            },
        )
    assert reply.status == 200, reply.text
    assert len(reply.body["output_ids"]) == 2


# ---------------------------------------------------------------- batches and n > 1


async def test_batch_returns_an_array_in_input_order_with_rid_suffixes() -> None:
    prompts = [[1, 2, 3], [4, 5], [6]]
    async with sglang() as url:
        reply = await generate(
            url, {"input_ids": prompts, "rid": "job", "sampling_params": {"max_new_tokens": 4}}
        )
    assert reply.status == 200
    body = reply.body
    assert isinstance(body, list)
    assert [o["meta_info"]["id"] for o in body] == ["job_0", "job_1", "job_2"]
    for prompt, out in zip(prompts, body, strict=True):
        assert out["output_ids"] == tokens_of(await engine(prompt, max_tokens=4))
        assert out["meta_info"]["prompt_tokens"] == len(prompt)
        assert "index" not in out


async def test_batch_with_a_rid_list_and_per_item_sampling_params() -> None:
    async with sglang() as url:
        reply = await generate(
            url,
            {
                "input_ids": [[1], [2]],
                "rid": ["a", "b"],
                "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 3}],
            },
        )
    assert [o["meta_info"]["id"] for o in reply.body] == ["a", "b"]
    assert [len(o["output_ids"]) for o in reply.body] == [2, 3]


async def test_batch_stream_interleaves_items_with_their_index() -> None:
    prompts = [[1, 2, 3], [4, 5]]
    async with sglang() as url:
        reply = await generate(
            url,
            {
                "input_ids": prompts,
                "rid": "s",
                "stream": True,
                "sampling_params": {"max_new_tokens": 3},
            },
        )
    events = reply.events
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["index"] for c in chunks} == {0, 1}
    assert [c["index"] for c in chunks] != sorted(c["index"] for c in chunks)  # interleaved
    for index, prompt in enumerate(prompts):
        mine = [c for c in chunks if c["index"] == index]
        assert all(c["meta_info"]["id"] == f"s_{index}" for c in mine)
        assert mine[-1]["output_ids"] == tokens_of(await engine(prompt, max_tokens=3))
        assert mine[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


async def test_n_samples_regenerate_rids_and_stay_contiguous_per_prompt() -> None:
    async with sglang() as url:
        reply = await generate(
            url,
            {
                "input_ids": [[1, 2], [3]],
                "rid": "mine",
                "sampling_params": {"max_new_tokens": 2, "n": 3},
            },
        )
    body = reply.body
    assert len(body) == 6
    ids = [o["meta_info"]["id"] for o in body]
    assert len(set(ids)) == 6
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)  # not "mine" nor "mine_0"
    assert [o["meta_info"]["prompt_tokens"] for o in body] == [2, 2, 2, 1, 1, 1]


async def test_n_on_a_single_prompt_is_an_array_and_streams_with_index() -> None:
    async with sglang() as url:
        unary = await generate(
            url, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "n": 2}}
        )
        streamed = await generate(
            url,
            {"input_ids": [1, 2], "stream": True, "sampling_params": {"max_new_tokens": 2, "n": 2}},
        )
    assert isinstance(unary.body, list)
    assert len(unary.body) == 2
    assert {c["index"] for c in streamed.events[:-1]} == {0, 1}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"input_ids": [[1], [2]], "rid": ["a"]},
            "The specified rids length mismatch with the batch_size for batch processing.",
        ),
        (
            {"input_ids": [[1], [2]], "rid": ["a", "a"]},
            "Duplicate request IDs detected within the request: ['a']",
        ),
        (
            {"input_ids": [[1], [2]], "sampling_params": [{"n": 2}, {"n": 3}]},
            "The parallel_sample_num should be the same for all samples in sample params.",
        ),
        (
            {"input_ids": [[1], [2]], "return_logprob": [True, False], "sampling_params": {"n": 2}},
            "Cannot use list return_logprob with parallel_sample_num > 1",
        ),
    ],
)
async def test_batch_normalization_errors(body: dict[str, Any], message: str) -> None:
    async with sglang() as url:
        reply = await generate(url, body)
    assert reply.status == 400
    assert reply.body == {"error": {"message": message}}


# ---------------------------------------------------------------- streaming


async def test_sse_framing_is_compact_data_lines_ending_with_done() -> None:
    async with sglang() as url:
        reply = await generate(
            url, {"input_ids": [1, 2], "stream": True, "sampling_params": {"max_new_tokens": 4}}
        )
    assert reply.status == 200
    assert reply.headers["Content-Type"].startswith("text/event-stream")
    assert reply.text.endswith("data: [DONE]\n\n")
    blocks = reply.text.split("\n\n")
    assert blocks[-1] == ""
    for block in blocks[:-1]:
        assert block.startswith("data: ")
        assert "\n" not in block  # one data line per event, no event:/id: lines
        payload = block[len("data: ") :]
        if payload != "[DONE]":
            assert payload == json.dumps(json.loads(payload), separators=(",", ":"))


async def test_cumulative_streaming_is_the_default() -> None:
    prompt = [5, 6, 7, 8]
    async with sglang() as url:
        info = (await call(url, "/get_server_info", method="GET")).body
        reply = await generate(
            url,
            {
                "input_ids": prompt,
                "stream": True,
                "return_logprob": True,
                "top_logprobs_num": 2,
                "logprob_start_len": 1,
                "sampling_params": {"max_new_tokens": 6},
            },
        )
    assert info["incremental_streaming_output"] is False
    assert info["stream_output"] is False
    chunks = reply.events[:-1]
    expected = tokens_of(await engine(prompt, max_tokens=6))
    assert len(chunks) == 6
    for n, chunk in enumerate(chunks, start=1):
        meta = chunk["meta_info"]
        assert chunk["output_ids"] == expected[:n]  # the whole sequence so far
        assert meta["completion_tokens"] == n
        assert len(meta["output_token_logprobs"]) == n
        assert len(meta["output_top_logprobs"]) == n
        assert meta["output_token_logprobs_length"] == n
        assert meta["input_token_logprobs"] == chunks[0]["meta_info"]["input_token_logprobs"]
        assert len(meta["input_token_logprobs"]) == 3
        assert (meta["finish_reason"] is None) == (n < 6)
        assert ("e2e_latency" in meta) == (n == 6)
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}


async def test_incremental_streaming_sends_deltas() -> None:
    prompt = [5, 6, 7, 8]
    config = dataclasses.replace(CONFIG, incremental=True)
    async with sglang(config) as url:
        info = (await call(url, "/server_info", method="GET")).body
        reply = await generate(
            url,
            {
                "input_ids": prompt,
                "stream": True,
                "return_logprob": True,
                "top_logprobs_num": 2,
                "sampling_params": {"max_new_tokens": 6},
            },
        )
        unary = await generate(
            url,
            {
                "input_ids": prompt,
                "return_logprob": True,
                "top_logprobs_num": 2,
                "sampling_params": {"max_new_tokens": 6},
            },
        )
    assert info["incremental_streaming_output"] is True
    assert info["stream_output"] is True
    chunks = reply.events[:-1]
    assert reply.events[-1] == "[DONE]"
    assert [len(c["output_ids"]) for c in chunks] == [1] * 6
    joined = [t for c in chunks for t in c["output_ids"]]
    whole = unary.body
    assert joined == whole["output_ids"]  # unary responses stay whole
    lps = [e for c in chunks for e in c["meta_info"]["output_token_logprobs"]]
    assert lps == whole["meta_info"]["output_token_logprobs"]
    tops = [e for c in chunks for e in c["meta_info"]["output_top_logprobs"]]
    assert tops == whole["meta_info"]["output_top_logprobs"]
    for n, chunk in enumerate(chunks, start=1):
        meta = chunk["meta_info"]
        assert meta["completion_tokens"] == n  # running total, not a delta
        assert meta["output_token_logprobs_length"] == n
        assert meta["input_token_logprobs"] == whole["meta_info"]["input_token_logprobs"]
        assert meta["input_top_logprobs"] == [None]
        assert (meta["finish_reason"] is None) == (n < 6)
        assert ("e2e_latency" in meta) == (n == 6)


async def test_stream_interval_groups_tokens_per_chunk() -> None:
    config = dataclasses.replace(CONFIG, incremental=True)
    async with sglang(config) as url:
        reply = await generate(
            url,
            {
                "input_ids": [1],
                "stream": True,
                "sampling_params": {"max_new_tokens": 8, "stream_interval": 3},
            },
        )
    # The first token comes right after prefill, then one chunk every 3 tokens.
    assert [len(c["output_ids"]) for c in reply.events[:-1]] == [1, 3, 3, 1]


# ---------------------------------------------------------------- finish reasons


async def test_finish_reason_stop_on_eos() -> None:
    prompt = [2, 4, 6]
    seed, position = seed_with_eos_at(prompt, 3, 400)
    async with sglang() as url:
        reply = await generate(
            url,
            {
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": 500, "sampling_seed": seed},
            },
        )
    body = reply.body
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}
    assert body["output_ids"][-1] == EOS
    assert len(body["output_ids"]) == position + 1
    assert body["output_ids"] == tokens_of(await engine(prompt, max_tokens=500, seed=seed))


async def test_finish_reason_stop_on_a_stop_token_id() -> None:
    prompt = [1, 2, 3]
    run = free_run(prompt, 0, 10)
    stop = run[4]
    async with sglang() as url:
        reply = await generate(
            url,
            {
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": 10, "stop_token_ids": [stop]},
            },
        )
    body = reply.body
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert body["output_ids"] == run[: run.index(stop) + 1]


async def test_length_wins_over_a_stop_token_on_the_last_position() -> None:
    """SGLang's check_finished tests the length cap before stop tokens."""
    prompt = [1, 2, 3]
    run = free_run(prompt, 0, 5)
    async with sglang() as url:
        reply = await generate(
            url,
            {
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": 5, "stop_token_ids": [run[4]]},
            },
        )
    assert run[4] not in run[:4]
    assert reply.body["output_ids"] == run
    assert reply.body["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


async def test_ignore_eos_also_ignores_stop_token_ids() -> None:
    """SGLang's `_check_token_based_finish` returns early under ignore_eos."""
    prompt = [1, 2, 3]
    run = free_run(prompt, 0, 10)
    async with sglang() as url:
        reply = await generate(
            url,
            {
                "input_ids": prompt,
                "sampling_params": {
                    "max_new_tokens": 10,
                    "stop_token_ids": [run[2]],
                    "ignore_eos": True,
                },
            },
        )
    assert reply.body["output_ids"] == run
    assert reply.body["meta_info"]["finish_reason"] == {"type": "length", "length": 10}


async def test_min_new_tokens_masks_eos() -> None:
    prompt = [2, 4, 6]
    seed, position = seed_with_eos_at(prompt, 2, 100)
    async with sglang() as url:
        reply = await generate(
            url,
            {
                "input_ids": prompt,
                "sampling_params": {
                    "max_new_tokens": 200,
                    "min_new_tokens": position + 5,
                    "sampling_seed": seed,
                },
            },
        )
    out = reply.body["output_ids"]
    assert EOS not in out[: position + 5]
    assert out == tokens_of(
        await engine(prompt, max_tokens=200, min_tokens=position + 5, seed=seed)
    )


async def test_string_stops_need_a_tokenizer() -> None:
    async with sglang() as url:
        reply = await generate(url, {"input_ids": [1], "sampling_params": {"stop": "\n"}})
    assert reply.status == 400
    assert reply.body == {
        "error": {
            "message": "stop=['\\n'] is unavailable when skip_tokenizer_init=True "
            "(requires tokenizer to decode tokens to text for matching)."
        }
    }


# ---------------------------------------------------------------- logprobs


async def test_default_logprob_start_len_gives_only_the_last_prompt_position() -> None:
    async with sglang() as url:
        reply = await generate(
            url,
            {
                "input_ids": [9, 8, 7, 6],
                "return_logprob": True,
                "top_logprobs_num": 2,
                "sampling_params": {"max_new_tokens": 3},
            },
        )
    meta = reply.body["meta_info"]
    assert meta["input_token_logprobs"] == [[None, 6, None]]
    assert meta["input_top_logprobs"] == [None]
    assert len(meta["output_token_logprobs"]) == len(reply.body["output_ids"]) == 3
    for entry, token in zip(meta["output_token_logprobs"], reply.body["output_ids"], strict=True):
        assert_triple(entry, token)
    for top in meta["output_top_logprobs"]:
        assert len(top) == 2
        for entry in top:
            assert_triple(entry, entry[1])


async def test_logprob_start_len_zero_covers_the_whole_prompt() -> None:
    prompt = [9, 8, 7, 6]
    async with sglang() as url:
        reply = await generate(
            url,
            {
                "input_ids": prompt,
                "return_logprob": True,
                "logprob_start_len": 0,
                "top_logprobs_num": 1,
                "sampling_params": {"max_new_tokens": 1},
            },
        )
    meta = reply.body["meta_info"]
    entries = meta["input_token_logprobs"]
    assert len(entries) == len(prompt)
    assert_triple(entries[0], 9, null=True)
    for entry, token in zip(entries[1:], prompt[1:], strict=True):
        assert_triple(entry, token)
    assert meta["input_top_logprobs"][0] is None
    assert all(len(top) == 1 for top in meta["input_top_logprobs"][1:])


async def test_token_ids_logprob_reports_the_asked_ids_everywhere() -> None:
    async with sglang() as url:
        reply = await generate(
            url,
            {
                "input_ids": [1, 2, 3],
                "return_logprob": True,
                "logprob_start_len": 1,
                "token_ids_logprob": [5, 50],
                "sampling_params": {"max_new_tokens": 2},
            },
        )
    meta = reply.body["meta_info"]
    assert meta["input_token_ids_logprobs"][0] is None
    assert [[e[1] for e in pos] for pos in meta["input_token_ids_logprobs"][1:]] == [[5, 50]]
    assert [[e[1] for e in pos] for pos in meta["output_token_ids_logprobs"]] == [[5, 50]] * 2


async def test_logprob_start_len_is_ignored_without_return_logprob() -> None:
    async with sglang() as url:
        reply = await generate(
            url,
            {"input_ids": [1, 2], "logprob_start_len": 9, "sampling_params": {"max_new_tokens": 1}},
        )
    assert reply.status == 200
    assert "input_token_logprobs" not in reply.body["meta_info"]


async def test_logprob_start_len_at_the_prompt_length_is_a_400() -> None:
    body = {
        "input_ids": [1, 2, 3],
        "rid": "lp",
        "return_logprob": True,
        "logprob_start_len": 3,
        "sampling_params": {"max_new_tokens": 4},
    }
    message = (
        "req.logprob_start_len=3 is higher than the number of input tokens "
        "len(req.origin_input_ids)=3. Please use a smaller logprob_start_len."
    )
    async with sglang() as url:
        unary = await generate(url, body)
        streamed = await generate(url, {**body, "stream": True})
    assert unary.status == 400
    assert unary.body == {"error": {"message": message}}
    # Streaming: the scheduler's abort chunk itself, then [DONE].
    assert streamed.status == 200
    chunk, done = streamed.events
    assert done == "[DONE]"
    assert chunk["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": message,
        "status_code": 400,
        "err_type": "BadRequestError",
    }
    assert "input_token_logprobs" not in chunk["meta_info"]


# ---------------------------------------------------------------- routed experts


@pytest.mark.parametrize("start", [0, 2, 4])
async def test_routed_experts_are_base64_int32_rows(start: int) -> None:
    prompt = [3, 1, 4, 1]
    async with sglang() as url:
        reply = await generate(
            url,
            {
                "input_ids": prompt,
                "return_routed_experts": True,
                "routed_experts_start_len": start,
                "sampling_params": {"max_new_tokens": 5},
            },
        )
    meta = reply.body["meta_info"]
    rows = decode_experts(meta["routed_experts"])
    seqlen = len(prompt) + len(reply.body["output_ids"])
    assert len(rows) == seqlen - 1 - start
    assert all(len(row) == MOE.moe_layers for row in rows)
    assert all(len(layer) == MOE.moe_top_k for row in rows for layer in row)
    outs = await engine(prompt, max_tokens=5, routed_from=start)
    expected = [row for o in outs for row in o.routed_experts or []]
    assert [[e for layer in row for e in layer] for row in rows] == expected


async def test_routed_experts_only_on_the_final_stream_chunk() -> None:
    async with sglang() as url:
        reply = await generate(
            url,
            {
                "input_ids": [1, 2],
                "stream": True,
                "return_routed_experts": True,
                "sampling_params": {"max_new_tokens": 3},
            },
        )
    chunks = reply.events[:-1]
    assert ["routed_experts" in c["meta_info"] for c in chunks] == [False, False, True]
    assert len(decode_experts(chunks[-1]["meta_info"]["routed_experts"])) == 2 + 3 - 1


async def test_routed_experts_start_beyond_the_prompt_is_a_400() -> None:
    async with sglang() as url:
        reply = await generate(
            url,
            {"input_ids": [1, 2], "return_routed_experts": True, "routed_experts_start_len": 3},
        )
    assert reply.status == 400
    assert "is higher than the number of input tokens" in reply.body["error"]["message"]


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        ({"max_new_tokens": -1}, "max_new_tokens must be at least 0, got -1."),
        ({"min_new_tokens": -1}, "min_new_tokens must be in [0, max_new_tokens], got -1."),
        (
            {"max_new_tokens": 2, "min_new_tokens": 3},
            "min_new_tokens must be in [0, max_new_tokens(2)], got 3.",
        ),
        ({"temperature": -0.5}, "temperature must be a non-negative finite number, got -0.5."),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5."),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0.0."),
        ({"top_k": 0}, "top_k must be -1 (disable) or at least 1, got 0."),
        ({"min_p": 2}, "min_p must be in [0, 1], got 2.0."),
        ({"frequency_penalty": 3}, "frequency_penalty must be in [-2, 2], got 3.0."),
        ({"presence_penalty": -3}, "presence_penalty must be in [-2, 2], got -3.0."),
        (
            {"repetition_penalty": 0},
            "repetition_penalty must be in (0, 2] (1.0 = no penalty), got 0.0.",
        ),
        ({"logit_bias": {"5000": 1.0}}, "logit_bias must has keys in [0, 999], got 5000."),
        ({"logit_bias": {"x": 1.0}}, "invalid literal for int() with base 10: 'x'"),
        ({"regex": "a", "ebnf": "b"}, "Only one of regex, json_schema, or ebnf can be set."),
    ],
)
async def test_invalid_sampling_params_use_sglang_messages(
    sampling: dict[str, Any], message: str
) -> None:
    body = {"input_ids": [1, 2], "sampling_params": sampling}
    async with sglang() as url:
        unary = await generate(url, body)
        streamed = await generate(url, {**body, "stream": True})
        state = await server_state(url)
    assert unary.status == 400
    assert unary.body == {"error": {"message": message}}
    # Once a stream has started the error travels in-band, then [DONE].
    assert streamed.status == 200
    assert streamed.events == [{"error": {"message": message}}, "[DONE]"]
    assert state["received"] == 0


async def test_greedy_temperature_makes_top_k_zero_acceptable() -> None:
    async with sglang() as url:
        reply = await generate(
            url,
            {
                "input_ids": [1],
                "sampling_params": {"temperature": 0, "top_k": 0, "max_new_tokens": 1},
            },
        )
    assert reply.status == 200, reply.text


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"text": "Hello"},
            "The engine initialized with skip_tokenizer_init=True cannot accept text "
            "prompts. Please provide input_ids or re-initialize the engine with "
            "skip_tokenizer_init=False.",
        ),
        (
            {"input_ids": [1, 1000, 2]},
            "The input_ids [1, 1000, 2] contains values greater than the vocab size (1000).",
        ),
        ({"input_ids": []}, "input_ids cannot be empty."),
        ({}, "Either text, input_ids or input_embeds should be provided."),
        (
            {"input_ids": [1], "return_logprob": True, "token_ids_logprob": [3, 1000]},
            "token_ids_logprob contains out-of-vocabulary token id 1000; valid range is [0, 1000).",
        ),
        (
            {"input_ids": [1] * 4096},
            "The input (4096 tokens) is longer than the model's context length (4096 tokens).",
        ),
        (
            {"input_ids": [1] * 96, "sampling_params": {"max_new_tokens": 4001}},
            "Requested token count exceeds the model's maximum context length of 4096 "
            "tokens. You requested a total of 4097 tokens: 96 tokens from the input "
            "messages and 4001 tokens for the completion. Please reduce the number of "
            "tokens in the input messages or the completion to fit within the limit.",
        ),
        (
            {"input_ids": [1], "return_hidden_states": True},
            "The server is not configured to return the hidden states. Please set "
            "`--enable-return-hidden-states` to enable this feature.",
        ),
    ],
)
async def test_rejected_requests(body: dict[str, Any], message: str) -> None:
    async with sglang() as url:
        unary = await generate(url, body)
        streamed = await generate(url, {**body, "stream": True})
    assert unary.status == 400
    assert unary.body == {"error": {"message": message}}
    assert streamed.status == 200
    assert streamed.events == [{"error": {"message": message}}, "[DONE]"]


async def test_prompt_plus_max_new_tokens_exactly_at_the_context_is_served() -> None:
    """`_validate_one_request` refuses only a total beyond the context length."""
    body = {"input_ids": [1] * 96, "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
    async with sglang() as url:
        reply = await generate(url, body)
    assert reply.status == 200, reply.body
    assert reply.body["meta_info"]["prompt_tokens"] == 96


@pytest.mark.parametrize(
    "body",
    [
        {"input_ids": "1 2 3"},
        {"input_ids": [1, "2"]},
        {"input_ids": [1], "stream": "maybe"},
        {"input_ids": [1], "sampling_params": "hot"},
        {"input_ids": [1], "rid": 5},
        {"input_ids": [1], "return_logprob": True, "top_logprobs_num": "two"},
    ],
)
async def test_type_errors_are_400_object_errors(body: dict[str, Any]) -> None:
    async with sglang() as url:
        reply = await generate(url, body)
    assert reply.status == 400
    error = reply.body
    assert set(error) == {"object", "message", "type", "param", "code"}
    assert error["object"] == "error"
    assert error["type"] == "Bad Request"
    assert error["param"] is None
    assert error["code"] == 400
    assert "validation error" in error["message"]


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b""])
async def test_malformed_bodies_are_400_object_errors(raw: bytes) -> None:
    async with sglang() as url:
        reply = await call(url, "/generate", raw=raw)
    assert reply.status == 400
    assert reply.body["object"] == "error"
    assert reply.body["code"] == 400


async def test_a_running_rid_cannot_be_reused() -> None:
    config = dataclasses.replace(CONFIG, token_delay_ms=20)
    async with sglang(config) as url:
        first = asyncio.create_task(
            generate(
                url, {"input_ids": [1], "rid": "dup", "sampling_params": {"max_new_tokens": 20}}
            )
        )
        await running(url, "dup")
        second = await generate(url, {"input_ids": [1], "rid": "dup"})
        assert (await first).status == 200
    assert second.status == 400
    assert "dup" in second.body["error"]["message"]


# ---------------------------------------------------------------- /abort_request


async def test_abort_answers_200_with_an_empty_body_even_for_unknown_rids() -> None:
    async with sglang() as url:
        await abort(url, {"rid": "nobody"})
        await abort(url, {"abort_all": True})
        state = await server_state(url)
    assert state["aborted"] == []


async def test_abort_matches_rid_prefixes() -> None:
    """The trap: aborting "abc" also stops "abcd" (the scheduler's startswith)."""
    config = dataclasses.replace(CONFIG, token_delay_ms=20)
    long = {"max_new_tokens": 500, "ignore_eos": True}
    async with sglang(config) as url:
        tasks = {
            rid: asyncio.create_task(
                generate(url, {"input_ids": [1], "rid": rid, "sampling_params": long})
            )
            for rid in ("abc", "abcd", "abx", "zabc")
        }
        await running(url, *tasks)
        await abort(url, {"rid": "abc"})
        await eventually(lambda: _done(tasks["abc"], tasks["abcd"]))
        state = await server_state(url)
        assert sorted(state["aborted"]) == ["abc", "abcd"]
        assert sorted(state["running"]) == ["abx", "zabc"]
        await abort(url, {"abort_all": True})
        replies = {rid: await task for rid, task in tasks.items()}
    for reply in replies.values():
        assert reply.status == 200
        meta = reply.body["meta_info"]
        assert meta["finish_reason"] == ABORTED
        assert meta["completion_tokens"] < 500


async def _done(*tasks: asyncio.Task[Reply]) -> bool:
    return all(t.done() for t in tasks)


async def test_abort_needs_the_exact_rid_to_be_known_first() -> None:
    """The tokenizer manager only forwards a rid it holds: "abc" alone does not hit "abcd"."""
    config = dataclasses.replace(CONFIG, token_delay_ms=20)
    async with sglang(config) as url:
        task = asyncio.create_task(
            generate(
                url, {"input_ids": [1], "rid": "abcd", "sampling_params": {"max_new_tokens": 15}}
            )
        )
        await running(url, "abcd")
        await abort(url, {"rid": "abc"})
        reply = await task
    assert reply.body["meta_info"]["finish_reason"] == {"type": "length", "length": 15}


async def test_aborting_a_batch_item_prefix_hits_its_siblings_with_longer_suffixes() -> None:
    config = dataclasses.replace(CONFIG, token_delay_ms=20)
    prompts = [[1]] * 12
    async with sglang(config) as url:
        task = asyncio.create_task(
            generate(
                url,
                {
                    "input_ids": prompts,
                    "rid": "b",
                    "sampling_params": {"max_new_tokens": 30, "ignore_eos": True},
                },
            )
        )
        await running(url, "b_0", "b_11")
        await abort(url, {"rid": "b"})  # the parent rid is unknown: nothing happens
        await abort(url, {"rid": "b_1"})  # b_1, b_10 and b_11
        reply = await task
    reasons = {o["meta_info"]["id"]: o["meta_info"]["finish_reason"] for o in reply.body}
    assert {rid for rid, r in reasons.items() if r == ABORTED} == {"b_1", "b_10", "b_11"}
    assert all(
        r["type"] == "length" for rid, r in reasons.items() if rid not in {"b_1", "b_10", "b_11"}
    )


async def test_a_running_request_finishes_with_aborted_after_at_most_one_token() -> None:
    config = dataclasses.replace(CONFIG, token_delay_ms=300)
    body = {
        "input_ids": [1, 2],
        "rid": "run",
        "stream": True,
        "sampling_params": {"max_new_tokens": 100, "ignore_eos": True},
    }
    async with (
        sglang(config) as url,
        aiohttp.ClientSession() as session,
        session.post(url + "/generate", json=body) as resp,
    ):
        first = await next_event(resp)
        second = await next_event(resp)
        seen = second["meta_info"]["completion_tokens"]
        await abort(url, {"rid": "run"})
        rest = await rest_of_stream(resp)
        state = await server_state(url)
    assert first["meta_info"]["completion_tokens"] == 1
    assert rest[-1] == "[DONE]"
    *between, final = rest[:-1]
    assert all(c["meta_info"]["finish_reason"] is None for c in between)
    meta = final["meta_info"]
    assert resp.status == 200
    assert meta["finish_reason"] == ABORTED
    # One forward pass after the abort landed, then the abort finish (with that token).
    last = between[-1]["meta_info"]["completion_tokens"] if between else seen
    assert meta["completion_tokens"] == last + 1
    assert len(final["output_ids"]) == last + 1  # cumulative
    assert ALWAYS_META | {"e2e_latency", "weight_version"} <= set(meta)
    assert state["aborted"] == ["run"]


async def test_a_waiting_request_finishes_with_abort_in_waiting_queue() -> None:
    config = dataclasses.replace(CONFIG, token_delay_ms=3000)  # a long prefill
    async with sglang(config) as url:
        started = time.monotonic()
        task = asyncio.create_task(
            generate(url, {"input_ids": [1, 2], "rid": "w", "return_logprob": True})
        )
        await registered(url, "w")
        await abort(url, {"rid": "w"})
        reply = await task
        elapsed = time.monotonic() - started
    assert elapsed < 2.5
    assert reply.status == 200
    body = reply.body
    assert body["output_ids"] == []
    assert body["text"] == ""  # SGLang's _handle_abort_req always sets text
    meta = body["meta_info"]
    assert meta["finish_reason"] == WAITING
    assert set(meta) - {
        "input_token_logprobs",
        "output_token_logprobs",
        "output_token_logprobs_length",
    } == {"id", "finish_reason", "completion_tokens"}
    assert meta["id"] == "w"
    assert meta["completion_tokens"] == 0


async def test_a_waiting_stream_ends_with_the_waiting_abort_chunk() -> None:
    config = dataclasses.replace(CONFIG, token_delay_ms=3000)
    async with sglang(config) as url:
        task = asyncio.create_task(generate(url, {"input_ids": [1], "rid": "ws", "stream": True}))
        await registered(url, "ws")
        await abort(url, {"abort_all": True})
        reply = await task
    chunk, done = reply.events
    assert done == "[DONE]"
    assert chunk["meta_info"] == {"id": "ws", "finish_reason": WAITING, "completion_tokens": 0}


# ---------------------------------------------------------------- disconnects


async def test_a_stream_client_disconnect_aborts_and_is_recorded() -> None:
    config = dataclasses.replace(CONFIG, token_delay_ms=20)
    body = {
        "input_ids": [1],
        "rid": "gone",
        "stream": True,
        "sampling_params": {"max_new_tokens": 1000},
    }
    async with sglang(config) as url:
        async with aiohttp.ClientSession() as session:
            resp = await session.post(url + "/generate", json=body)
            await next_event(resp)
            resp.close()

        async def recorded() -> bool:
            state = await server_state(url)
            return state["disconnected"] == ["gone"] and state["running"] == []

        await eventually(recorded)
        state = await server_state(url)
    assert state["aborted"] == ["gone"]
    assert state["completed"] == 0


async def disconnect_and_see_it_recorded(url: str, body: dict[str, Any]) -> None:
    """Leave a unary /generate mid-generation; the server records the disconnect."""
    rid = body["rid"]
    call_task = asyncio.create_task(generate(url, body))
    await running(url, rid)
    call_task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call_task

    async def recorded() -> bool:
        state = await server_state(url)
        return state["disconnected"] == [rid] and state["running"] == []

    await eventually(recorded)


async def test_a_unary_client_disconnect_aborts_and_is_recorded() -> None:
    config = dataclasses.replace(CONFIG, token_delay_ms=20)
    body = {"input_ids": [1], "rid": "gone1", "sampling_params": {"max_new_tokens": 1000}}
    async with sglang(config) as url:
        await disconnect_and_see_it_recorded(url, body)


async def test_a_disconnect_is_noticed_without_aiohttp_handler_cancellation() -> None:
    """Like SGLang's `request.is_disconnected()` polling: no reliance on the runner."""
    runner = web.AppRunner(build_app(dataclasses.replace(CONFIG, token_delay_ms=20)))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        body = {"input_ids": [1], "rid": "poll", "sampling_params": {"max_new_tokens": 1000}}
        await disconnect_and_see_it_recorded(url, body)
    finally:
        await runner.cleanup()


# ---------------------------------------------------------------- health and info


async def test_health_and_health_generate() -> None:
    async with sglang() as url:
        assert (await call(url, "/health", method="GET")).status == 200
        generated = await call(url, "/health_generate", method="GET")
        assert generated.status == 200
        assert generated.text == ""
        await set_config(url, healthy=False)
        assert (await call(url, "/health", method="GET")).status == 503
        assert (await call(url, "/health_generate", method="GET")).status == 503
        await set_config(url, healthy=True)
        assert (await call(url, "/health", method="GET")).status == 200


@pytest.mark.parametrize("path", ["/get_model_info", "/model_info"])
async def test_model_info_has_the_seven_keys(path: str) -> None:
    async with sglang() as url:
        reply = await call(url, path, method="GET")
    assert reply.body == {
        "model_path": "genmesh-mock",
        "tokenizer_path": "genmesh-mock",
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
    }


@pytest.mark.parametrize("path", ["/get_server_info", "/server_info"])
async def test_server_info_has_the_keys_clients_read(path: str) -> None:
    async with sglang() as url:
        reply = await call(url, path, method="GET")
    info = reply.body
    assert info["skip_tokenizer_init"] is True
    assert info["disaggregation_mode"] == "null"
    assert info["tp_size"] == 1
    assert info["dp_size"] == 1
    assert info["incremental_streaming_output"] is False
    assert info["stream_output"] is False
    # The scheduler's init info: min(context - 1, pool - 1) - 5 (tp_worker.py).
    assert info["status"] == "ready"
    assert info["max_req_input_len"] == 4090
    assert info["max_total_num_tokens"] == 1_048_576
    assert info["context_length"] == 4096
    assert info["page_size"] == 1
    assert info["preferred_sampling_params"] is None
    assert isinstance(info["internal_states"], list)
    assert info["internal_states"]
    assert isinstance(info["version"], str)
    assert info["port"] == int(url.rsplit(":", 1)[1])


async def test_info_routes_report_the_configured_limits_and_defaults() -> None:
    """A server launched with a small KV pool, `--page-size 32` and
    `--preferred-sampling-params` reports them where SGLang does: ServerArgs' text in both
    info routes, the pool in the scheduler's info (which also bounds max_req_input_len)."""
    preferred = '{"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 3}'
    config = dataclasses.replace(
        CONFIG, max_total_num_tokens=2000, block_size=32, preferred_sampling_params=preferred
    )
    async with sglang(config) as url:
        server = (await call(url, "/server_info", method="GET")).body
        model = (await call(url, "/model_info", method="GET")).body
    assert server["max_total_num_tokens"] == 2000
    assert server["max_req_input_len"] == 2000 - 1 - 5
    assert server["page_size"] == 32
    assert server["preferred_sampling_params"] == preferred
    assert model["preferred_sampling_params"] == preferred


async def test_preferred_sampling_params_apply_under_the_requests_own() -> None:
    """`_create_tokenized_object` merges the server's preferred params under each
    request's: a request that names no budget gets the preferred max_new_tokens, one that
    names its own keeps it."""
    config = dataclasses.replace(CONFIG, preferred_sampling_params='{"max_new_tokens": 3}')
    async with sglang(config) as url:
        preferred = await generate(url, {"input_ids": [1, 2, 3], "sampling_params": {}})
        own = await generate(
            url, {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 5}}
        )
    assert preferred.body["meta_info"]["completion_tokens"] == 3
    assert own.body["meta_info"]["completion_tokens"] == 5


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_bad_preferred_sampling_params_stop_the_server(text: str) -> None:
    with pytest.raises(ValueError, match=r"JSON object|Expecting"):
        build_app(dataclasses.replace(CONFIG, preferred_sampling_params=text))


async def test_v1_models_lists_the_served_model() -> None:
    async with sglang() as url:
        listing = (await call(url, "/v1/models", method="GET")).body
        one = await call(url, "/v1/models/genmesh-mock", method="GET")
        missing = await call(url, "/v1/models/other", method="GET")
    assert listing["object"] == "list"
    assert [m["id"] for m in listing["data"]] == ["genmesh-mock"]
    assert listing["data"][0]["max_model_len"] == 4096
    assert one.body["id"] == "genmesh-mock"
    assert missing.status == 404
    assert missing.body["error"]["code"] == "model_not_found"


# ---------------------------------------------------------------- timing


async def test_token_delay_paces_decode_steps_and_prefill() -> None:
    config = dataclasses.replace(CONFIG, token_delay_ms=40)
    async with sglang(config) as url:
        started = time.monotonic()
        reply = await generate(
            url, {"input_ids": [1], "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
        )
        elapsed = time.monotonic() - started
    assert len(reply.body["output_ids"]) == 5
    assert elapsed >= 5 * 0.04 * 0.9  # prefill + 4 decode steps


async def test_a_config_change_applies_to_a_running_request() -> None:
    config = dataclasses.replace(CONFIG, token_delay_ms=200)
    async with sglang(config) as url:
        started = time.monotonic()
        task = asyncio.create_task(
            generate(
                url,
                {
                    "input_ids": [1],
                    "rid": "c",
                    "sampling_params": {"max_new_tokens": 60, "ignore_eos": True},
                },
            )
        )
        await running(url, "c")
        await set_config(url, token_delay_ms=0)
        reply = await task
        elapsed = time.monotonic() - started
    assert len(reply.body["output_ids"]) == 60
    assert elapsed < 3  # 60 tokens at 200 ms would take 12 s


# ---------------------------------------------------------------- injected faults


@pytest.mark.parametrize("status", [400, 404, 429])
async def test_http_error_fault_4xx(status: int) -> None:
    async with sglang() as url:
        await add_fault(url, kind="http_error", status=status, message="nope")
        reply = await generate(url, {"input_ids": [1], "stream": True})
        after = await generate(url, {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}})
        state = await server_state(url)
    assert reply.status == status
    assert reply.body == {"error": {"message": "nope"}}
    assert after.status == 200  # count 1: only the next request
    assert state["received"] == 1


@pytest.mark.parametrize("status", [500, 503])
async def test_http_error_fault_5xx(status: int) -> None:
    async with sglang() as url:
        await add_fault(url, kind="http_error", status=status, message="down")
        reply = await generate(url, {"input_ids": [1]})
    assert reply.status == status
    assert reply.body == {
        "object": "error",
        "message": "down",
        "type": str(status),
        "param": None,
        "code": status,
    }


async def test_a_fault_with_count_minus_one_persists_until_cleared() -> None:
    async with sglang() as url:
        await add_fault(url, kind="http_error", status=503, count=-1)
        statuses = [(await generate(url, {"input_ids": [1]})).status for _ in range(3)]
        cleared = await call(url, "/testkit/faults", method="DELETE")
        after = await generate(url, {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}})
    assert statuses == [503, 503, 503]
    assert cleared.status == 200
    assert after.status == 200


async def test_drop_fault_cuts_the_stream_after_n_tokens() -> None:
    body = {"input_ids": [1], "stream": True, "sampling_params": {"max_new_tokens": 50}}
    async with sglang() as url:
        await add_fault(url, kind="drop", after_tokens=3)
        async with (
            aiohttp.ClientSession() as session,
            session.post(url + "/generate", json=body) as resp,
        ):
            events = [await next_event(resp) for _ in range(3)]
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.content.readuntil(b"\n\n")
        state = await server_state(url)
    assert [e["meta_info"]["completion_tokens"] for e in events] == [1, 2, 3]
    assert all(e["meta_info"]["finish_reason"] is None for e in events)
    assert state["running"] == []
    assert state["disconnected"] == []  # the server dropped it, not the client
    assert state["completed"] == 0


async def test_drop_fault_on_a_unary_request_closes_without_a_response() -> None:
    async with sglang() as url:
        await add_fault(url, kind="drop", after_tokens=2)
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await generate(url, {"input_ids": [1], "sampling_params": {"max_new_tokens": 50}})
        after = await generate(url, {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}})
    assert after.status == 200


async def test_no_terminal_fault_ends_the_stream_cleanly_without_finish_or_done() -> None:
    async with sglang() as url:
        await add_fault(url, kind="no_terminal", after_tokens=2)
        reply = await generate(
            url, {"input_ids": [1], "stream": True, "sampling_params": {"max_new_tokens": 50}}
        )
    events = reply.events
    assert reply.status == 200
    assert len(events) == 2
    assert "[DONE]" not in events
    assert all(e["meta_info"]["finish_reason"] is None for e in events)


async def test_no_terminal_fault_on_a_unary_request_has_no_finish_reason() -> None:
    async with sglang() as url:
        await add_fault(url, kind="no_terminal", after_tokens=2)
        reply = await generate(url, {"input_ids": [1], "sampling_params": {"max_new_tokens": 50}})
    assert reply.status == 200
    assert reply.body["meta_info"]["finish_reason"] is None
    assert len(reply.body["output_ids"]) == 2


async def test_done_early_fault_sends_done_without_a_terminal_chunk() -> None:
    async with sglang() as url:
        await add_fault(url, kind="done_early", after_tokens=3)
        reply = await generate(
            url, {"input_ids": [1], "stream": True, "sampling_params": {"max_new_tokens": 50}}
        )
    events = reply.events
    assert events[-1] == "[DONE]"
    assert len(events) == 4
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])


async def test_hang_fault_goes_silent_until_the_request_is_aborted() -> None:
    body = {
        "input_ids": [1],
        "rid": "h",
        "stream": True,
        "sampling_params": {"max_new_tokens": 50, "ignore_eos": True},
    }
    async with sglang() as url:
        await add_fault(url, kind="hang", after_tokens=2)
        async with (
            aiohttp.ClientSession() as session,
            session.post(url + "/generate", json=body) as resp,
        ):
            first = [await next_event(resp) for _ in range(2)]
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 0.3)
            await abort(url, {"rid": "h"})
            rest = await rest_of_stream(resp)
    assert [e["meta_info"]["completion_tokens"] for e in first] == [1, 2]
    assert rest[-1] == "[DONE]"
    assert rest[-2]["meta_info"]["finish_reason"] == ABORTED
    assert rest[-2]["meta_info"]["completion_tokens"] == 3


async def test_hang_fault_ends_when_the_client_leaves() -> None:
    body = {
        "input_ids": [1],
        "rid": "hl",
        "stream": True,
        "sampling_params": {"max_new_tokens": 50},
    }
    async with sglang() as url:
        await add_fault(url, kind="hang", after_tokens=1)
        async with aiohttp.ClientSession() as session:
            resp = await session.post(url + "/generate", json=body)
            await next_event(resp)
            resp.close()

        async def recorded() -> bool:
            state = await server_state(url)
            return state["disconnected"] == ["hl"] and state["running"] == []

        await eventually(recorded)


async def test_abort_fault_without_status_is_a_normal_200() -> None:
    async with sglang() as url:
        await add_fault(url, kind="abort", after_tokens=2, status=0, message="stopped")
        reply = await generate(url, {"input_ids": [1], "sampling_params": {"max_new_tokens": 50}})
    assert reply.status == 200
    assert reply.body["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "stopped",
        "status_code": None,
        "err_type": None,
    }
    assert len(reply.body["output_ids"]) == 2


async def test_abort_fault_with_400_is_a_400_or_an_abort_chunk() -> None:
    async with sglang() as url:
        await add_fault(url, kind="abort", after_tokens=1, status=400, message="bad", count=2)
        unary = await generate(url, {"input_ids": [1], "sampling_params": {"max_new_tokens": 50}})
        streamed = await generate(
            url, {"input_ids": [1], "stream": True, "sampling_params": {"max_new_tokens": 50}}
        )
    assert unary.status == 400
    assert unary.body == {"error": {"message": "bad"}}
    assert streamed.status == 200
    *chunks, final, done = streamed.events
    assert done == "[DONE]"
    assert len(chunks) == 1
    assert final["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "bad",
        "status_code": 400,
        "err_type": "BadRequestError",
    }


@pytest.mark.parametrize("status", [500, 503])
async def test_abort_fault_with_a_server_status_is_an_http_exception(status: int) -> None:
    async with sglang() as url:
        await add_fault(url, kind="abort", after_tokens=0, status=status, message="queue full")
        unary = await generate(url, {"input_ids": [1]})
        await add_fault(url, kind="abort", after_tokens=0, status=status, message="queue full")
        streamed = await generate(url, {"input_ids": [1], "stream": True})
    assert unary.status == status
    assert unary.body == {
        "object": "error",
        "message": "queue full",
        "type": str(status),
        "param": None,
        "code": status,
    }
    chunk, done = streamed.events
    assert done == "[DONE]"
    assert chunk["meta_info"]["finish_reason"]["status_code"] == status
    assert chunk["output_ids"] == []


# ---------------------------------------------------------------- the CLI


@pytest.mark.process
async def test_the_cli_serves_the_mock() -> None:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "genmesh",
        "testkit",
        "sglang",
        "--port",
        str(port),
        "--incremental",
        "--vocab-size",
        "500",
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        url = f"http://127.0.0.1:{port}"
        assert url in line.decode()
        assert (await call(url, "/health", method="GET")).status == 200
        info = (await call(url, "/get_server_info", method="GET")).body
        assert info["incremental_streaming_output"] is True
        reply = await generate(
            url, {"input_ids": [1, 499], "sampling_params": {"max_new_tokens": 3}}
        )
        assert len(reply.body["output_ids"]) == 3
        assert (await generate(url, {"input_ids": [500]})).status == 400
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()

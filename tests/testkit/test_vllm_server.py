"""The mock vLLM server (`genmesh.testkit.vllm`): vLLM's token-in/token-out
`/inference/v1/generate` as `engine-apis.md` §B and the §E "vLLM mock" checklist describe
it, over real sockets, generating exactly what the mock worker engine generates."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from genmesh.client import request
from genmesh.engines.base import EngineOutput
from genmesh.engines.faults import ServerState
from genmesh.engines.mock import MockConfig, MockEngine
from genmesh.testkit.common import serving
from genmesh.testkit.config import MockServerConfig
from genmesh.testkit.vllm import build_app, state_of
from tests.mesh import free_port, wait_until

pytestmark = pytest.mark.inproc

VOCAB, EOS, CONTEXT = 1000, 7, 256
CONFIG = MockServerConfig(vocab_size=VOCAB, eos_token_id=EOS, max_model_len=CONTEXT)
PATH = "/inference/v1/generate"
PROMPT = [11, 12, 13, 14]


# ---------------------------------------------------------------------------- helpers


@dataclass
class Reply:
    status: int
    headers: Any
    body: Any
    text: str


@dataclass
class Server:
    url: str
    state: ServerState
    session: aiohttp.ClientSession

    async def post(
        self,
        body: Any,
        *,
        headers: dict[str, str] | None = None,
        path: str = PATH,
        content_type: str = "application/json",
    ) -> Reply:
        data = body if isinstance(body, str | bytes) else json.dumps(body)
        async with self.session.post(
            self.url + path, data=data, headers={"Content-Type": content_type, **(headers or {})}
        ) as resp:
            text = await resp.text()
            try:
                parsed: Any = json.loads(text)
            except ValueError:
                parsed = text
            return Reply(resp.status, resp.headers, parsed, text)

    async def stream(self, body: dict[str, Any], **kwargs: Any) -> tuple[int, list[Any]]:
        reply = await self.post({**body, "stream": True}, **kwargs)
        return reply.status, parse_sse(reply.text)

    async def get(self, path: str) -> Reply:
        async with self.session.get(self.url + path) as resp:
            text = await resp.text()
            try:
                parsed: Any = json.loads(text)
            except ValueError:
                parsed = text
            return Reply(resp.status, resp.headers, parsed, text)

    async def fault(self, **fault: Any) -> None:
        async with self.session.post(self.url + "/testkit/faults", json=fault) as resp:
            assert resp.status == 200, await resp.text()

    async def abort(self, ids: Any) -> Reply:
        return await self.post({"request_ids": ids}, path="/abort_requests")

    async def wait_running(self, engine_id: str, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while engine_id not in self.state.running:
            assert time.monotonic() < deadline, f"{engine_id} never started"
            await asyncio.sleep(0.01)

    async def wait_for(self, predicate: Any, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.01)


def parse_sse(raw: str) -> list[Any]:
    """`data:` payloads in order, `[DONE]` kept as the string; checks the framing."""
    events: list[Any] = []
    for block in raw.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), repr(block)
        assert "\n" not in block, repr(block)
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def read_event(resp: aiohttp.ClientResponse) -> Any:
    """The next SSE event of an open response."""
    while True:
        line = (await resp.content.readline()).decode()
        assert line, "the stream ended"
        if line.startswith("data: "):
            assert await resp.content.readline() == b"\n"  # the event's blank line
            payload = line[len("data: ") :].strip()
            return payload if payload == "[DONE]" else json.loads(payload)


@contextlib.asynccontextmanager
async def mock_vllm(config: MockServerConfig = CONFIG, **kwargs: Any) -> AsyncIterator[Server]:
    app = build_app(config, **kwargs)
    async with serving(app) as url, aiohttp.ClientSession() as session:
        yield Server(url, state_of(app), session)


@pytest.fixture
async def vllm() -> AsyncIterator[Server]:
    async with mock_vllm() as server:
        yield server


@pytest.fixture
async def slow() -> AsyncIterator[Server]:
    """20 ms per decode step: time enough to abort or disconnect mid-generation."""
    async with mock_vllm(
        MockServerConfig(vocab_size=VOCAB, eos_token_id=EOS, token_delay_ms=20)
    ) as server:
        yield server


async def reference(
    prompt: list[int], *, context: int = CONTEXT, **kwargs: Any
) -> list[EngineOutput]:
    engine = MockEngine(MockConfig(vocab_size=VOCAB, eos_token_id=EOS, max_model_len=context))
    return [out async for out in engine.generate(request(prompt, **kwargs))]


def tokens_of(outs: list[EngineOutput]) -> list[int]:
    return [t for out in outs for t in out.tokens]


def finish_of(outs: list[EngineOutput]) -> tuple[str, int | None]:
    finish = outs[-1].finish
    assert finish is not None
    reason = finish["reason"]
    if reason == "eos":
        return "stop", None
    if reason == "stop":
        return "stop", finish["matched"]
    return reason, None


def expected_content(outs: list[EngineOutput], k: int) -> list[dict[str, Any]]:
    """vLLM's tokens-mode logprobs for the mock engine's outputs: the sampled token with
    its rank, and `top_logprobs` = the first max(k, 1) items of vLLM's logprob dict (the
    sampled token, then the best candidates, rank = place, without repeats)."""
    content = []
    for out in outs:
        assert out.logprobs is not None
        assert out.ranks is not None
        for i, token in enumerate(out.tokens):
            sampled = {"token_id": token, "logprob": out.logprobs[i], "rank": out.ranks[i]}
            top = [sampled]
            alternatives = out.top_logprobs[i] if out.top_logprobs else []
            for place, (tid, lp) in enumerate(alternatives, 1):
                if len(top) == max(k, 1):
                    break
                if tid != token:
                    top.append({"token_id": tid, "logprob": lp, "rank": place})
            content.append({**sampled, "top_logprobs": top})
    return content


def body(prompt: list[int] = PROMPT, **sampling: Any) -> dict[str, Any]:
    return {"token_ids": prompt, "sampling_params": sampling}


def assert_error(reply: Reply, status: int, error_type: str, fragment: str = "") -> None:
    assert reply.status == status, reply.text
    assert set(reply.body) == {"error"}
    err = reply.body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status
    assert isinstance(err["code"], int)
    assert err["type"] == error_type
    assert fragment in err["message"]


def token_chunks(events: list[Any]) -> list[dict[str, Any]]:
    return [e for e in events if isinstance(e, dict) and e.get("choices")]


# ------------------------------------------------------------------- unary generation


@pytest.mark.parametrize(
    "sampling",
    [
        {"max_tokens": 12},
        {"max_tokens": 12, "seed": 42},
        {"max_tokens": 30, "seed": 3, "min_tokens": 20, "ignore_eos": False},
        {"max_tokens": 20, "ignore_eos": True, "stop_token_ids": [1, 2]},
        {"max_tokens": 40, "stop_token_ids": [], "temperature": 0.7, "top_p": 0.9, "top_k": 5},
    ],
)
async def test_unary_tokens_equal_the_mock_engine(vllm: Server, sampling: dict[str, Any]) -> None:
    reply = await vllm.post(body(**sampling))
    assert reply.status == 200, reply.text
    outs = await reference(
        PROMPT,
        max_tokens=sampling["max_tokens"],
        seed=sampling.get("seed"),
        min_tokens=sampling.get("min_tokens", 0),
        stop_token_ids=sampling.get("stop_token_ids"),
        ignore_eos=sampling.get("ignore_eos", False),
    )
    (choice,) = reply.body["choices"]
    assert choice["token_ids"] == tokens_of(outs)
    reason, stop_reason = finish_of(outs)
    assert choice["finish_reason"] == reason
    assert choice["stop_reason"] == stop_reason
    assert choice["logprobs"] is None
    assert reply.body["usage"]["completion_tokens"] == len(tokens_of(outs))


async def test_stop_token_and_eos_finish_as_stop(vllm: Server) -> None:
    outs = await reference(PROMPT, max_tokens=10)
    tokens = tokens_of(outs)
    stop_at = tokens[3]
    reply = await vllm.post(body(max_tokens=10, stop_token_ids=[stop_at]))
    (choice,) = reply.body["choices"]
    assert choice["token_ids"] == tokens[: tokens.index(stop_at) + 1]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop_at)

    # A vocabulary of 8 with EOS 7 reaches EOS quickly; the EOS token is part of the output.
    tiny = MockServerConfig(vocab_size=8, eos_token_id=7)
    async with mock_vllm(tiny) as server:
        reply = await server.post(body([1, 2, 3], max_tokens=200))
        (choice,) = reply.body["choices"]
        assert choice["token_ids"][-1] == 7
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", None)
        engine = MockEngine(MockConfig(vocab_size=8, eos_token_id=7))
        expected = [o async for o in engine.generate(request([1, 2, 3], max_tokens=200))]
        assert choice["token_ids"] == tokens_of(expected)
        # min_tokens masks EOS; ignore_eos runs to the budget.
        reply = await server.post(body([1, 2, 3], max_tokens=50, ignore_eos=True))
        (choice,) = reply.body["choices"]
        assert len(choice["token_ids"]) == 50
        assert choice["finish_reason"] == "length"


async def test_unary_response_shape(vllm: Server) -> None:
    reply = await vllm.post({"request_id": "shape", **body(max_tokens=3)})
    assert reply.status == 200
    assert reply.headers["Content-Type"].startswith("application/json")
    out = reply.body
    assert out["request_id"] == "generate-tokens-shape"
    assert out["usage"] == {
        "prompt_tokens": 4,
        "total_tokens": 7,
        "completion_tokens": 3,
        "prompt_tokens_details": None,
    }
    assert out["prompt_logprobs"] is None
    assert out["kv_transfer_params"] is None
    assert out["output_mode"] == "tokens"
    assert out["model"] == CONFIG.model
    (choice,) = out["choices"]
    assert choice["index"] == 0
    assert choice["finish_reason"] == "length"
    assert len(choice["token_ids"]) == 3


async def test_logprobs_equal_the_mock_engine(vllm: Server) -> None:
    for k in (1, 5, 20):
        reply = await vllm.post(body(max_tokens=8, seed=9, logprobs=k))
        outs = await reference(PROMPT, max_tokens=8, seed=9, logprobs=True, top_logprobs=k)
        (choice,) = reply.body["choices"]
        assert choice["logprobs"] == {"content": expected_content(outs, k)}
        for entry in choice["logprobs"]["content"]:
            assert len(entry["top_logprobs"]) == k
            assert entry["top_logprobs"][0]["token_id"] == entry["token_id"]


async def test_logprobs_zero_gives_the_sampled_token_only(vllm: Server) -> None:
    reply = await vllm.post(body(max_tokens=4, logprobs=0))
    outs = await reference(PROMPT, max_tokens=4, logprobs=True)
    (choice,) = reply.body["choices"]
    content = choice["logprobs"]["content"]
    assert content == expected_content(outs, 0)
    for entry in content:
        assert entry["top_logprobs"] == [
            {"token_id": entry["token_id"], "logprob": entry["logprob"], "rank": entry["rank"]}
        ]


async def test_logprobs_of_a_min_tokens_masked_token() -> None:
    """With EOS masked, the sampled token is not the best: its own rank, listed first."""
    tiny = MockServerConfig(vocab_size=8, eos_token_id=7)
    engine = MockEngine(MockConfig(vocab_size=8, eos_token_id=7))
    async with mock_vllm(tiny) as server:
        prompt = [1, 2, 3]
        reply = await server.post(body(prompt, max_tokens=60, min_tokens=60, logprobs=3))
        outs = [
            o
            async for o in engine.generate(
                request(prompt, max_tokens=60, min_tokens=60, logprobs=True, top_logprobs=3)
            )
        ]
        (choice,) = reply.body["choices"]
        assert EOS not in choice["token_ids"]
        content = choice["logprobs"]["content"]
        assert content == expected_content(outs, 3)
        assert any(entry["rank"] > 1 for entry in content), "no masked position in 60 tokens"


async def test_prompt_logprobs(vllm: Server) -> None:
    prompt = [5, 900, 17, 17, 3]
    for k in (0, 2):
        reply = await vllm.post(body(prompt, max_tokens=1, prompt_logprobs=k, seed=4))
        (first, *_) = await reference(
            prompt, max_tokens=1, seed=4, prompt_logprobs_start=0, top_logprobs=k
        )
        plp = reply.body["prompt_logprobs"]
        assert plp[0] is None
        assert len(plp) == len(prompt)
        assert first.prompt_logprobs is not None
        assert first.prompt_ranks is not None
        for pos in range(1, len(prompt)):
            entry = plp[pos]
            keys = list(entry)
            assert keys[0] == str(prompt[pos])  # the actual prompt token first
            assert entry[keys[0]] == {
                "logprob": first.prompt_logprobs[pos],
                "rank": first.prompt_ranks[pos],
                "decoded_token": None,
            }
            tops = (first.prompt_top_logprobs or [None] * len(prompt))[pos] or []
            expected = {str(prompt[pos])}
            for place, (tid, lp) in enumerate(tops, 1):
                expected.add(str(tid))
                if str(tid) != str(prompt[pos]):
                    assert entry[str(tid)] == {"logprob": lp, "rank": place, "decoded_token": None}
            assert set(entry) == expected  # the prompt token plus the top-k


async def test_one_token_prompt_gives_null_prompt_logprobs(vllm: Server) -> None:
    reply = await vllm.post(body([42], max_tokens=1, prompt_logprobs=3))
    assert reply.body["prompt_logprobs"] == [None]


async def test_omitted_max_tokens_uses_the_context_room() -> None:
    config = MockServerConfig(vocab_size=VOCAB, eos_token_id=EOS, max_model_len=40)
    async with mock_vllm(config) as server:
        reply = await server.post(body(ignore_eos=True))
        (choice,) = reply.body["choices"]
        assert len(choice["token_ids"]) == 40 - len(PROMPT)
        assert choice["finish_reason"] == "length"
        outs = await reference(PROMPT, context=40, max_tokens=None, ignore_eos=True)
        assert choice["token_ids"] == tokens_of(outs)
        # An explicit max_tokens beyond the context is capped by it.
        reply = await server.post(body(max_tokens=1000, ignore_eos=True))
        assert len(reply.body["choices"][0]["token_ids"]) == 36


# ------------------------------------------------------------------ ids and headers


async def test_request_ids(vllm: Server) -> None:
    reply = await vllm.post({"request_id": "mine", **body(max_tokens=1)})
    assert reply.body["request_id"] == "generate-tokens-mine"
    # X-Request-Id overrides the body's request_id.
    reply = await vllm.post(
        {"request_id": "body", **body(max_tokens=1)}, headers={"X-Request-Id": "hdr"}
    )
    assert reply.body["request_id"] == "generate-tokens-hdr"
    # None sent: a random uuid.
    first = await vllm.post(body(max_tokens=1))
    second = await vllm.post(body(max_tokens=1))
    for reply in (first, second):
        rid = reply.body["request_id"]
        assert rid.startswith("generate-tokens-")
        assert len(rid) > len("generate-tokens-") + 8
    assert first.body["request_id"] != second.body["request_id"]


async def test_data_parallel_rank_header_is_accepted(vllm: Server) -> None:
    reply = await vllm.post(
        {"request_id": "dp", **body(max_tokens=2)}, headers={"X-data-parallel-rank": "3"}
    )
    assert reply.status == 200
    log = (await vllm.get("/testkit/vllm/requests")).body["requests"]
    assert log[-1]["request_id"] == "generate-tokens-dp"
    assert log[-1]["headers"]["X-data-parallel-rank"] == "3"
    assert log[-1]["body"]["sampling_params"] == {"max_tokens": 2}


async def test_optional_fields_are_accepted(vllm: Server) -> None:
    reply = await vllm.post(
        {
            **body(max_tokens=2, n=1, detokenize=False, extra_args={"x": 1}),
            "model": CONFIG.model,
            "cache_salt": "salt",
            "priority": -5,
            "kv_transfer_params": None,
            "stream": False,
            "output_mode": "tokens",
        }
    )
    assert reply.status == 200, reply.text


# ------------------------------------------------------------------------- errors


async def test_non_json_content_type_is_refused(vllm: Server) -> None:
    payload = json.dumps(body(max_tokens=1))
    for content_type in ("text/plain", "application/x-www-form-urlencoded", ""):
        reply = await vllm.post(payload, content_type=content_type)
        assert_error(reply, 400, "BadRequestError", "application/json")
    reply = await vllm.post(payload, content_type="application/json; charset=utf-8")
    assert reply.status == 200


async def test_model_mismatch_is_404(vllm: Server) -> None:
    reply = await vllm.post({**body(max_tokens=1), "model": "other"})
    assert_error(reply, 404, "NotFoundError", "The model `other` does not exist.")
    assert reply.body["error"]["param"] == "model"
    reply = await vllm.post({**body(max_tokens=1), "model": CONFIG.model})
    assert reply.status == 200


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        ("{not json", "JSON decode error"),
        ([1, 2], "valid dictionary"),
        ({"sampling_params": {}}, "token_ids"),
        ({"token_ids": [], "sampling_params": {}}, "at least 1 item"),
        ({"token_ids": [1, -2], "sampling_params": {}}, "negative"),
        ({"token_ids": [1, "2"], "sampling_params": {}}, "integer"),
        ({"token_ids": [1]}, "sampling_params"),
        ({"token_ids": [1], "sampling_params": []}, "dictionary"),
        ({"token_ids": [1], "request_id": None, "sampling_params": {}}, "string"),
        (body(temperature=-1), "temperature must be non-negative"),
        (body(top_p=0), "top_p must be in (0, 1]"),
        (body(top_k=-2), "top_k"),
        (body(min_p=2), "min_p"),
        (body(max_tokens=0), "max_tokens must be at least 1"),
        (body(min_tokens=-1), "min_tokens must be greater than or equal to 0"),
        (body(max_tokens=4, min_tokens=5), "min_tokens must be less than or equal to max_tokens"),
        # Verified against SamplingParams' default max_tokens (16) before the route
        # replaces an omitted max_tokens: vLLM's quirk.
        (body(min_tokens=17), "max_tokens=16"),
        (body(logprobs=-2), "logprobs must be non-negative or -1"),
        (body(prompt_logprobs=-3), "prompt_logprobs must be non-negative or -1"),
        (body(n=0), "n must be at least 1"),
        (body(n=2), "n > 1"),
        (body(stop=["\n"]), "stop strings"),
        (body(stop="x"), "stop strings"),
        (body(presence_penalty=3), "presence_penalty"),
        (body(repetition_penalty=0), "repetition_penalty"),
        (body(max_tokens="8"), "integer"),
        (body(ignore_eos="yes"), "boolean"),
        ({**body(), "stream": "yes"}, "boolean"),
        ({**body(), "stream_options": {"include_usage": "x"}}, "boolean"),
        ({**body(), "cache_salt": ""}, "cache_salt"),
        ({**body(), "output_mode": "text"}, "output_mode"),
        (body(structured_outputs={"regex": "a+"}), "structured_outputs"),
    ],
)
async def test_validation_errors_are_400(vllm: Server, payload: Any, fragment: str) -> None:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    reply = await vllm.post(data)
    assert_error(reply, 400, "BadRequestError", fragment)
    # Refused before generation: also for a stream, and nothing ran.
    if isinstance(payload, dict) and "stream" not in payload:
        assert_error(await vllm.post({**payload, "stream": True}), 400, "BadRequestError", fragment)
    assert vllm.state.received == 0


@pytest.mark.parametrize(
    ("sampling", "prompt", "fragment"),
    [
        ({"max_tokens": 2}, [1, VOCAB], f"Token id {VOCAB} is out of vocabulary"),
        ({"max_tokens": 2}, list(range(CONTEXT)), "maximum model length"),
        (
            {"logprobs": 21},
            PROMPT,
            "Requested sample logprobs of 21, which is greater than "
            "max allowed: 20 (parameter=logprobs, value=21)",
        ),
        ({"logprobs": -1}, PROMPT, f"Requested sample logprobs of {VOCAB}"),
        ({"prompt_logprobs": 25}, PROMPT, "Requested prompt logprobs of 25"),
    ],
)
async def test_engine_refusals(
    vllm: Server, sampling: dict[str, Any], prompt: list[int], fragment: str
) -> None:
    """Refused when the engine takes the request: 400 for a unary request, an in-band
    error event then [DONE] for a stream (its headers are out already)."""
    reply = await vllm.post(body(prompt, **sampling))
    assert_error(reply, 400, "BadRequestError", fragment)
    status, events = await vllm.stream(body(prompt, **sampling))
    assert status == 200
    assert len(events) == 2
    assert events[1] == "[DONE]"
    assert events[0]["error"]["code"] == 400
    assert fragment in events[0]["error"]["message"]


async def test_unknown_routes_answer_like_fastapi(vllm: Server) -> None:
    reply = await vllm.get("/nope")
    assert (reply.status, reply.body) == (404, {"detail": "Not Found"})
    reply = await vllm.get(PATH)
    assert (reply.status, reply.body) == (405, {"detail": "Method Not Allowed"})


# -------------------------------------------------------------------------- streaming


async def test_stream_sends_token_deltas_then_done(vllm: Server) -> None:
    status, events = await vllm.stream({"request_id": "s", **body(max_tokens=6, seed=1)})
    assert status == 200
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) == 6  # one token per event, no usage chunk without stream_options
    for i, chunk in enumerate(chunks):
        assert chunk["request_id"] == "generate-tokens-s"
        assert chunk["usage"] is None
        (choice,) = chunk["choices"]
        assert choice["index"] == 0
        assert len(choice["token_ids"]) == 1
        assert choice["logprobs"] is None
        assert choice["finish_reason"] == ("length" if i == 5 else None)
    outs = await reference(PROMPT, max_tokens=6, seed=1)
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == tokens_of(outs)


async def test_stream_content_type_and_framing(vllm: Server) -> None:
    async with vllm.session.post(vllm.url + PATH, json={**body(max_tokens=2), "stream": True}) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = (await r.read()).decode()
    assert raw.endswith("data: [DONE]\n\n")
    assert "event:" not in raw
    assert "id:" not in raw


async def test_stream_logprobs_are_deltas(vllm: Server) -> None:
    _, events = await vllm.stream(body(max_tokens=5, logprobs=2))
    outs = await reference(PROMPT, max_tokens=5, logprobs=True, top_logprobs=2)
    content = []
    for chunk in token_chunks(events):
        (choice,) = chunk["choices"]
        assert len(choice["logprobs"]["content"]) == 1
        content += choice["logprobs"]["content"]
    assert content == expected_content(outs, 2)


async def test_stream_usage_chunk_with_stream_options(vllm: Server) -> None:
    # include_usage defaults to true once stream_options is sent.
    _, events = await vllm.stream({"request_id": "u", **body(max_tokens=3), "stream_options": {}})
    assert events[-1] == "[DONE]"
    final = events[-2]
    assert final["choices"] == []
    assert final["request_id"] == "generate-tokens-u"
    assert final["usage"] == {"prompt_tokens": 4, "total_tokens": 7, "completion_tokens": 3}
    assert all(chunk["usage"] is None for chunk in events[:-2])

    _, events = await vllm.stream(
        {**body(max_tokens=3), "stream_options": {"include_usage": False}}
    )
    assert len(events) == 4
    assert all(e == "[DONE]" or e["choices"] for e in events)


async def test_stream_continuous_usage_stats(vllm: Server) -> None:
    _, events = await vllm.stream(
        {**body(max_tokens=3), "stream_options": {"continuous_usage_stats": True}}
    )
    chunks = token_chunks(events)
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3]
    assert all(c["usage"]["prompt_tokens"] == 4 for c in chunks)
    assert events[-2]["choices"] == []
    assert events[-2]["usage"]["completion_tokens"] == 3


async def test_stream_and_unary_agree(vllm: Server) -> None:
    sampling: dict[str, Any] = {"max_tokens": 25, "min_tokens": 3, "seed": 77, "logprobs": 1}
    unary = (await vllm.post(body(**sampling))).body["choices"][0]
    _, events = await vllm.stream(body(**sampling))
    chunks = token_chunks(events)
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == unary["token_ids"]
    assert chunks[-1]["choices"][0]["finish_reason"] == unary["finish_reason"]
    assert [e for c in chunks for e in c["choices"][0]["logprobs"]["content"]] == unary["logprobs"][
        "content"
    ]


# ---------------------------------------------------------------------- aborting


async def test_abort_requests_absent_without_tokens_only() -> None:
    config = MockServerConfig(vocab_size=VOCAB, eos_token_id=EOS, tokens_only=False)
    async with mock_vllm(config) as server:
        reply = await server.abort(["x"])
        assert reply.status == 404
        # Without tokens-only, stop strings are still refused: the mock has no tokenizer.
        reply = await server.post(body(stop=["x"]))
        assert_error(reply, 400, "BadRequestError", "stop strings")


async def test_abort_requests_validation(vllm: Server) -> None:
    reply = await vllm.post({}, path="/abort_requests")
    assert reply.status == 400
    assert "Missing 'request_ids'" in reply.body["error"]["message"]
    assert reply.body["error"]["code"] == 400
    reply = await vllm.post("{oops", path="/abort_requests")
    assert reply.status == 400
    # Unknown ids: fire and forget, 200 with an empty body.
    reply = await vllm.abort(["nobody"])
    assert (reply.status, reply.text) == (200, "")
    assert vllm.state.aborted == []


@pytest.mark.parametrize("which", ["bare", "engine"])
async def test_abort_a_stream(slow: Server, which: str) -> None:
    payload = {"request_id": "ab", **body(max_tokens=500, ignore_eos=True), "stream": True}
    async with slow.session.post(slow.url + PATH, json=payload) as resp:
        first = await read_event(resp)
        assert first["choices"][0]["finish_reason"] is None
        reply = await slow.abort(["ab" if which == "bare" else "generate-tokens-ab"])
        assert (reply.status, reply.text) == (200, "")
        events = parse_sse((await resp.read()).decode())
    assert events[-1] == "[DONE]"
    terminal = events[-2]["choices"][0]
    assert terminal["finish_reason"] == "abort"
    assert terminal["token_ids"] == []  # the terminal chunk is sent without a new token
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-2])
    assert slow.state.aborted == ["generate-tokens-ab"]
    assert slow.state.running == {}
    assert slow.state.completed == 0


async def test_abort_a_unary_request(slow: Server) -> None:
    task = asyncio.create_task(
        slow.post({"request_id": "u1", **body(max_tokens=500, ignore_eos=True, logprobs=0)})
    )
    await slow.wait_running("generate-tokens-u1")
    await asyncio.sleep(0.1)
    await slow.abort("generate-tokens-u1")
    reply = await task
    assert reply.status == 200
    (choice,) = reply.body["choices"]
    assert choice["finish_reason"] == "abort"
    assert 0 < len(choice["token_ids"]) < 500
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
    assert reply.body["usage"]["completion_tokens"] == len(choice["token_ids"])
    assert slow.state.aborted == ["generate-tokens-u1"]


async def test_abort_with_usage_chunk(slow: Server) -> None:
    payload = {
        "request_id": "au",
        **body(max_tokens=500, ignore_eos=True, logprobs=1),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with slow.session.post(slow.url + PATH, json=payload) as resp:
        await read_event(resp)
        await slow.abort(["au"])
        events = parse_sse((await resp.read()).decode())
    terminal = events[-3]["choices"][0]
    assert terminal["finish_reason"] == "abort"
    assert terminal["logprobs"] == {"content": []}
    assert events[-2]["choices"] == []
    assert events[-2]["usage"]["completion_tokens"] == 1 + len(events) - 3


async def test_client_disconnect_aborts_the_generation(slow: Server) -> None:
    payload = {"request_id": "gone", **body(max_tokens=500, ignore_eos=True), "stream": True}
    async with slow.session.post(slow.url + PATH, json=payload) as resp:
        await read_event(resp)
        resp.close()
    await slow.wait_for(lambda: slow.state.disconnected == ["generate-tokens-gone"])
    await slow.wait_for(lambda: not slow.state.running)
    assert slow.state.aborted == []
    assert slow.state.completed == 0

    # A unary request too.
    task = asyncio.create_task(
        slow.post({"request_id": "gone2", **body(max_tokens=500, ignore_eos=True)})
    )
    await slow.wait_running("generate-tokens-gone2")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await slow.wait_for(lambda: "generate-tokens-gone2" in slow.state.disconnected)
    await slow.wait_for(lambda: not slow.state.running)


# --------------------------------------------------------------- health and info


async def test_health_models_version(vllm: Server) -> None:
    reply = await vllm.get("/health")
    assert (reply.status, reply.text) == (200, "")
    async with vllm.session.post(vllm.url + "/testkit/config", json={"healthy": False}) as r:
        assert r.status == 200
    assert (await vllm.get("/health")).status == 503
    models = (await vllm.get("/v1/models")).body
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == CONFIG.model
    assert card["object"] == "model"
    assert card["max_model_len"] == CONTEXT
    version = (await vllm.get("/version")).body
    assert isinstance(version["version"], str)


@pytest.mark.parametrize(("block_size", "expected_block"), [(0, 16), (32, 32)])
async def test_metrics_state_the_cache_config(block_size: int, expected_block: int) -> None:
    """vLLM's Prometheus page carries its CacheConfig as an info gauge (value 1): the block
    size (default 16) and the GPU blocks the KV pool was profiled at."""
    config = MockServerConfig(max_total_num_tokens=8192, block_size=block_size)
    async with mock_vllm(config) as server:
        reply = await server.get("/metrics")
    assert reply.status == 200
    assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    (series,) = [line for line in reply.text.splitlines() if not line.startswith("#")]
    assert series.startswith("vllm:cache_config_info{")
    assert series.endswith("} 1.0")
    assert f'block_size="{expected_block}"' in series
    assert f'num_gpu_blocks="{8192 // expected_block}"' in series
    assert "# TYPE vllm:cache_config_info gauge" in reply.text


async def test_token_delay_applies_to_running_requests() -> None:
    slow_config = MockServerConfig(vocab_size=VOCAB, eos_token_id=EOS, token_delay_ms=60_000)
    async with mock_vllm(slow_config) as server:
        started = time.monotonic()
        task = asyncio.create_task(
            server.post({"request_id": "d", **body(max_tokens=5, ignore_eos=True)})
        )
        await server.wait_running("generate-tokens-d")
        async with server.session.post(
            server.url + "/testkit/config", json={"token_delay_ms": 0}
        ) as r:
            assert r.status == 200
        reply = await asyncio.wait_for(task, 10)
        assert len(reply.body["choices"][0]["token_ids"]) == 5
        assert time.monotonic() - started < 10


async def test_token_delay_paces_the_stream() -> None:
    config = MockServerConfig(vocab_size=VOCAB, eos_token_id=EOS, token_delay_ms=50)
    async with mock_vllm(config) as server:
        started = time.monotonic()
        await server.stream(body(max_tokens=6, ignore_eos=True))
        assert time.monotonic() - started >= 0.25


# -------------------------------------------------------------------------- faults


async def test_fault_http_error(vllm: Server) -> None:
    await vllm.fault(kind="http_error", status=503, message="overloaded", count=2)
    reply = await vllm.post(body(max_tokens=2))
    assert_error(reply, 503, "ServiceUnavailableError", "overloaded")
    reply = await vllm.post({**body(max_tokens=2), "stream": True})
    assert_error(reply, 503, "ServiceUnavailableError", "overloaded")
    assert (await vllm.post(body(max_tokens=2))).status == 200
    assert vllm.state.received == 3
    assert vllm.state.completed == 1


async def test_fault_http_error_mid_stream(vllm: Server) -> None:
    await vllm.fault(kind="http_error", status=500, after_tokens=2, message="boom")
    status, events = await vllm.stream(body(max_tokens=10))
    assert status == 200
    assert len(token_chunks(events)) == 2
    assert events[-1] == "[DONE]"
    assert events[-2] == {
        "error": {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}
    }
    # Unary: the status once the tokens are generated.
    await vllm.fault(kind="http_error", status=500, after_tokens=2, message="boom")
    assert_error(await vllm.post(body(max_tokens=10)), 500, "InternalServerError", "boom")


async def test_fault_abort(vllm: Server) -> None:
    await vllm.fault(kind="abort", after_tokens=3, count=2)
    _status, events = await vllm.stream({**body(max_tokens=10), "stream_options": {}})
    chunks = token_chunks(events)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "abort"]
    assert chunks[-1]["choices"][0]["token_ids"] == []
    assert events[-2]["usage"]["completion_tokens"] == 3
    assert events[-1] == "[DONE]"
    reply = await vllm.post(body(max_tokens=10))
    assert reply.status == 200
    (choice,) = reply.body["choices"]
    assert (choice["finish_reason"], len(choice["token_ids"])) == ("abort", 3)
    assert vllm.state.completed == 0


async def test_fault_drop(vllm: Server) -> None:
    await vllm.fault(kind="drop", after_tokens=2, count=2)
    payload = {**body(max_tokens=10), "stream": True}
    async with vllm.session.post(vllm.url + PATH, json=payload) as resp:
        assert resp.status == 200
        assert (await read_event(resp))["choices"][0]["token_ids"]
        assert (await read_event(resp))["choices"][0]["token_ids"]
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await vllm.post(body(max_tokens=10))
    assert vllm.state.disconnected == []
    assert vllm.state.running == {}


async def test_fault_no_terminal(vllm: Server) -> None:
    await vllm.fault(kind="no_terminal", after_tokens=2, count=2)
    status, events = await vllm.stream({**body(max_tokens=10), "stream_options": {}})
    assert status == 200
    assert len(events) == 2
    assert "[DONE]" not in events
    assert all(e["choices"][0]["finish_reason"] is None for e in events)
    reply = await vllm.post(body(max_tokens=10))
    assert reply.status == 200
    assert isinstance(reply.body, str)


async def test_fault_done_early(vllm: Server) -> None:
    await vllm.fault(kind="done_early", after_tokens=1)
    status, events = await vllm.stream({**body(max_tokens=10), "stream_options": {}})
    assert status == 200
    assert len(events) == 2
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["finish_reason"] is None


async def test_fault_hang_until_aborted(vllm: Server) -> None:
    await vllm.fault(kind="hang", after_tokens=1)
    payload = {"request_id": "h", **body(max_tokens=10), "stream": True}
    async with vllm.session.post(vllm.url + PATH, json=payload) as resp:
        await read_event(resp)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(resp.content.readline(), 0.3)
        await vllm.abort(["h"])
        events = parse_sse((await resp.read()).decode())
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "abort"


async def test_fault_hang_until_the_client_leaves(vllm: Server) -> None:
    await vllm.fault(kind="hang", after_tokens=0)
    task = asyncio.create_task(vllm.post({"request_id": "h2", **body(max_tokens=10)}))
    await vllm.wait_running("generate-tokens-h2")
    await asyncio.sleep(0.2)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await vllm.wait_for(lambda: vllm.state.disconnected == ["generate-tokens-h2"])


async def test_faults_can_be_cleared(vllm: Server) -> None:
    await vllm.fault(kind="http_error", status=500, count=-1)
    assert (await vllm.post(body(max_tokens=1))).status == 500
    assert (await vllm.post(body(max_tokens=1))).status == 500
    async with vllm.session.delete(vllm.url + "/testkit/faults") as r:
        assert r.status == 200
    assert (await vllm.post(body(max_tokens=1))).status == 200


# ------------------------------------------------------------ prefill / decode


async def test_pd_prefill_returns_kv_transfer_params(vllm: Server) -> None:
    prompt = list(range(100, 140))  # 40 tokens: two full KV blocks of 16
    kv = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    reply = await vllm.post(
        {"request_id": "p", **body(prompt, max_tokens=1), "kv_transfer_params": kv}
    )
    assert reply.body["choices"][0]["finish_reason"] == "length"
    params = reply.body["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    assert params["do_remote_decode"] is False
    assert params["remote_block_ids"] == [[0, 1]]
    assert params["remote_request_id"] == "generate-tokens-p"
    assert isinstance(params["remote_engine_id"], str)

    # Decode consumes them and samples every output token itself.
    plain = await vllm.post(body(prompt, max_tokens=6))
    decode = await vllm.post({**body(prompt, max_tokens=6), "kv_transfer_params": params})
    assert decode.body["choices"][0]["token_ids"] == plain.body["choices"][0]["token_ids"]
    assert decode.body["kv_transfer_params"] is None

    # Only a length-capped prefill hands KV over.
    first = plain.body["choices"][0]["token_ids"][0]
    stopped = await vllm.post(
        {**body(prompt, max_tokens=1, stop_token_ids=[first]), "kv_transfer_params": kv}
    )
    assert stopped.body["choices"][0]["finish_reason"] == "stop"
    assert stopped.body["kv_transfer_params"] is None
    # ...and newest builds also read it from sampling_params.extra_args.
    extra = await vllm.post(body(prompt, max_tokens=1, extra_args={"kv_transfer_params": kv}))
    assert extra.body["kv_transfer_params"]["do_remote_prefill"] is True


# ---------------------------------------------------------------- old profile


async def test_old_profile() -> None:
    async with mock_vllm(CONFIG, profile="old") as server:
        # No streaming: `stream` is ignored and one JSON body comes back.
        reply = await server.post(
            {"request_id": "o", **body(ignore_eos=True, logprobs=2), "stream": True}
        )
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("application/json")
        assert reply.body["request_id"] == "generate-tokens-o"
        assert "output_mode" not in reply.body
        (choice,) = reply.body["choices"]
        assert len(choice["token_ids"]) == 16  # omitted max_tokens: SamplingParams' 16
        outs = await reference(PROMPT, max_tokens=16, ignore_eos=True, logprobs=True,
                               top_logprobs=2)  # fmt: skip
        for entry, expected in zip(
            choice["logprobs"]["content"], expected_content(outs, 2), strict=True
        ):
            assert entry["token"] == f"token_id:{expected['token_id']}"
            assert entry["logprob"] == expected["logprob"]
            assert entry["bytes"] is None
            assert [t["token"] for t in entry["top_logprobs"]] == [
                f"token_id:{t['token_id']}" for t in expected["top_logprobs"]
            ]
        # n > 1: one choice per sample, sample i seeded seed + i.
        reply = await server.post(body(max_tokens=5, n=3, seed=10))
        choices = reply.body["choices"]
        assert [c["index"] for c in choices] == [0, 1, 2]
        for i, c in enumerate(choices):
            assert c["token_ids"] == tokens_of(await reference(PROMPT, max_tokens=5, seed=10 + i))
        assert reply.body["usage"]["completion_tokens"] == 15
        # Top-level kv_transfer_params are not forwarded to the engine; extra_args are.
        prompt = list(range(100, 140))
        kv = {"do_remote_decode": True}
        top = await server.post({**body(prompt, max_tokens=1), "kv_transfer_params": kv})
        assert top.body["kv_transfer_params"] is None
        extra = await server.post(body(prompt, max_tokens=1, extra_args={"kv_transfer_params": kv}))
        assert extra.body["kv_transfer_params"]["do_remote_prefill"] is True


def test_bad_build_arguments() -> None:
    with pytest.raises(ValueError, match="profile"):
        build_app(CONFIG, profile="ancient")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="EOS"):
        build_app(MockServerConfig(vocab_size=8, eos_token_id=8))


# ------------------------------------------------------------------------- CLI


@pytest.mark.process
def test_cli_serves_and_stops_on_sigterm() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "genmesh",
            "testkit",
            "vllm",
            "--port",
            str(port),
            "--vocab-size",
            str(VOCAB),
            "--eos-token-id",
            str(EOS),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert proc.poll() is None, proc.communicate()
        try:
            with urllib.request.urlopen(base + "/health", timeout=1) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    try:
        wait_until(healthy, timeout=20, what="the mock vLLM server to listen")
        req = urllib.request.Request(
            base + PATH,
            data=json.dumps({"request_id": "cli", **body(max_tokens=4)}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            out = json.loads(resp.read())
        assert out["request_id"] == "generate-tokens-cli"
        assert len(out["choices"][0]["token_ids"]) == 4
        # tokens-only by default: /abort_requests exists.
        req = urllib.request.Request(
            base + "/abort_requests",
            data=b'{"request_ids": []}',
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, stderr
    assert f"listening on http://127.0.0.1:{port}" in stdout

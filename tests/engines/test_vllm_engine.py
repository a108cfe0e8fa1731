"""The `vllm` engine adapter: request bodies, response parsing, and its behaviour against
genmesh's mock vLLM server (both profiles: "new" streams SSE, "old" answers unary)."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict

from genmesh.client import request
from genmesh.engines import create_engine
from genmesh.engines import vllm as vllm_mod
from genmesh.engines.base import EngineOutput
from genmesh.engines.http import INCOMPLETE, HttpEngineConfig
from genmesh.engines.mock import MockConfig, MockEngine
from genmesh.engines.vllm import (
    ENGINE_ID_PREFIX,
    VllmEngine,
    _Parser,
    client_kv_transfer_params,
    engine_request_ids,
    vllm_request,
)
from genmesh.formats.vllm import VllmFormat
from genmesh.shared.envelope import Envelope, OutputOptions, Routing, Sampling
from genmesh.shared.errors import ErrorCode, MeshError
from genmesh.testkit.common import serving
from genmesh.testkit.config import MockServerConfig
from genmesh.testkit.vllm import build_app, state_of

pytestmark = pytest.mark.inproc

VOCAB, EOS = 1000, 7
PROMPT = [11, 22, 33, 44, 55, 66]
_ids = itertools.count()


def envelope(token_ids: list[int] | None = None, **knobs: Any) -> Envelope:
    env = request(PROMPT if token_ids is None else token_ids, **knobs)
    env.id = f"client-visible-{next(_ids)}"
    return env


def vllm_envelope(body: dict[str, Any], headers: dict[str, str] | None = None) -> Envelope:
    """An envelope as genmesh's vLLM format binds it from a client's body."""
    fmt = VllmFormat()
    bound = fmt.bind(
        fmt.parse(json.dumps(body).encode()),
        CIMultiDict({"content-type": "application/json", **(headers or {})}),
    )
    env = bound.items[0]
    env.id = f"client-visible-{next(_ids)}"
    return env


def tokens_of(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.tokens]


def flat(outs: list[EngineOutput], name: str) -> list[Any]:
    return [v for o in outs for v in (getattr(o, name) or [])]


def first(outs: list[EngineOutput], name: str) -> Any:
    return next((getattr(o, name) for o in outs if getattr(o, name) is not None), None)


async def collect(engine: Any, env: Envelope) -> list[EngineOutput]:
    return [out async for out in engine.generate(env)]


async def failure(engine: Any, env: Envelope) -> tuple[MeshError, list[EngineOutput]]:
    outs: list[EngineOutput] = []

    async def run() -> None:
        async for out in engine.generate(env):
            outs.append(out)

    with pytest.raises(MeshError) as info:
        await run()
    return info.value, outs


async def mock_outputs(env: Envelope, eos: int = EOS) -> list[EngineOutput]:
    return await collect(MockEngine(MockConfig(vocab_size=VOCAB, eos_token_id=eos)), env)


# ---------------------------------------------------------------------- request bodies


def test_body_from_canonical_fields() -> None:
    env = envelope(max_tokens=5, min_tokens=2, seed=9, stop_token_ids=[3], ignore_eos=True)
    env.client_id = "the-clients-id"
    env.sampling.temperature, env.sampling.top_k = 0.5, 4
    env.routing = Routing(dp_rank=3, priority=7, cache_salt="salt")
    body, headers = vllm_request(env, "d" * 32, "served-model")
    assert body["request_id"] == "d" * 32
    assert body["token_ids"] == PROMPT
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["model"] == "served-model"
    assert body["priority"] == -7  # vLLM: lower = more urgent
    assert body["cache_salt"] == "salt"
    assert headers["X-data-parallel-rank"] == "3"
    assert body["sampling_params"] == {
        "max_tokens": 5,
        "min_tokens": 2,
        "stop_token_ids": [3],
        "ignore_eos": True,
        "seed": 9,
        "temperature": 0.5,
        "top_k": 4,
        "n": 1,
        "detokenize": False,
    }
    assert "kv_transfer_params" not in body


def test_body_omits_what_is_unset() -> None:
    env = envelope(max_tokens=None)
    body, headers = vllm_request(env, "x" * 32)
    sp = body["sampling_params"]
    assert "max_tokens" not in sp  # the server's default
    assert "seed" not in sp
    assert "logprobs" not in sp
    assert "prompt_logprobs" not in sp
    assert "model" not in body
    assert "priority" not in body
    assert "cache_salt" not in body
    assert "X-data-parallel-rank" not in headers


def test_body_logprob_options() -> None:
    body, _ = vllm_request(envelope(logprobs=True), "x" * 32)
    assert body["sampling_params"]["logprobs"] == 0
    body, _ = vllm_request(envelope(logprobs=True, top_logprobs=4), "x" * 32)
    assert body["sampling_params"]["logprobs"] == 4
    assert body["stream"] is True
    # Prompt logprobs: vLLM's streams do not carry them, so the request is unary.
    body, _ = vllm_request(envelope(prompt_logprobs_start=2, top_logprobs=3), "x" * 32)
    assert body["sampling_params"]["prompt_logprobs"] == 3
    assert "logprobs" not in body["sampling_params"]
    assert body["stream"] is False
    assert "stream_options" not in body


def test_body_max_tokens_zero_asks_for_one() -> None:
    body, _ = vllm_request(envelope(max_tokens=0), "x" * 32)
    assert body["sampling_params"]["max_tokens"] == 1


def test_body_from_a_vllm_request_keeps_native_fields() -> None:
    client = {
        "request_id": "client-rid",
        "token_ids": [5, 6, 7],
        "model": "whatever-the-client-said",
        "stream": False,
        "stream_options": {"include_usage": False},
        "priority": -5,
        "cache_salt": "s1",
        "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "p1"},
        "sampling_params": {
            "max_tokens": 9,
            "repetition_penalty": 1.1,
            "logprobs": 2,
            "output_kind": 1,
            "extra_args": {"mine": 1},
        },
    }
    env = vllm_envelope(client, {"X-data-parallel-rank": "1"})
    # As `generate` sends it: with the client's own kv_transfer_params.
    body, headers = vllm_request(env, "e" * 32, "genmesh-mock", client_kv_transfer_params(env))
    assert body["request_id"] == "e" * 32  # never the client's id
    assert body["token_ids"] == [5, 6, 7]
    assert body["model"] == "genmesh-mock"
    assert body["priority"] == -5  # negated twice: the client's own value again
    assert body["cache_salt"] == "s1"
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    kv = {"do_remote_prefill": True, "remote_engine_id": "p1"}
    assert body["kv_transfer_params"] == kv
    sp = body["sampling_params"]
    assert sp["repetition_penalty"] == 1.1
    assert sp["max_tokens"] == 9
    assert sp["logprobs"] == 2
    assert sp["n"] == 1
    assert "output_kind" not in sp
    # v0.11-v0.18 read kv_transfer_params only from extra_args.
    assert sp["extra_args"] == {"mine": 1, "kv_transfer_params": kv}
    assert "detokenize" not in sp  # the client's call
    assert headers["X-data-parallel-rank"] == "1"
    # A P/D half sends its own params, or none: never the client's.
    body, _ = vllm_request(env, "e" * 32, "genmesh-mock")
    assert "kv_transfer_params" not in body
    assert body["sampling_params"]["extra_args"] == {"mine": 1}


def test_a_prefill_leg_is_unary() -> None:
    """vLLM returns a prefill's kv_transfer_params only in a unary body."""
    env = vllm_envelope(
        {"token_ids": [1, 2], "sampling_params": {"max_tokens": 1},
         "kv_transfer_params": {"do_remote_decode": True}}
    )  # fmt: skip
    body, _ = vllm_request(env, "x" * 32, None, client_kv_transfer_params(env))
    assert body["stream"] is False
    assert "stream_options" not in body
    assert body["sampling_params"]["extra_args"] == {
        "kv_transfer_params": {"do_remote_decode": True}
    }


def test_abort_names_the_engine_id_and_the_bare_one() -> None:
    assert engine_request_ids("abc") == [ENGINE_ID_PREFIX + "abc", "abc"]


def test_dispatch_ids_are_fresh() -> None:
    ids = {vllm_mod.new_dispatch_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(len(i) == 32 for i in ids)


# -------------------------------------------------------------------- response parsing


def content(token: int, logprob: float, rank: int, tops: list[tuple[int, float, int]]) -> Any:
    return {
        "token_id": token,
        "logprob": logprob,
        "rank": rank,
        "top_logprobs": [{"token_id": t, "logprob": lp, "rank": r} for t, lp, r in tops],
    }


def chunk(tokens: list[int], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choice = {"index": 0, "token_ids": tokens, "finish_reason": finish, "stop_reason": None}
    choice.update(extra.pop("choice", {}))
    return {"request_id": "generate-tokens-x", "choices": [choice], "usage": None, **extra}


def test_parse_sse_chunks_with_logprobs() -> None:
    env = envelope(logprobs=True, top_logprobs=2)
    parser = _Parser(env)
    entry = content(5, -0.5, 1, [(5, -0.5, 1), (9, -1.0, 2)])
    one = chunk([5], choice={"logprobs": {"content": [entry]}})
    out = parser.parse(one)
    assert out is not None
    assert out.finish is None
    assert out.tokens == [5]
    assert out.logprobs == [-0.5]
    assert out.ranks == [1]
    assert out.top_logprobs == [[(5, -0.5), (9, -1.0)]]
    # A sampled token outside the top-k is listed first with its rank; it is no top-k entry.
    two = chunk([8], "length", choice={"logprobs": {"content": [
        content(8, -3.0, 6, [(8, -3.0, 6), (4, -0.2, 1)])]}})  # fmt: skip
    out = parser.parse(two)
    assert out is not None
    assert out.finish == {"reason": "length"}
    assert out.ranks == [6]
    assert out.top_logprobs == [[(4, -0.2)]]
    parser.usage = {"prompt_tokens": 6, "completion_tokens": 2,
                    "prompt_tokens_details": {"cached_tokens": 4}}  # fmt: skip
    final = parser.finalize(out)
    assert final.usage == {"prompt_tokens": 6, "completion_tokens": 2, "cached_tokens": 4}
    assert final.cached_tokens == 4


def test_parse_old_placeholder_logprobs() -> None:
    env = envelope(logprobs=True, top_logprobs=2)
    body = {
        "request_id": "uuid",
        "choices": [
            {
                "index": 0,
                "finish_reason": "length",
                "token_ids": [5, 8],
                "logprobs": {
                    "content": [
                        {"token": "token_id:5", "logprob": -0.5, "bytes": None, "top_logprobs": [
                            {"token": "token_id:5", "logprob": -0.5},
                            {"token": "token_id:9", "logprob": -1.0}]},
                        {"token": "token_id:8", "logprob": -0.1, "top_logprobs": [
                            {"token": "token_id:8", "logprob": -0.1}]},
                    ]
                },
            }
        ],
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    }  # fmt: skip
    out = _Parser(env).parse(body)
    assert out is not None
    assert out.tokens == [5, 8]
    assert out.logprobs == [-0.5, -0.1]
    assert out.top_logprobs == [[(5, -0.5), (9, -1.0)], [(8, -0.1)]]
    # No ranks from old servers; the first is implied by the list, the second is not.
    assert out.ranks is None
    assert out.engine is None


def test_parse_prompt_logprobs_trimmed_to_the_start() -> None:
    env = envelope([10, 11, 12, 13], prompt_logprobs_start=1, top_logprobs=2)
    rows = [
        None,
        {"11": {"logprob": -2.0, "rank": 3, "decoded_token": None},
         "1": {"logprob": -0.1, "rank": 1, "decoded_token": None},
         "2": {"logprob": -0.9, "rank": 2, "decoded_token": None}},
        {"12": {"logprob": -0.2, "rank": 1, "decoded_token": None},
         "3": {"logprob": -0.7, "rank": 2, "decoded_token": None}},
        {"13": {"logprob": -0.3, "rank": 2, "decoded_token": None},
         "4": {"logprob": -0.05, "rank": 1, "decoded_token": None}},
    ]  # fmt: skip
    out = _Parser(env).parse({**chunk([], "length"), "prompt_logprobs": rows})
    assert out is not None
    # Positions 1..3; the first requested position has no logprob (as every engine's).
    assert out.prompt_logprobs == [None, -0.2, -0.3]
    assert out.prompt_ranks == [None, 1, 2]
    assert out.prompt_top_logprobs == [None, [(12, -0.2), (3, -0.7)], [(4, -0.05), (13, -0.3)]]


@pytest.mark.parametrize(
    ("reason", "stop_reason", "expected"),
    [
        ("stop", None, {"reason": "stop", "matched": None}),
        ("stop", 42, {"reason": "stop", "matched": 42}),
        ("stop", "a string", {"reason": "stop", "matched": None}),
        ("length", None, {"reason": "length"}),
        ("abort", None, {"reason": "abort"}),
    ],
)
def test_finish_reasons(reason: str, stop_reason: Any, expected: dict[str, Any]) -> None:
    out = _Parser(envelope()).parse(chunk([1], reason, choice={"stop_reason": stop_reason}))
    assert out is not None
    assert out.finish == expected


def test_finish_reason_error_is_retryable() -> None:
    with pytest.raises(MeshError) as info:
        _Parser(envelope()).parse(chunk([1], "error"))
    assert info.value.code is ErrorCode.UNAVAILABLE
    # The status vLLM's streaming route answers it with: one shape for both routes.
    assert info.value.detail == {"status_code": 500}


def test_error_event_before_and_after_tokens() -> None:
    error = {"error": {"message": "bad", "type": "BadRequestError", "param": None, "code": 400}}
    parser = _Parser(envelope())
    with pytest.raises(MeshError) as info:
        parser.parse(error)
    assert info.value.code is ErrorCode.INVALID_ARGUMENT
    assert info.value.message == "bad"
    assert info.value.detail == {"status_code": 400, "err_type": "BadRequestError"}
    parser.parse(chunk([1]))
    with pytest.raises(MeshError) as info:
        parser.parse(error)
    assert info.value.code is ErrorCode.UNAVAILABLE
    # An engine failure (5xx) is retryable even before the first token.
    with pytest.raises(MeshError) as info:
        _Parser(envelope()).parse({"error": {"message": "boom", "code": 500}})
    assert info.value.code is ErrorCode.UNAVAILABLE


def test_engine_extras_pass_through() -> None:
    body = chunk(
        [1],
        "length",
        choice={"sampling_mask": "abc", "routed_experts": None, "weight_versions": [3]},
        kv_transfer_params={"remote_engine_id": "e1"},
        ec_transfer_params=None,
    )
    out = _Parser(envelope()).parse(body)
    assert out is not None
    assert out.engine == {
        "sampling_mask": "abc",
        "weight_versions": [3],
        "kv_transfer_params": {"remote_engine_id": "e1"},
    }


def test_empty_chunks_are_skipped_and_usage_kept() -> None:
    parser = _Parser(envelope())
    assert parser.parse(chunk([])) is None
    usage = {"prompt_tokens": 6, "completion_tokens": 0}
    assert parser.parse({"request_id": "r", "choices": [], "usage": usage}) is None
    assert parser.usage == usage


def test_max_tokens_zero_keeps_an_abort() -> None:
    """The dropped token's finish reads "length", but an abort stays an abort."""
    out = _Parser(envelope(max_tokens=0)).parse(chunk([], "abort"))
    assert out is not None
    assert out.finish == {"reason": "abort"}


def test_max_tokens_zero_drops_the_token() -> None:
    parser = _Parser(envelope(max_tokens=0))
    out = parser.parse(chunk([5], "length"))
    assert out is not None
    assert out.tokens == []
    assert out.finish == {"reason": "length"}
    assert parser.finalize(out).usage == {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": 0,
        "cached_tokens": 0,
    }


def test_malformed_token_ids_are_an_engine_failure() -> None:
    with pytest.raises(MeshError) as info:
        _Parser(envelope()).parse(chunk(["x"]))  # type: ignore[list-item]
    assert info.value.code is ErrorCode.UNAVAILABLE


# --------------------------------------------------------------- against the mock server


@dataclass
class Server:
    url: str
    app: Any
    admin: aiohttp.ClientSession

    def state(self) -> dict[str, Any]:
        return state_of(self.app).snapshot()

    async def fault(self, kind: str, **fields: Any) -> None:
        async with self.admin.post(
            f"{self.url}/testkit/faults", json={"kind": kind, **fields}
        ) as r:
            assert r.status == 200, await r.text()

    async def configure(self, **fields: Any) -> None:
        async with self.admin.post(f"{self.url}/testkit/config", json=fields) as r:
            assert r.status == 200, await r.text()

    async def requests(self) -> list[dict[str, Any]]:
        async with self.admin.get(f"{self.url}/testkit/vllm/requests") as r:
            data: dict[str, Any] = await r.json()
            return list(data["requests"])


@pytest.fixture
def server_options(request: pytest.FixtureRequest) -> dict[str, Any]:
    return dict(getattr(request, "param", {}))


@pytest.fixture(params=["new", "old"])
def profile(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def server(profile: str, server_options: dict[str, Any]) -> AsyncIterator[Server]:
    config = MockServerConfig(vocab_size=VOCAB, eos_token_id=EOS, **server_options)
    app = build_app(config, profile=profile)  # type: ignore[arg-type]
    async with serving(app) as url, aiohttp.ClientSession() as admin:
        yield Server(url, app, admin)


@pytest.fixture
async def engine(server: Server) -> AsyncIterator[VllmEngine]:
    eng = VllmEngine(HttpEngineConfig(url=server.url, abort_timeout_s=2.0))
    await eng.start()
    assert await eng.healthy()
    yield eng
    await eng.close()


async def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.01)


def fixed_dispatch_id(monkeypatch: pytest.MonkeyPatch, *ids: str) -> None:
    it = iter(ids)
    monkeypatch.setattr(vllm_mod, "new_dispatch_id", lambda: next(it))


EQUAL_CASES: dict[str, dict[str, Any]] = {
    "plain": {"max_tokens": 12},
    "seeded": {"max_tokens": 8, "seed": 1234},
    "logprobs": {"max_tokens": 6, "logprobs": True},
    "top_logprobs": {"max_tokens": 6, "logprobs": True, "top_logprobs": 4},
    "prompt_logprobs": {"max_tokens": 4, "prompt_logprobs_start": 0},
    "prompt_top_logprobs_from_2": {
        "max_tokens": 4,
        "logprobs": True,
        "top_logprobs": 3,
        "prompt_logprobs_start": 2,
    },
    "scoring_only": {"max_tokens": 0, "prompt_logprobs_start": 1, "top_logprobs": 2},
    "min_tokens": {"max_tokens": 10, "min_tokens": 10, "logprobs": True},
}


@pytest.mark.parametrize("case", EQUAL_CASES)
async def test_outputs_equal_the_mock_engine(engine: VllmEngine, profile: str, case: str) -> None:
    env = envelope(**EQUAL_CASES[case])
    got = await collect(engine, env)
    want = await mock_outputs(env)
    assert tokens_of(got) == tokens_of(want)
    assert flat(got, "logprobs") == flat(want, "logprobs")
    if env.output.top_logprobs and env.output.logprobs:
        assert flat(got, "top_logprobs") == flat(want, "top_logprobs")
    if profile == "new" or env.output.top_logprobs > 1:
        # Old servers report no ranks; with a top-k list they are implied.
        assert flat(got, "ranks") == flat(want, "ranks")
    for name in ("prompt_logprobs", "prompt_ranks", "prompt_top_logprobs"):
        assert first(got, name) == first(want, name), name
    assert got[-1].finish is not None
    assert got[-1].usage == want[-1].usage
    assert all(o.finish is None for o in got[:-1])


async def test_streams_on_new_servers_and_is_unary_on_old(engine: VllmEngine, profile: str) -> None:
    outs = await collect(engine, envelope(max_tokens=5))
    if profile == "new":
        assert [len(o.tokens) for o in outs] == [1] * 5
    else:
        assert len(outs) == 1
        assert len(outs[0].tokens) == 5


async def test_usage(engine: VllmEngine) -> None:
    outs = await collect(engine, envelope(max_tokens=7))
    assert outs[-1].usage == {"prompt_tokens": len(PROMPT), "completion_tokens": 7,
                              "cached_tokens": 0}  # fmt: skip


async def test_omitted_max_tokens_is_the_servers_default(engine: VllmEngine, profile: str) -> None:
    outs = await collect(engine, envelope([1, 2], max_tokens=None, ignore_eos=True))
    if profile == "old":
        assert len(tokens_of(outs)) == 16  # old vLLM's silent default
    else:
        assert len(tokens_of(outs)) > 16


async def test_finish_length_stop_token_and_eos(server: Server, profile: str) -> None:
    greedy = tokens_of(await mock_outputs(envelope(max_tokens=12)))
    stop = next(t for i, t in enumerate(greedy) if i >= 2 and t not in greedy[:i])
    eng = VllmEngine(HttpEngineConfig(url=server.url))
    try:
        outs = await collect(eng, envelope(max_tokens=12, stop_token_ids=[stop]))
        assert tokens_of(outs)[-1] == stop
        assert outs[-1].finish == {"reason": "stop", "matched": stop}
        outs = await collect(eng, envelope(max_tokens=3))
        assert outs[-1].finish == {"reason": "length"}
    finally:
        await eng.close()
    # EOS: a server whose EOS is the third greedy token.
    eos = greedy[2]
    assert eos not in greedy[:2]
    app = build_app(MockServerConfig(vocab_size=VOCAB, eos_token_id=eos), profile=profile)  # type: ignore[arg-type]
    async with serving(app) as url:
        eng = VllmEngine(HttpEngineConfig(url=url))
        try:
            outs = await collect(eng, envelope(max_tokens=12))
        finally:
            await eng.close()
    assert tokens_of(outs) == greedy[:3]
    assert outs[-1].finish == {"reason": "stop", "matched": None}


async def test_engine_abort_finish(server: Server, engine: VllmEngine) -> None:
    await server.fault("abort", after_tokens=2)
    outs = await collect(engine, envelope(max_tokens=10))
    assert len(tokens_of(outs)) == 2
    assert outs[-1].finish == {"reason": "abort"}


async def test_sent_fields_reach_the_server(server: Server, engine: VllmEngine) -> None:
    env = envelope(max_tokens=3)
    env.routing = Routing(dp_rank=2, priority=5, cache_salt="tenant-a")
    await collect(engine, env)
    (sent,) = await server.requests()
    assert sent["headers"]["X-data-parallel-rank"] == "2"
    body = sent["body"]
    assert body["priority"] == -5
    assert body["cache_salt"] == "tenant-a"
    assert body["model"] == "genmesh-mock"
    assert env.id not in json.dumps(body)


async def test_kv_transfer_params_round_trip(engine: VllmEngine) -> None:
    """A P/D prefill leg: kv_transfer_params reach the engine (top level on new servers,
    extra_args on old ones) and the reply's come back as an engine extra."""
    env = vllm_envelope(
        {
            "token_ids": list(range(1, 40)),
            "sampling_params": {"max_tokens": 1},
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
        }
    )
    outs = await collect(engine, env)
    kv = (outs[-1].engine or {}).get("kv_transfer_params")
    assert kv is not None
    assert kv["do_remote_prefill"] is True
    assert kv["remote_block_ids"] == [[0, 1]]


# ----------------------------------------------------------------------------- errors


async def test_4xx_is_invalid_argument(server: Server, engine: VllmEngine) -> None:
    err, _ = await failure(engine, envelope([1, VOCAB + 5], max_tokens=3))
    assert err.code is ErrorCode.INVALID_ARGUMENT
    assert "out of vocabulary" in err.message
    assert err.detail is not None
    assert err.detail["status_code"] == 400
    await server.fault("http_error", status=422, message="no such thing")
    err, _ = await failure(engine, envelope(max_tokens=3))
    assert err.code is ErrorCode.INVALID_ARGUMENT
    assert err.message == "no such thing"
    assert err.detail == {"status_code": 422, "err_type": "UnprocessableEntityError"}


async def test_validation_error_keeps_status_and_type(engine: VllmEngine) -> None:
    env = envelope(max_tokens=3)
    env.sampling.top_p = 5.0
    err, _ = await failure(engine, env)
    assert err.code is ErrorCode.INVALID_ARGUMENT
    assert err.detail == {"status_code": 400, "err_type": "BadRequestError"}
    assert "top_p" in err.message


async def test_5xx_is_unavailable(server: Server, engine: VllmEngine) -> None:
    await server.fault("http_error", status=503, message="overloaded")
    err, _ = await failure(engine, envelope(max_tokens=3))
    assert err.code is ErrorCode.UNAVAILABLE
    assert err.retryable
    assert err.detail is not None
    assert err.detail["status_code"] == 503


async def test_error_after_tokens_is_unavailable(
    server: Server, engine: VllmEngine, profile: str
) -> None:
    await server.fault("http_error", status=400, after_tokens=2, message="late")
    err, outs = await failure(engine, envelope(max_tokens=6))
    if profile == "new":  # in-band, after two streamed tokens
        assert err.code is ErrorCode.UNAVAILABLE
        assert len(tokens_of(outs)) == 2
    else:  # an old server answers the status once it has generated
        assert err.code is ErrorCode.INVALID_ARGUMENT


async def test_connection_refused() -> None:
    async with serving(build_app(MockServerConfig())) as url:
        pass  # the port is free again
    eng = VllmEngine(HttpEngineConfig(url=url, connect_timeout_s=1.0))
    try:
        assert not await eng.healthy()
        err, _ = await failure(eng, envelope(max_tokens=3))
    finally:
        await eng.close()
    assert err.code is ErrorCode.UNAVAILABLE
    assert err.retryable


async def test_drop_mid_stream(server: Server, engine: VllmEngine, profile: str) -> None:
    await server.fault("drop", after_tokens=3)
    err, outs = await failure(engine, envelope(max_tokens=10))
    assert err.code is ErrorCode.UNAVAILABLE
    assert err.detail is not None
    assert err.detail.get("reason") == "connection_lost"
    assert len(tokens_of(outs)) == (3 if profile == "new" else 0)


@pytest.mark.parametrize("kind", ["no_terminal", "done_early"])
async def test_stream_without_terminal_chunk(
    server: Server, engine: VllmEngine, profile: str, kind: str
) -> None:
    await server.fault(kind, after_tokens=2)
    err, outs = await failure(engine, envelope(max_tokens=10))
    assert err.code is ErrorCode.UNAVAILABLE
    assert err.retryable
    assert err.detail is not None
    assert err.detail.get("reason") == INCOMPLETE
    assert len(tokens_of(outs)) == (2 if profile == "new" else 0)


# ------------------------------------------------------------------------ cancellation


async def consume(engine: VllmEngine, env: Envelope, got: list[int]) -> list[EngineOutput]:
    outs = []
    async for out in engine.generate(env):
        outs.append(out)
        got.extend(out.tokens)
    return outs


@pytest.mark.parametrize("profile", ["new"], indirect=True)
async def test_hang_then_cancel_aborts_on_the_server(
    server: Server, engine: VllmEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    fixed_dispatch_id(monkeypatch, "a" * 32)
    await server.fault("hang", after_tokens=2)
    got: list[int] = []
    task = asyncio.create_task(consume(engine, envelope(max_tokens=10), got))
    await wait_for(lambda: len(got) == 2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for(lambda: not server.state()["running"])
    assert server.state()["aborted"] == [ENGINE_ID_PREFIX + "a" * 32]


@pytest.mark.parametrize("profile", ["new"], indirect=True)
@pytest.mark.parametrize("server_options", [{"tokens_only": False}], indirect=True)
async def test_cancel_without_abort_endpoint_closes_the_connection(
    server: Server, engine: VllmEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert engine.describe()["abort_requests"] is False
    fixed_dispatch_id(monkeypatch, "b" * 32)
    await server.fault("hang", after_tokens=1)
    got: list[int] = []
    task = asyncio.create_task(consume(engine, envelope(max_tokens=10), got))
    await wait_for(lambda: len(got) == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for(lambda: not server.state()["running"])
    state = server.state()
    assert state["disconnected"] == [ENGINE_ID_PREFIX + "b" * 32]
    assert state["aborted"] == []


async def test_cancel_before_submit(server: Server, engine: VllmEngine) -> None:
    gen = engine.generate(envelope(max_tokens=5))
    await gen.aclose()  # never started
    task = asyncio.create_task(collect(engine, envelope(max_tokens=5)))
    task.cancel()  # before its first step
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.05)
    state = server.state()
    assert state["received"] == 0
    assert state["aborted"] == []
    assert state["disconnected"] == []


@pytest.mark.parametrize("profile", ["old"], indirect=True)
async def test_cancel_while_opening(
    server: Server, engine: VllmEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An old (unary) server sends no headers until it is done: cancel while waiting."""
    fixed_dispatch_id(monkeypatch, "c" * 32)
    await server.fault("hang", after_tokens=0)
    task = asyncio.create_task(collect(engine, envelope(max_tokens=5)))
    await wait_for(lambda: bool(server.state()["running"]))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for(lambda: not server.state()["running"])
    state = server.state()
    assert set(state["aborted"] + state["disconnected"]) == {ENGINE_ID_PREFIX + "c" * 32}


async def test_cancel_during_read(
    server: Server, engine: VllmEngine, profile: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fixed_dispatch_id(monkeypatch, "d" * 32)
    await server.configure(token_delay_ms=20)
    got: list[int] = []
    task = asyncio.create_task(consume(engine, envelope(max_tokens=200), got))
    if profile == "new":
        await wait_for(lambda: len(got) >= 2)
    else:
        await wait_for(lambda: bool(server.state()["running"]))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for(lambda: not server.state()["running"])
    state = server.state()
    assert ENGINE_ID_PREFIX + "d" * 32 in state["aborted"] + state["disconnected"]
    assert state["completed"] == 0


@pytest.mark.parametrize("profile", ["new"], indirect=True)
async def test_closing_the_generator_early_aborts(
    server: Server, engine: VllmEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the worker does on a cancel: aclose() the generator while it is suspended."""
    fixed_dispatch_id(monkeypatch, "e" * 32)
    await server.configure(token_delay_ms=20)
    gen = engine.generate(envelope(max_tokens=200))
    await anext(gen)
    await gen.aclose()
    await wait_for(lambda: not server.state()["running"])
    state = server.state()
    assert ENGINE_ID_PREFIX + "e" * 32 in state["aborted"] + state["disconnected"]


async def test_one_cancelled_one_completes(
    server: Server, engine: VllmEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    fixed_dispatch_id(monkeypatch, "f" * 32, "0" * 32)
    await server.fault("hang", after_tokens=1)
    got: list[int] = []
    doomed = asyncio.create_task(consume(engine, envelope(max_tokens=10), got))
    await wait_for(lambda: bool(server.state()["running"]))
    env = envelope(max_tokens=8, logprobs=True)
    survivor = asyncio.create_task(collect(engine, env))
    await asyncio.sleep(0.05)
    doomed.cancel()
    with pytest.raises(asyncio.CancelledError):
        await doomed
    outs = await survivor
    want = await mock_outputs(env)
    assert tokens_of(outs) == tokens_of(want)
    assert flat(outs, "logprobs") == flat(want, "logprobs")
    assert outs[-1].finish == {"reason": "length"}
    await wait_for(lambda: not server.state()["running"])
    state = server.state()
    # (An old server may see the abort and then the closed connection: both are listed.)
    assert set(state["aborted"] + state["disconnected"]) == {ENGINE_ID_PREFIX + "f" * 32}
    assert state["completed"] == 1


# ----------------------------------------------------------------- health, registration


async def test_healthy_follows_the_server(server: Server, engine: VllmEngine) -> None:
    facts = engine.describe()
    assert facts["model"] == "genmesh-mock"
    assert facts["formats"] == ["*"]
    assert facts["engine_url"] == server.url
    assert facts["abort_requests"] is True
    await server.configure(healthy=False)
    assert not await engine.healthy()
    assert engine.describe()["model"] == "unknown"
    await server.configure(healthy=True)
    assert await engine.healthy()
    assert engine.describe()["model"] == "genmesh-mock"


def test_create_engine_builds_the_vllm_adapter() -> None:
    eng = create_engine("vllm", url="http://127.0.0.1:1")
    assert isinstance(eng, VllmEngine)
    assert eng.name == "vllm"


async def test_no_leaked_connections(server: Server, engine: VllmEngine) -> None:
    for _ in range(30):
        await collect(engine, envelope(max_tokens=4, logprobs=True))
    await asyncio.gather(*(collect(engine, envelope(max_tokens=6)) for _ in range(20)))
    # Failed requests give their connections back too.
    await server.fault("no_terminal", after_tokens=1, count=5)
    for _ in range(5):
        await failure(engine, envelope(max_tokens=4))
    connector = engine.session.connector
    assert isinstance(connector, aiohttp.TCPConnector)
    assert not connector._acquired  # every response consumed is released
    idle = sum(len(conns) for conns in connector._conns.values())
    assert idle <= 20  # at most one keep-alive connection per concurrent request


async def test_sampling_defaults_of_a_vllm_request_are_sent(engine: VllmEngine) -> None:
    """A vLLM-format envelope end to end: the client's body, fanned-out seeds and all."""
    env = vllm_envelope(
        {"token_ids": PROMPT, "sampling_params": {"max_tokens": 5, "logprobs": 1, "seed": 3}}
    )
    outs = await collect(engine, env)
    canonical = Envelope(
        id="x",
        token_ids=PROMPT,
        sampling=Sampling(max_tokens=5, seed=3),
        output=OutputOptions(logprobs=True, top_logprobs=1),
    )
    want = await mock_outputs(canonical)
    assert tokens_of(outs) == tokens_of(want)
    assert flat(outs, "top_logprobs") == flat(want, "top_logprobs")


# Two images on a 12-token prompt, as vLLM's /render gives them.
MM_PROMPT = list(range(100, 112))
MM_FEATURES: dict[str, Any] = {
    "mm_hashes": {"image": ["a" * 64, "b" * 64]},
    "mm_placeholders": {"image": [{"offset": 2, "length": 4}, {"offset": 6, "length": 4}]},
    "kwargs_data": {"image": ["YQ==", None]},
}


@pytest.mark.parametrize("profile", ["new"])
async def test_features_reach_the_server_unchanged(engine: VllmEngine, server: Server) -> None:
    body = {"token_ids": MM_PROMPT, "sampling_params": {"max_tokens": 4}}
    with_images = await collect(engine, vllm_envelope({**body, "features": MM_FEATURES}))
    text_only = await collect(engine, vllm_envelope(body))
    sent = await server.requests()
    assert sent[0]["body"]["features"] == MM_FEATURES
    assert "features" not in sent[1]["body"]
    assert tokens_of(with_images) == tokens_of(text_only)  # a text-only model's answer


@pytest.mark.parametrize("profile", ["new"])
async def test_the_server_refuses_a_layout_vllm_refuses(engine: VllmEngine) -> None:
    """What a NATS-level client may send (no format checked it) meets vLLM's check."""
    env = envelope(MM_PROMPT, max_tokens=2)
    env.format = "vllm"
    env.engine = {"features": {**MM_FEATURES, "mm_hashes": {"image": ["a" * 64]}}}
    err, outs = await failure(engine, env)
    assert outs == []
    assert err.code is ErrorCode.INVALID_ARGUMENT
    assert err.message == (
        "1 validation error for GenerateRequest\nfeatures\n  Value error, "
        "image mm_hashes and mm_placeholders must have the same length"
    )

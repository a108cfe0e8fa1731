"""The `vllm` adapter's P/D halves (`prefill`, `decode`) against a pair of genmesh's mock
vLLM servers (`--disaggregation-mode prefill|decode`, reference `engine-apis.md` §C.3), on
real sockets, beside an aggregated server of the same model: the pair's answer must be the
aggregated one. The decode server takes its prefill's KV over HTTP (`genmesh.testkit.pd`),
so a decode that answered at all has really paired; after every test both servers hold no
KV handle and run nothing.

Most tests call `prefill` and then `decode` as the decode worker does; the last two of the
contract's tests run them under real workers (the decode worker's `PdDecoder`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import nats
import pytest

from genmesh.codecs import get_codec
from genmesh.engines.base import EngineOutput, disaggregating
from genmesh.engines.http import HttpEngineConfig
from genmesh.engines.vllm import ENGINE_ID_PREFIX, KV_TRANSFER_FAILED, VllmEngine
from genmesh.shared import frames
from genmesh.shared.bus import PREFILL_HEADER
from genmesh.shared.envelope import Envelope
from genmesh.shared.errors import ErrorCode, MeshError
from genmesh.shared.subjects import Subjects
from genmesh.testkit.common import serving
from genmesh.testkit.config import MockServerConfig
from genmesh.testkit.vllm import build_app
from tests.engines.test_vllm_engine import (
    EOS,
    VOCAB,
    Server,
    collect,
    envelope,
    first,
    fixed_dispatch_id,
    flat,
    tokens_of,
    vllm_envelope,
    wait_for,
)
from tests.inproc import InProcessMesh

pytestmark = pytest.mark.inproc

PROMPT = list(range(100, 140))  # 40 tokens: two full KV blocks of 16, and 8 recomputed
BASE = MockServerConfig(vocab_size=VOCAB, eos_token_id=EOS)
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclasses.dataclass
class Pair:
    """An aggregated server, a prefill server and a decode server, an engine for each."""

    agg: VllmEngine
    prefill: VllmEngine
    decode: VllmEngine
    prefill_server: Server
    decode_server: Server

    async def handles(self) -> list[str]:
        async with self.prefill_server.admin.get(f"{self.prefill_server.url}/testkit/pd") as r:
            body: dict[str, Any] = await r.json()
            return list(body["handles"])

    async def run(self, env: Envelope) -> tuple[list[EngineOutput], list[EngineOutput]]:
        """Both halves, as the decode worker runs them: prefill, then decode."""
        pre = [out async for out in self.prefill.prefill(env, {})]
        handoff = pre[-1].handoff
        dec = [out async for out in self.decode.decode(env, {}, handoff)]
        return pre, dec


@contextlib.asynccontextmanager
async def engine_for(url: str) -> AsyncIterator[VllmEngine]:
    eng = VllmEngine(HttpEngineConfig(url=url, abort_timeout_s=2.0))
    await eng.start()
    assert await eng.healthy()
    try:
        yield eng
    finally:
        await eng.close()


@pytest.fixture(params=["new", "old"])
def profile(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def timeout_s(request: pytest.FixtureRequest) -> float:
    return float(getattr(request, "param", 5.0))


@pytest.fixture
async def pair(profile: str, timeout_s: float) -> AsyncIterator[Pair]:
    def app(mode: str) -> Any:
        config = dataclasses.replace(
            BASE, disaggregation_mode=mode, disaggregation_timeout_s=timeout_s
        )
        return build_app(config, profile=profile)  # type: ignore[arg-type]

    prefill_app, decode_app = app("prefill"), app("decode")
    async with (
        serving(build_app(BASE, profile=profile)) as agg_url,  # type: ignore[arg-type]
        serving(prefill_app) as prefill_url,
        serving(decode_app) as decode_url,
        aiohttp.ClientSession() as admin,
        engine_for(agg_url) as agg,
        engine_for(prefill_url) as prefill,
        engine_for(decode_url) as decode,
    ):
        p = Pair(
            agg, prefill, decode, Server(prefill_url, prefill_app, admin),
            Server(decode_url, decode_app, admin),
        )  # fmt: skip
        yield p
        assert await p.handles() == []  # nothing left behind
        await wait_for(lambda: not p.prefill_server.state()["running"])
        await wait_for(lambda: not p.decode_server.state()["running"])


async def bodies(server: Server) -> list[dict[str, Any]]:
    return [sent["body"] for sent in await server.requests()]


async def failure(halves: Any) -> MeshError:
    with pytest.raises(MeshError) as info:
        async for _ in halves:
            pass
    return info.value


# ------------------------------------------------------------------------ the contract


async def test_the_adapter_is_a_sequential_pd_engine(pair: Pair) -> None:
    pd = disaggregating(pair.decode)
    assert pd is pair.decode
    assert (pd.pd_kind, pd.pd_concurrent) == ("vllm", False)
    assert pd.pd_card() == {"local_prefill": True}
    assert pd.pd_ticket(envelope(PROMPT), {"kind": "vllm", "local_prefill": True}) == {}
    # local_prefill: a decode server runs a request that comes without kv_transfer_params.
    env = envelope(PROMPT, max_tokens=5, logprobs=True)
    alone = await collect(pair.decode, env)
    assert tokens_of(alone) == tokens_of(await collect(pair.agg, env))


def pd_workers(mesh: InProcessMesh) -> dict[str, str]:
    """A prefill and a decode worker in front of a testkit pair; each role's server URL."""
    urls = {}
    for role in ("prefill", "decode"):
        _, urls[role] = mesh.spawn_engine_server(
            "vllm", "--disaggregation-mode", role, "--vocab-size", str(VOCAB),
            "--eos-token-id", str(EOS),
        )  # fmt: skip
    mesh.add_frontend()
    for role, url in urls.items():
        mesh.add_worker(f"w-{role}", engine="vllm", engine_url=url, extra_args=("--role", role))
    return urls


async def frames_from(
    mesh: InProcessMesh, worker: str, env: Envelope, headers: dict[str, str] | None
) -> list[dict[str, Any]]:
    """`env` sent straight to `worker` over NATS (protocol.md §5), with `headers`; its
    frames up to the terminal one."""
    codec = get_codec("msgpack")
    nc = await nats.connect(mesh.nats_url)
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(
            Subjects(mesh.namespace).worker_generate(worker),
            codec.encode(env.to_wire()),
            reply=inbox,
            headers=headers,
        )
        got: list[dict[str, Any]] = []
        while not got or got[-1]["t"] not in frames.TERMINAL:
            msg = await sub.next_msg(timeout=10)
            if msg.data:
                got.append(codec.decode(msg.data))
        return got
    finally:
        await nc.close()


# Frame fields that hold one entry per token (routed experts: per position), split however
# the outputs were cut.
PER_TOKEN = ("tokens", "logprobs", "ranks", "top_logprobs", "token_ids_logprobs", "routed_experts")


def folded(got: list[dict[str, Any]]) -> dict[str, Any]:
    """What a request's frames add up to, however the outputs were cut."""
    answer: dict[str, Any] = {}
    for frame in got[1:]:  # after the ack
        for key, value in frame.items():
            if key in PER_TOKEN:
                answer[key] = answer.get(key, []) + value
            elif key not in ("t", "id", "seq"):
                assert key not in answer, f"{key} twice"
                answer[key] = value
    return answer


def test_workers_in_front_of_a_pair_announce_their_roles(empty_mesh: InProcessMesh) -> None:
    """A vLLM worker can take either role, and its card says how a decode worker pairs."""
    pd_workers(empty_mesh)
    cards = {c["id"]: c for c in empty_mesh.server_info()["genmesh"]["workers"]}
    for role in ("prefill", "decode"):
        assert cards[f"w-{role}"]["role"] == role
        assert cards[f"w-{role}"]["disagg"] == {"kind": "vllm", "local_prefill": True}


async def test_a_decode_worker_paired_by_header_answers_as_it_does_alone(
    empty_mesh: InProcessMesh,
) -> None:
    """The decode worker drives the pair (services/worker/disagg.py) over these halves:
    its frames equal those of the same request it runs alone (local_prefill), and each
    server saw its stage."""
    urls = await asyncio.to_thread(pd_workers, empty_mesh)

    def env(rid: str) -> Envelope:
        e = envelope(PROMPT, max_tokens=6, logprobs=True, top_logprobs=2, prompt_logprobs_start=1)
        e.id = rid
        return e

    alone = await frames_from(empty_mesh, "w-decode", env("a" * 32), None)
    paired = await frames_from(empty_mesh, "w-decode", env("b" * 32), {PREFILL_HEADER: "w-prefill"})
    assert paired[0]["t"] == "ack"
    assert folded(paired) == folded(alone)
    assert paired[-1]["t"] == "end"
    assert "prompt_logprobs" in paired[1]
    async with aiohttp.ClientSession() as s:
        logs = {}
        for role, url in urls.items():
            async with s.get(f"{url}/testkit/vllm/requests") as r:
                logs[role] = [sent["body"] for sent in (await r.json())["requests"]]
    (stage,) = logs["prefill"]
    assert stage["kv_transfer_params"] == PREFILL_PARAMS
    assert "kv_transfer_params" not in logs["decode"][0]  # alone: no params
    assert logs["decode"][1]["kv_transfer_params"]["remote_block_ids"] == [[0, 1]]


# ------------------------------------------------------------------------- the answer

CASES: dict[str, dict[str, Any]] = {
    "plain": {"max_tokens": 6},
    "seeded_min_tokens": {"max_tokens": 8, "min_tokens": 8, "seed": 42},
    "logprobs": {"max_tokens": 5, "logprobs": True, "top_logprobs": 3},
    "prompt_logprobs": {"max_tokens": 4, "logprobs": True, "prompt_logprobs_start": 0},
    "prompt_top_logprobs_from_5": {
        "max_tokens": 3,
        "top_logprobs": 2,
        "prompt_logprobs_start": 5,
    },
    "one_token": {"max_tokens": 1, "prompt_logprobs_start": 1},
}


@pytest.mark.parametrize("case", CASES)
async def test_prompt_logprobs_from_prefill_tokens_from_decode(
    pair: Pair, profile: str, case: str
) -> None:
    env = envelope(PROMPT, **CASES[case])
    want = await collect(pair.agg, env)
    pre, dec = await pair.run(env)
    # Prefill: the prompt's logprobs, its one sampled token dropped, the handoff last.
    assert tokens_of(pre) == []
    assert pre[-1].finish == {"reason": "length"}
    assert pre[-1].usage == {"prompt_tokens": 40, "completion_tokens": 0, "cached_tokens": 0}
    for name in ("prompt_logprobs", "prompt_ranks", "prompt_top_logprobs"):
        assert first(pre, name) == first(want, name), name
    assert (pre[-1].handoff or {}).get("remote_block_ids") == [[0, 1]]
    assert pre[-1].engine is None  # the params travel as the handoff only
    # Decode: every token and its logprobs, the finish and usage; no prompt logprobs.
    assert tokens_of(dec) == tokens_of(want)
    for name in ("logprobs", "ranks", "top_logprobs"):
        assert flat(dec, name) == flat(want, name), name
    assert dec[-1].finish == want[-1].finish
    assert dec[-1].usage == want[-1].usage
    assert first(dec, "prompt_logprobs") is None
    assert all(out.handoff is None for out in dec)
    # What each server was sent (§C.3).
    (p_body,) = await bodies(pair.prefill_server)
    (d_body,) = await bodies(pair.decode_server)
    sp = p_body["sampling_params"]
    assert (sp["max_tokens"], sp["min_tokens"], p_body["stream"]) == (1, 0, False)
    assert "stream_options" not in p_body
    assert "logprobs" not in sp  # its token is dropped: no logprobs wanted for it
    assert p_body["kv_transfer_params"] == PREFILL_PARAMS
    assert sp["extra_args"] == {"kv_transfer_params": PREFILL_PARAMS}
    assert "prompt_logprobs" not in d_body["sampling_params"]
    assert d_body["stream"] is True
    assert d_body["sampling_params"]["max_tokens"] == env.sampling.max_tokens
    assert d_body["sampling_params"]["min_tokens"] == env.sampling.min_tokens


async def test_kv_transfer_params_round_trip(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill's reply params reach the decode server untouched (top level and, for
    v0.11-v0.18, extra_args), and the decode server takes the prefill's KV handle."""
    fixed_dispatch_id(monkeypatch, "p" * 32, "d" * 32, "a" * 32)
    env = envelope(PROMPT, max_tokens=4)
    pre = [out async for out in pair.prefill.prefill(env, {})]
    handoff = pre[-1].handoff
    assert handoff == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[0, 1]],
        "remote_engine_id": (handoff or {}).get("remote_engine_id"),
        "remote_request_id": ENGINE_ID_PREFIX + "p" * 32,
        "remote_host": "127.0.0.1",
        "remote_port": int(pair.prefill_server.url.rsplit(":", 1)[1]),
        "tp_size": 1,
    }
    assert await pair.handles() == [ENGINE_ID_PREFIX + "p" * 32]  # kept for the decode
    dec = [out async for out in pair.decode.decode(env, {}, handoff)]
    assert await pair.handles() == []  # taken
    assert tokens_of(dec) == tokens_of(await collect(pair.agg, env))
    (d_body,) = await bodies(pair.decode_server)
    assert d_body["request_id"] == "d" * 32
    assert d_body["kv_transfer_params"] == handoff
    assert d_body["sampling_params"]["extra_args"] == {"kv_transfer_params": handoff}


async def test_a_prompt_shorter_than_a_block_hands_over_no_blocks(pair: Pair) -> None:
    """NIXL answers params without blocks: nothing is kept, the decode computes alone."""
    env = envelope(PROMPT[:10], max_tokens=5)
    pre, dec = await pair.run(env)
    assert (pre[-1].handoff or {}).get("remote_block_ids") == [[]]
    assert tokens_of(dec) == tokens_of(await collect(pair.agg, env))


async def test_a_prefill_that_is_not_length_capped_hands_over_nothing(pair: Pair) -> None:
    """Its one token is a stop token: no kv_transfer_params (the connector keeps nothing),
    an empty handoff, and a decode sent without params that computes the prompt itself."""
    greedy = tokens_of(await collect(pair.agg, envelope(PROMPT, max_tokens=1)))
    env = envelope(PROMPT, max_tokens=6, stop_token_ids=greedy)
    pre, dec = await pair.run(env)
    assert pre[-1].handoff == {}
    want = await collect(pair.agg, env)
    assert tokens_of(dec) == tokens_of(want) == greedy
    assert dec[-1].finish == want[-1].finish == {"reason": "stop", "matched": greedy[0]}
    (d_body,) = await bodies(pair.decode_server)
    assert "kv_transfer_params" not in d_body
    assert "extra_args" not in d_body["sampling_params"]


async def test_max_tokens_zero_is_the_prefill_alone_and_keeps_no_kv(pair: Pair) -> None:
    env = envelope(PROMPT, max_tokens=0, prompt_logprobs_start=3, top_logprobs=2)
    pre = [out async for out in pair.prefill.prefill(env, {})]
    want = await collect(pair.agg, env)
    assert tokens_of(pre) == []
    assert pre[-1].handoff == {}
    assert pre[-1].finish == want[-1].finish == {"reason": "length"}
    assert pre[-1].usage == want[-1].usage
    assert first(pre, "prompt_top_logprobs") == first(want, "prompt_top_logprobs")
    (p_body,) = await bodies(pair.prefill_server)
    assert "kv_transfer_params" not in p_body
    assert await pair.handles() == []


async def test_a_clients_own_kv_transfer_params_do_not_reach_either_half(pair: Pair) -> None:
    """The mesh pairs the halves: a vLLM client's params would point the servers elsewhere."""
    env = vllm_envelope(
        {
            "token_ids": PROMPT,
            "sampling_params": {"max_tokens": 3},
            "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "elsewhere"},
        }
    )
    pre, dec = await pair.run(env)
    (p_body,) = await bodies(pair.prefill_server)
    (d_body,) = await bodies(pair.decode_server)
    assert p_body["kv_transfer_params"] == PREFILL_PARAMS
    assert d_body["kv_transfer_params"] == pre[-1].handoff
    assert len(tokens_of(dec)) == 3


# ----------------------------------------------------------------------------- failures


async def test_a_prefill_the_server_refuses_is_the_requests_fault(pair: Pair) -> None:
    err = await failure(pair.prefill.prefill(envelope([1, VOCAB + 5], max_tokens=3), {}))
    assert err.code is ErrorCode.INVALID_ARGUMENT
    assert err.message == f"Token id {VOCAB + 5} is out of vocabulary"
    assert err.detail["status_code"] == 400


async def test_a_prefill_server_error_is_retryable(pair: Pair) -> None:
    await pair.prefill_server.fault("http_error", status=503, message="overloaded")
    err = await failure(pair.prefill.prefill(envelope(PROMPT, max_tokens=3), {}))
    assert err.code is ErrorCode.UNAVAILABLE
    assert err.retryable
    assert err.message == "vLLM answered HTTP 503: overloaded"


async def test_a_prefill_that_ends_in_abort_is_an_error(pair: Pair) -> None:
    await pair.prefill_server.fault("abort")
    err = await failure(pair.prefill.prefill(envelope(PROMPT, max_tokens=3), {}))
    assert err.code is ErrorCode.UNAVAILABLE
    assert err.message == "vLLM aborted the prefill: abort"
    assert await pair.handles() == []  # an aborted prefill keeps no KV


@pytest.mark.parametrize("timeout_s", [1.0], indirect=True)
@pytest.mark.parametrize("case", ["taken_twice", "another_engine", "dead_prefill"])
async def test_a_decode_that_cannot_read_the_kv_is_a_retryable_transfer_failure(
    pair: Pair, profile: str, case: str
) -> None:
    env = envelope(PROMPT, max_tokens=4)
    pre = [out async for out in pair.prefill.prefill(env, {})]
    handoff = dict(pre[-1].handoff or {})
    if case == "taken_twice":
        assert len(tokens_of([out async for out in pair.decode.decode(env, {}, handoff)])) == 4
    elif case == "another_engine":
        handoff["remote_engine_id"] = "another-engine"
    elif case == "dead_prefill":
        handoff["remote_port"] = 1
    err = await failure(pair.decode.decode(env, {}, handoff))
    assert err.code is ErrorCode.UNAVAILABLE
    assert err.retryable
    assert err.detail == {"reason": KV_TRANSFER_FAILED}
    cause = (
        "vLLM failed mid-stream: Internal server error"
        if profile == "new"  # in-band, once the stream has started
        else "vLLM answered HTTP 500: Internal server error"
    )
    assert err.message == (
        f"KV transfer failed: the vLLM decode server could not load the prefill's KV ({cause})"
    )
    if case != "taken_twice":  # unread blocks stay until the prefill's abort timeout
        assert len(await pair.handles()) == 1
        await asyncio.sleep(1.1)


@pytest.mark.parametrize("timeout_s", [0.2], indirect=True)
async def test_a_decode_after_the_handle_expired_fails_the_transfer(pair: Pair) -> None:
    """The prefill server frees KV nobody took in time (NIXL's abort timeout)."""
    env = envelope(PROMPT, max_tokens=4)
    pre = [out async for out in pair.prefill.prefill(env, {})]
    assert len(await pair.handles()) == 1
    await asyncio.sleep(0.3)
    err = await failure(pair.decode.decode(env, {}, pre[-1].handoff))
    assert err.code is ErrorCode.UNAVAILABLE
    assert err.detail == {"reason": KV_TRANSFER_FAILED}
    assert err.message.startswith("KV transfer failed: ")


async def test_a_decode_server_error_without_a_handoff_is_no_transfer_failure(
    pair: Pair,
) -> None:
    await pair.decode_server.fault("http_error", status=500, message="boom")
    err = await failure(pair.decode.decode(envelope(PROMPT, max_tokens=4), {}, {}))
    assert err.code is ErrorCode.UNAVAILABLE
    assert err.message == "vLLM answered HTTP 500: boom"
    assert err.detail == {"status_code": 500}


@pytest.mark.parametrize("profile", ["new"], indirect=True)
async def test_cancel_reaches_the_decode_server(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    fixed_dispatch_id(monkeypatch, "p" * 32, "d" * 32)
    env = envelope(PROMPT, max_tokens=50)
    pre = [out async for out in pair.prefill.prefill(env, {})]
    await pair.decode_server.configure(token_delay_ms=50)
    got: list[int] = []

    async def decode() -> None:
        async for out in pair.decode.decode(env, {}, pre[-1].handoff):
            got.extend(out.tokens)

    task = asyncio.create_task(decode())
    await wait_for(lambda: len(got) >= 2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for(lambda: not pair.decode_server.state()["running"])
    assert pair.decode_server.state()["aborted"] == [ENGINE_ID_PREFIX + "d" * 32]
    assert len(got) < 50


@pytest.mark.parametrize("profile", ["new"], indirect=True)
async def test_cancel_reaches_the_prefill_server(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    fixed_dispatch_id(monkeypatch, "p" * 32)
    await pair.prefill_server.fault("hang")
    task = asyncio.create_task(collect_prefill(pair.prefill, envelope(PROMPT, max_tokens=5)))
    await wait_for(lambda: bool(pair.prefill_server.state()["running"]))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_for(lambda: not pair.prefill_server.state()["running"])
    # Stopped: the unary request's connection closes as the cancel interrupts its wait for
    # the answer (vLLM aborts on a disconnect), and the abort by id follows.
    state = pair.prefill_server.state()
    engine_id = ENGINE_ID_PREFIX + "p" * 32
    assert state["disconnected"] + state["aborted"] == [engine_id]
    assert state["abort_calls"][-1]["ids"] == [engine_id, "p" * 32]


async def collect_prefill(engine: VllmEngine, env: Envelope) -> list[EngineOutput]:
    return [out async for out in engine.prefill(env, {})]

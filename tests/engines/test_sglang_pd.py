"""The `sglang` adapter's prefill/decode halves against the testkit's SGLang servers in
`--disaggregation-mode prefill|decode` (real HTTP; the decode server takes the prefill's
KV handle from the prefill server over HTTP, keyed by the bootstrap room).

The halves are driven as the decode worker drives them (services/worker): one ticket from
the decode engine, the prefill stage and the decode at once. What the two report must
add up to what `generate` on an aggregated server of the same model answers.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import os
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import aiohttp
import nats
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from genmesh.client import request
from genmesh.codecs import get_codec
from genmesh.engines.base import EngineOutput
from genmesh.engines.execute import output_frame
from genmesh.engines.faults import ServerState
from genmesh.engines.http import HttpEngineConfig
from genmesh.engines.pd_join import PdJoin, PrefillResult
from genmesh.engines.sglang import SglangEngine
from genmesh.engines.sglang_pd import (
    DEFAULT_BOOTSTRAP_PORT,
    BootstrapConfig,
    expert_rows,
)
from genmesh.shared.bus import PREFILL_HEADER, flush_in_order, publish
from genmesh.shared.envelope import Disagg, Envelope, prefill_stage_id
from genmesh.shared.errors import ErrorCode, MeshError
from genmesh.shared.subjects import Subjects
from genmesh.testkit.common import STATE, serving
from genmesh.testkit.config import MockServerConfig
from genmesh.testkit.sglang import build_app
from tests.conftest import unique_namespace
from tests.inproc import InProcessMesh
from tests.testkit.test_sglang_server import eventually

pytestmark = pytest.mark.inproc

BASE = MockServerConfig(vocab_size=1000, eos_token_id=7, max_model_len=4096)
PROMPT = list(range(100, 140))


@dataclasses.dataclass
class Pair:
    """Engines of an aggregated server and of a prefill/decode pair, and the pair's state."""

    agg: SglangEngine
    prefill: SglangEngine
    decode: SglangEngine
    prefill_state: ServerState
    decode_state: ServerState
    prefill_url: str
    decode_url: str

    def card(self) -> dict[str, Any]:
        return {"kind": self.prefill.pd_kind, **self.prefill.pd_card()}


async def engine(url: str, port: int | None = None) -> SglangEngine:
    eng = SglangEngine(HttpEngineConfig(url=url), BootstrapConfig(port=port))
    await eng.start()
    assert await eng.healthy()
    return eng


@contextlib.asynccontextmanager
async def pair(
    timeout_s: float = 5.0,
    *,
    base: MockServerConfig = BASE,
    incremental: bool = False,
    prefill_proxy: Callable[[str], web.Application] | None = None,
    decode_proxy: Callable[[str], web.Application] | None = None,
) -> AsyncIterator[Pair]:
    """A pair (and an aggregated server); the adapters may reach a server through a
    proxy. Afterwards neither server holds a KV handle or a running request."""

    def config(mode: str) -> MockServerConfig:
        return dataclasses.replace(
            base,
            incremental=incremental,
            disaggregation_mode=mode,
            disaggregation_timeout_s=timeout_s,
        )

    p_app, d_app = build_app(config("prefill")), build_app(config("decode"))
    async with contextlib.AsyncExitStack() as stack:
        agg_url = await stack.enter_async_context(serving(build_app(config("null"))))
        p_url = await stack.enter_async_context(serving(p_app))
        d_url = await stack.enter_async_context(serving(d_app))
        p_via = p_url
        if prefill_proxy is not None:
            p_via = await stack.enter_async_context(serving(prefill_proxy(p_url)))
        d_via = d_url
        if decode_proxy is not None:
            d_via = await stack.enter_async_context(serving(decode_proxy(d_url)))
        # The prefill's bootstrap port: as its /server_info reports it.
        engines = [await engine(agg_url), await engine(p_via), await engine(d_via)]
        for eng in engines:
            stack.push_async_callback(eng.close)
        yield Pair(*engines, p_app[STATE], d_app[STATE], p_url, d_url)
        for url in (p_url, d_url):
            assert (await get(f"{url}/testkit/pd"))["handles"] == []

            async def idle(url: str = url) -> bool:
                return (await get(f"{url}/testkit/state"))["running"] == []

            await eventually(idle)


async def get(url: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url) as resp:
        return await resp.json()


async def collect(outputs: AsyncGenerator[EngineOutput, None]) -> list[EngineOutput]:
    async with contextlib.aclosing(outputs):
        return [out async for out in outputs]


def stage_of(env: Envelope, ticket: dict[str, Any]) -> Envelope:
    """The prefill stage the decode worker sends (shared/envelope.py)."""
    return dataclasses.replace(
        env, id=prefill_stage_id(env.id), disagg=Disagg(parent=env.id, ticket=ticket)
    )


async def run_pd(p: Pair, env: Envelope) -> tuple[list[EngineOutput], list[EngineOutput]]:
    ticket = p.decode.pd_ticket(env, p.card())
    pre, dec = await asyncio.gather(
        collect(p.prefill.prefill(stage_of(env, ticket), ticket)),
        collect(p.decode.decode(env, ticket, None)),
    )
    return pre, dec


def envelope(
    max_tokens: int, *, experts_from: int | None = None, prompt: list[int] = PROMPT
) -> Envelope:
    env = request(
        prompt,
        max_tokens=max_tokens,
        ignore_eos=True,
        logprobs=True,
        top_logprobs=2,
        prompt_logprobs_start=3,
    )
    output = dataclasses.replace(
        env.output, logprob_token_ids=[5, 9], routed_experts_start=experts_from
    )
    return dataclasses.replace(env, output=output)


def tokens(outs: list[EngineOutput]) -> list[int]:
    return [t for out in outs for t in out.tokens]


def flat(rows: list[list[int]] | None) -> list[int]:
    return [value for row in rows or [] for value in row]


def field_of(outs: list[EngineOutput], name: str) -> list[Any]:
    return [x for out in outs for x in getattr(out, name) or []]


# ---------------------------------------------------------------- the halves add up


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
@pytest.mark.parametrize("max_tokens", [1, 2, 9])
@pytest.mark.parametrize("experts_from", [0, 37, len(PROMPT)])
async def test_halves_add_up_to_the_aggregated_answer(
    incremental: bool, max_tokens: int, experts_from: int
) -> None:
    async with pair(incremental=incremental) as p:
        env = envelope(max_tokens, experts_from=experts_from)
        agg = await collect(p.agg.generate(env))
        pre, dec = await run_pd(p, env)
    # Decode: every token (the first sampled by prefill) with its fields, finish, usage.
    assert tokens(dec) == tokens(agg)
    assert len(tokens(dec)) == max_tokens
    for name in ("logprobs", "top_logprobs", "token_ids_logprobs"):
        assert field_of(dec, name) == field_of(agg, name)
    assert dec[-1].finish == agg[-1].finish == {"reason": "length"}
    assert dec[-1].usage is not None
    assert agg[-1].usage is not None
    assert dec[-1].usage["completion_tokens"] == agg[-1].usage["completion_tokens"]
    assert all(out.prompt_logprobs is None for out in dec)
    # Prefill: the prompt's side only, as one output.
    [result] = pre
    assert result.tokens == []
    assert result.finish == {"reason": "length"}
    assert result.usage == {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": 0,
        "cached_tokens": 0,
    }
    for name in ("prompt_logprobs", "prompt_top_logprobs", "prompt_token_ids_logprobs"):
        assert getattr(result, name) == getattr(agg[0], name)
        assert getattr(result, name)  # asked for, so there
    # Expert rows: prefill's one per prompt position, decode's one per token but the last;
    # together the aggregated blob (with max_tokens 1, prefill's alone).
    assert result.routed_experts is not None
    assert dec[-1].routed_experts is not None
    assert len(result.routed_experts) == len(PROMPT) - experts_from
    assert len(dec[-1].routed_experts) == max_tokens - 1
    assert flat(result.routed_experts) + flat(dec[-1].routed_experts) == flat(
        agg[-1].routed_experts
    )
    assert all(out.routed_experts is None for out in dec[:-1])
    assert p.prefill.pd_experts_omitted == p.decode.pd_experts_omitted == 0


async def test_a_budget_of_zero_runs_the_prefill_alone() -> None:
    """Nothing to decode: the prefill names SGLang's fake bootstrap host, so its server
    transfers to nobody and holds no KV for a decode that never comes."""
    async with pair(timeout_s=30) as p:
        env = envelope(0, experts_from=30)
        agg = await collect(p.agg.generate(env))
        ticket = p.decode.pd_ticket(env, p.card())
        [result] = await asyncio.wait_for(
            collect(p.prefill.prefill(stage_of(env, ticket), ticket)), 5
        )
    assert result.tokens == []
    assert agg[-1].tokens == []
    assert result.finish == agg[-1].finish == {"reason": "length"}
    assert result.usage == agg[-1].usage
    assert result.prompt_logprobs == agg[0].prompt_logprobs
    assert result.routed_experts is not None
    assert len(result.routed_experts) == 9  # none for the last prompt position
    assert flat(result.routed_experts) == flat(agg[0].routed_experts)


async def test_every_item_gets_its_own_room() -> None:
    """A batch or n > 1 is one envelope per item, each paired by its own room: prompts
    that differ only in their last token get their own first token back."""
    prompts = [[*PROMPT[:-1], last] for last in (201, 202, 203, 204)]
    async with pair() as p:
        envs = [envelope(4, prompt=prompt) for prompt in prompts]
        expected = [tokens(await collect(p.agg.generate(env))) for env in envs]
        tickets = [p.decode.pd_ticket(env, p.card()) for env in envs]
        answers = await asyncio.gather(
            *(
                asyncio.gather(
                    collect(p.prefill.prefill(stage_of(env, ticket), ticket)),
                    collect(p.decode.decode(env, ticket, None)),
                )
                for env, ticket in zip(envs, tickets, strict=True)
            )
        )
    rooms = [t["bootstrap_room"] for t in tickets]
    assert len(set(rooms)) == len(rooms)
    assert all(0 <= room < 2**63 for room in rooms)
    assert {(t["bootstrap_host"], t["bootstrap_port"]) for t in tickets} == {
        ("127.0.0.1", int(p.prefill_url.rsplit(":", 1)[1]))
    }
    assert [tokens(dec) for _, dec in answers] == expected
    assert len({e[0] for e in expected}) == len(expected)  # a crossed room would show


# ---------------------------------------------------------------- failures


async def test_a_prefill_the_engine_refuses_with_4xx_is_invalid_argument() -> None:
    async with pair() as p:
        env = dataclasses.replace(
            envelope(4), format="sglang", engine={"session_params": {"id": "s-1"}}
        )
        ticket = p.decode.pd_ticket(env, p.card())
        with pytest.raises(MeshError) as caught:
            await collect(p.prefill.prefill(stage_of(env, ticket), ticket))
    assert caught.value.code is ErrorCode.INVALID_ARGUMENT
    assert caught.value.message == "Invalid request: session id s-1 does not exist"
    assert caught.value.detail == {"status_code": 400, "err_type": "BadRequestError"}


async def test_a_prefill_the_engine_aborts_without_a_status_is_internal() -> None:
    """An abort this adapter did not ask for ends a prefill as an error, never as a
    normal stop (the seed's rule), even though SGLang's reply is a normal 200 body."""
    async with pair() as p:
        await post(f"{p.prefill_url}/testkit/config", {"token_delay_ms": 2000})
        env = envelope(4)
        ticket = p.decode.pd_ticket(env, p.card())
        task = asyncio.ensure_future(collect(p.prefill.prefill(stage_of(env, ticket), ticket)))

        async def waiting() -> bool:
            return bool((await get(f"{p.prefill_url}/testkit/state"))["running"])

        await eventually(waiting)
        await post(f"{p.prefill_url}/abort_request", {"abort_all": True})
        with pytest.raises(MeshError) as caught:
            await task
    assert caught.value.code is ErrorCode.INTERNAL
    assert caught.value.message == "SGLang ended the request (abort): Abort in waiting queue"
    assert caught.value.detail == {"status_code": None, "err_type": None}


@pytest.mark.parametrize("side", ["prefill", "decode"])
async def test_a_transfer_timeout_is_a_clear_retryable_error(side: str) -> None:
    """A half whose other half never comes: SGLang ends it with a 500 transfer failure."""
    async with pair(timeout_s=0.3) as p:
        env = envelope(4)
        ticket = p.decode.pd_ticket(env, p.card())
        half = (
            p.prefill.prefill(stage_of(env, ticket), ticket)
            if side == "prefill"
            else p.decode.decode(env, ticket, None)
        )
        with pytest.raises(MeshError) as caught:
            await collect(half)
    error = caught.value
    room = ticket["bootstrap_room"]
    assert error.code is ErrorCode.UNAVAILABLE
    assert error.retryable
    assert error.detail == {"status_code": 500, "err_type": None, "reason": "kv_transfer_failed"}
    assert error.message.startswith(
        f"SGLang's KV transfer between prefill and decode failed: {side.capitalize()} "
        "transfer failed for request rank=0"
    )
    cause = (
        "timed out after 0.3s waiting for the decode instance to take the KV"
        if side == "prefill"
        else f"no KV handle for {room}"
    )
    assert error.message.endswith(f"KVTransferError(bootstrap_room={room}): {cause}")


async def post(url: str, body: dict[str, Any]) -> None:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as resp:
        assert resp.status == 200


# ---------------------------------------------------------------- a proxy that corrupts


def corrupting(change: Callable[[int, bytes], bytes]) -> Callable[[str], web.Application]:
    """A proxy to a server that passes everything on, but its `/generate` SSE events
    through `change(index, event line)`."""

    def build(upstream: str) -> web.Application:
        async def generate(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            headers = {"Content-Type": "application/json"}
            async with (
                aiohttp.ClientSession() as s,
                s.post(f"{upstream}/generate", data=body, headers=headers) as up,
            ):
                resp = web.StreamResponse(status=up.status)
                resp.content_type = up.content_type
                await resp.prepare(request)
                n = 0
                async for line in up.content:
                    if line.startswith(b"data: {"):
                        line, n = change(n, line), n + 1
                    await resp.write(line)
                return resp

        async def forward(request: web.Request) -> web.Response:
            body = await request.read()
            async with (
                aiohttp.ClientSession() as s,
                s.request(request.method, f"{upstream}{request.path_qs}", data=body) as up,
            ):
                return web.Response(
                    body=await up.read(), status=up.status, content_type=up.content_type
                )

        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_route("*", "/{tail:.*}", forward)
        return app

    return build


def on_event(index: int, replace: Callable[[bytes], bytes]) -> Callable[[int, bytes], bytes]:
    return lambda n, line: replace(line) if n == index else line


def blob(edit: Callable[[bytes], bytes]) -> Callable[[int, bytes], bytes]:
    """Every event's routed-experts blob through `edit` (of its base64 text)."""
    import orjson

    def change(_: int, line: bytes) -> bytes:
        event = orjson.loads(line[len(b"data: ") :])
        meta = event.get("meta_info") or {}
        if meta.get("routed_experts"):
            meta["routed_experts"] = edit(meta["routed_experts"].encode()).decode()
        return b"data: " + orjson.dumps(event) + b"\n"

    return change


def truncated(text: bytes) -> bytes:
    """One int32 short: still valid base64, but a row short of complete."""
    return base64.b64encode(base64.b64decode(text)[:-4])


@pytest.mark.parametrize(
    "change",
    [
        on_event(2, lambda _: b"data: {not json\n"),
        on_event(2, lambda _: b'data: {"output_ids": 5, "meta_info": {}}\n'),
    ],
    ids=["not-json", "wrong-shape"],
)
async def test_a_malformed_decode_response_aborts_the_request_and_raises(
    change: Callable[[int, bytes], bytes],
) -> None:
    async with pair(decode_proxy=corrupting(change)) as p:
        await post(f"{p.decode_url}/testkit/config", {"token_delay_ms": 20})
        env = envelope(300)
        ticket = p.decode.pd_ticket(env, p.card())
        prefill = asyncio.ensure_future(collect(p.prefill.prefill(stage_of(env, ticket), ticket)))
        with pytest.raises(MeshError) as caught:
            await collect(p.decode.decode(env, ticket, None))
        [result] = await prefill  # its KV was taken: the prefill half ended well
        calls = list(p.decode_state.abort_calls)
    assert caught.value.code is ErrorCode.UNAVAILABLE
    assert caught.value.detail == {"reason": "malformed_response"}
    assert result.finish == {"reason": "length"}
    # Cancelled on the decode server, by the adapter's own rid for the request.
    [call] = calls
    [rid] = call["ids"]
    assert len(rid) == 32
    assert rid in p.decode_state.aborted


@pytest.mark.parametrize("side", ["prefill", "decode"])
@pytest.mark.parametrize(
    "edit", [truncated, lambda _: b"%%not base64%%"], ids=["incomplete", "invalid"]
)
async def test_a_bad_expert_blob_is_omitted_whole_and_counted(
    side: str, edit: Callable[[bytes], bytes]
) -> None:
    proxy = corrupting(blob(edit))
    async with pair(
        prefill_proxy=proxy if side == "prefill" else None,
        decode_proxy=proxy if side == "decode" else None,
    ) as p:
        env = envelope(5, experts_from=0)
        agg = await collect(p.agg.generate(env))
        pre, dec = await run_pd(p, env)
    bad, good = (pre[-1], dec[-1]) if side == "prefill" else (dec[-1], pre[-1])
    assert bad.routed_experts is None
    assert good.routed_experts  # the other half's rows stand; the join drops them both
    omitted = p.prefill.pd_experts_omitted if side == "prefill" else p.decode.pd_experts_omitted
    assert omitted == 1
    assert tokens(dec) == tokens(agg)  # only the experts are lost


# ---------------------------------------------------------------- cancel


async def test_aborting_the_decode_aborts_it_on_the_decode_server() -> None:
    async with pair() as p:
        await post(f"{p.decode_url}/testkit/config", {"token_delay_ms": 20})
        env = envelope(300)
        ticket = p.decode.pd_ticket(env, p.card())
        prefill = asyncio.ensure_future(collect(p.prefill.prefill(stage_of(env, ticket), ticket)))
        outs: list[EngineOutput] = []
        aborted = False
        async with contextlib.aclosing(p.decode.decode(env, ticket, None)) as decode:
            async for out in decode:
                outs.append(out)
                if not aborted and len(tokens(outs)) >= 2:
                    aborted = True
                    assert await p.decode.abort(env.id) is True
        await prefill
        calls = list(p.decode_state.abort_calls)
    assert outs[-1].finish == {"reason": "abort", "message": "Aborted"}
    assert 2 <= len(tokens(outs)) < 300
    [call] = calls
    assert call["ids"][0] in p.decode_state.aborted


async def test_leaving_the_decode_early_aborts_it_on_the_decode_server() -> None:
    """A cancelled decode half (the client went away) stops the decode server's work."""
    async with pair() as p:
        await post(f"{p.decode_url}/testkit/config", {"token_delay_ms": 20})
        env = envelope(300)
        ticket = p.decode.pd_ticket(env, p.card())
        prefill = asyncio.ensure_future(collect(p.prefill.prefill(stage_of(env, ticket), ticket)))
        async with contextlib.aclosing(p.decode.decode(env, ticket, None)) as decode:
            async for _ in decode:
                break
        await prefill
        calls = list(p.decode_state.abort_calls)
    [call] = calls
    assert call["ids"][0] in p.decode_state.aborted


# ---------------------------------------------------------------- card and ticket


async def test_the_card_gives_the_bootstrap_address() -> None:
    async with serving(build_app(dataclasses.replace(BASE, disaggregation_mode="prefill"))) as url:
        reported = await engine(url)
        given = await engine(url.replace("127.0.0.1", "localhost"), 9123)
        named = SglangEngine(HttpEngineConfig(url=url), BootstrapConfig(host="10.0.0.7", port=9000))
        try:
            # The mock's bootstrap server is its HTTP port, and its /server_info says so.
            assert reported.pd_card() == {
                "local_prefill": False,
                "bootstrap_host": "127.0.0.1",
                "bootstrap_port": int(url.rsplit(":", 1)[1]),
            }
            assert given.pd_card()["bootstrap_host"] == "localhost"
            assert given.pd_card()["bootstrap_port"] == 9123
            assert named.pd_card()["bootstrap_host"] == "10.0.0.7"
        finally:
            for eng in (reported, given, named):
                await eng.close()


def test_the_bootstrap_address_falls_back_to_sglangs_default_port() -> None:
    config = BootstrapConfig()
    assert config.address("http://gpu1:30000", {}) == ("gpu1", DEFAULT_BOOTSTRAP_PORT)
    assert config.address("http://gpu1:30000", {"disaggregation_bootstrap_port": 9001}) == (
        "gpu1",
        9001,
    )
    assert BootstrapConfig(port=7000).address("http://gpu1:30000", {}) == ("gpu1", 7000)


def test_a_ticket_needs_the_prefill_workers_bootstrap_address() -> None:
    eng = SglangEngine(HttpEngineConfig(url="http://127.0.0.1:1"))
    with pytest.raises(MeshError) as caught:
        eng.pd_ticket(request([1, 2]), {"kind": "sglang", "local_prefill": False})
    assert caught.value.code is ErrorCode.UNAVAILABLE
    assert caught.value.message.startswith(
        "the prefill worker's card gives no SGLang bootstrap address"
    )


def test_expert_rows_take_the_tail_of_a_complete_blob_only() -> None:
    values = list(range(12))  # 4 rows of 3, or 3 of 4, or ...
    assert expert_rows(values, 4, 2) == [[6, 7, 8], [9, 10, 11]]
    assert expert_rows(values, 4, 0) == []
    assert expert_rows(values, 3, 3) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert expert_rows(values, 5, 1) is None  # not 5 rows of one width
    assert expert_rows([], 2, 1) is None  # nothing where rows must be
    assert expert_rows([], 0, 0) == []
    assert expert_rows([1], 0, 0) is None
    assert expert_rows(None, 4, 2) is None


async def test_a_prefill_workers_card_gives_its_bootstrap_address(nats_url: str) -> None:
    """Through `genmesh worker`'s options: the card a decode worker pairs by."""
    mesh = InProcessMesh(nats_url, unique_namespace("sglang-pd"))
    try:
        _, url = mesh.spawn_engine_server("sglang", "--disaggregation-mode", "prefill")
        options = ("--role", "prefill", "--engine-bootstrap-port", "9123")
        mesh.add_worker("p1", engine="sglang", engine_url=url, extra_args=options)
        card = await announced(mesh.nats_url, mesh.namespace, "p1")
    finally:
        mesh.stop()
    assert card["role"] == "prefill"
    assert card["disagg"] == {
        "kind": "sglang",
        "local_prefill": False,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": 9123,
    }


async def announced(nats_url: str, namespace: str, worker_id: str) -> dict[str, Any]:
    """`worker_id`'s card, as discovery answers a query."""
    subjects = Subjects(namespace)
    codec = get_codec(None)
    nc = await nats.connect(nats_url)
    cards: list[dict[str, Any]] = []

    async def on_card(msg: Any) -> None:
        cards.append(codec.decode(msg.data))

    async def seen() -> bool:
        return any(c["id"] == worker_id for c in cards)

    try:
        await nc.subscribe(subjects.announce, cb=on_card)
        await flush_in_order(nc)
        await publish(nc, subjects.query, codec, {})
        await eventually(seen)
    finally:
        await nc.close()
    return next(c for c in cards if c["id"] == worker_id)


# ---------------------------------------------------------------- through the workers


@pytest.mark.parametrize("max_tokens", [0, 1, 6])
async def test_a_decode_worker_pairs_with_an_sglang_prefill_worker(
    nats_url: str, max_tokens: int
) -> None:
    """The whole P/D path over NATS (services/worker/disagg.py): the envelope reaches the
    decode worker with the `genmesh-prefill` header, the stage runs on the prefill worker,
    and the joined frames give the aggregated server's answer, expert rows included."""
    mesh = InProcessMesh(nats_url, unique_namespace("sglang-pd"))
    try:
        _, agg_url = mesh.spawn_engine_server("sglang", "--vocab-size", "1000")
        servers = {
            role: mesh.spawn_engine_server(
                "sglang", "--vocab-size", "1000", "--disaggregation-mode", role
            )[1]
            for role in ("prefill", "decode")
        }
        for wid, role in (("p1", "prefill"), ("d1", "decode")):
            mesh.add_worker(
                wid, engine="sglang", engine_url=servers[role], extra_args=("--role", role)
            )
        await announced(mesh.nats_url, mesh.namespace, "p1")
        env = envelope(max_tokens, experts_from=20)
        agg = await collect_generate(agg_url, env)
        frames = await via_decode_worker(mesh, env, "d1", "p1")
        prefill_state = await get(f"{servers['prefill']}/testkit/state")
        handles = await get(f"{servers['prefill']}/testkit/pd")
    finally:
        mesh.stop()
    outs = [f for f in frames if f["t"] in ("out", "end")]
    assert outs[-1]["t"] == "end", frames
    assert [t for f in outs for t in f["tokens"]] == tokens(agg)
    assert [x for f in outs for x in f.get("logprobs", [])] == field_of(agg, "logprobs")
    assert outs[0]["prompt_logprobs"] == agg[0].prompt_logprobs
    assert [x for f in outs for row in f.get("routed_experts", []) for x in row] == [
        x for out in agg for x in flat(out.routed_experts)
    ]
    assert outs[-1]["finish"] == {"reason": "length"}
    assert prefill_state["received"] == 1  # the prefill really ran there
    assert handles["handles"] == []


async def collect_generate(url: str, env: Envelope) -> list[EngineOutput]:
    eng = await engine(url)
    try:
        return await collect(eng.generate(env))
    finally:
        await eng.close()


async def via_decode_worker(
    mesh: InProcessMesh, env: Envelope, decode: str, prefill: str
) -> list[dict[str, Any]]:
    """`env`'s frames from the decode worker, sent as a router sends a paired request."""
    codec = get_codec(None)
    nc = await nats.connect(mesh.nats_url)
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(
            Subjects(mesh.namespace).worker_generate(decode),
            codec.encode(env.to_wire()),
            reply=inbox,
            headers={PREFILL_HEADER: prefill},
        )
        frames: list[dict[str, Any]] = []
        while (msg := await sub.next_msg(timeout=10)).data:
            frames.append(codec.decode(msg.data))
        return frames
    finally:
        await nc.close()


async def test_a_refused_prefill_stops_the_decode_on_its_server(nats_url: str) -> None:
    """The prefill server refuses the stage (HTTP 400): the request ends with that error,
    and the decode half, waiting for KV that will never come, is aborted on its server."""
    mesh = InProcessMesh(nats_url, unique_namespace("sglang-pd"))
    try:
        servers = {
            role: mesh.spawn_engine_server("sglang", "--disaggregation-mode", role)[1]
            for role in ("prefill", "decode")
        }
        for wid, role in (("p1", "prefill"), ("d1", "decode")):
            mesh.add_worker(
                wid, engine="sglang", engine_url=servers[role], extra_args=("--role", role)
            )
        await announced(mesh.nats_url, mesh.namespace, "p1")
        fault = {"kind": "http_error", "status": 400, "message": "no such LoRA"}
        await post(f"{servers['prefill']}/testkit/faults", fault)
        frames = await via_decode_worker(mesh, envelope(6), "d1", "p1")

        async def decode_stopped() -> bool:
            state = await get(f"{servers['decode']}/testkit/state")
            return state["running"] == [] and len(state["abort_calls"]) == 1

        await eventually(decode_stopped)
    finally:
        mesh.stop()
    err = frames[-1]
    assert err["t"] == "err"
    assert err["code"] == "invalid_argument"
    assert err["message"] == "no such LoRA"
    assert err["detail"] == {"status_code": 400, "err_type": None, "prefill_worker": "p1"}


# ---------------------------------------------------------------- the differential law

SMALL = dataclasses.replace(BASE, vocab_size=16, eos_token_id=7)  # EOS comes often
EXAMPLES = int(os.environ.get("GENMESH_SGLANG_PD_EXAMPLES", "60"))


@st.composite
def pd_cases(draw: st.DrawFn) -> tuple[Envelope, bool]:
    """A request with random prompt, budget (0 included), stops, logprob and expert options;
    and whether the servers stream incrementally. (No stop ids under ignore_eos: those the
    adapter cuts itself, and an aggregated run then never sees the expert blob.)"""
    n = draw(st.integers(1, 24))
    tokens = st.integers(0, SMALL.vocab_size - 1)
    prompt = draw(st.lists(tokens, min_size=n, max_size=n))
    max_tokens = draw(st.integers(0, 8))
    ignore_eos = draw(st.booleans())
    env = request(
        prompt,
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, min(max_tokens, 2))),
        ignore_eos=ignore_eos,
        stop_token_ids=[] if ignore_eos else draw(st.lists(tokens, max_size=2, unique=True)),
        logprobs=draw(st.booleans()),
        top_logprobs=draw(st.integers(0, 2)),
        prompt_logprobs_start=draw(st.none() | st.integers(0, n - 1)),
    )
    output = dataclasses.replace(
        env.output,
        logprob_token_ids=draw(st.lists(tokens, max_size=2, unique=True)),
        routed_experts_start=draw(st.none() | st.integers(0, n)),
    )
    return dataclasses.replace(env, output=output), draw(st.booleans())


def joined(env: Envelope, pre: list[EngineOutput], dec: list[EngineOutput]) -> list[EngineOutput]:
    """The halves as the decode worker joins them (services/worker/disagg.py)."""
    result = PrefillResult()
    for out in pre:
        result.add(output_frame(prefill_stage_id(env.id), out))
    if env.sampling.max_tokens == 0:
        return [result.as_output()]
    join = PdJoin(env, result)
    return [join.join(out) for out in dec]


def answer(outs: list[EngineOutput]) -> dict[str, Any]:
    """What a client is told, whatever the chunking."""
    first, last = outs[0], outs[-1]
    return {
        "tokens": tokens(outs),
        **{name: field_of(outs, name) for name in ("logprobs", "top_logprobs")},
        "token_ids_logprobs": field_of(outs, "token_ids_logprobs"),
        "prompt_logprobs": first.prompt_logprobs,
        "prompt_top_logprobs": first.prompt_top_logprobs,
        "prompt_token_ids_logprobs": first.prompt_token_ids_logprobs,
        "cached_tokens": first.cached_tokens,
        "routed_experts": [x for out in outs for x in flat(out.routed_experts)],
        "finish": last.finish,
        "usage": last.usage,
    }


def test_the_joined_halves_answer_what_an_aggregated_server_answers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    ran = 0

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,  # the same cases every run
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(pd_cases())
    def law(case: tuple[Envelope, bool]) -> None:
        nonlocal ran
        ran += 1
        env, incremental = case

        async def example() -> None:
            async with pair(base=SMALL, incremental=incremental) as p:
                agg = await collect(p.agg.generate(env))
                if env.sampling.max_tokens == 0:  # the decode worker runs no decode
                    ticket = p.decode.pd_ticket(env, p.card())
                    pre = await collect(p.prefill.prefill(stage_of(env, ticket), ticket))
                    dec: list[EngineOutput] = []
                else:
                    pre, dec = await run_pd(p, env)
                assert answer(joined(env, pre, dec)) == answer(agg)
                assert p.prefill.pd_experts_omitted == p.decode.pd_experts_omitted == 0

        asyncio.run(example())

    law()
    with capsys.disabled():
        print(f"\nSGLang P/D differential: {ran} cases", end="")
    assert ran == EXAMPLES

"""The mock engine as a prefill/decode pair over a real NATS server: the decode half pulls
the prefill's KV handle from the prefill's worker subject and continues exactly as
`generate` would (docs/disaggregation.md, "The mock's P/D")."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import nats
import pytest
from nats.aio.client import Client
from nats.errors import NoRespondersError

from genmesh.codecs import get_codec
from genmesh.engines.base import EngineOutput, usage
from genmesh.engines.kv_transfer import BAD_PULL
from genmesh.engines.mock import MockConfig, MockEngine
from genmesh.shared.bus import PREFILL_HEADER, flush_in_order
from genmesh.shared.envelope import Disagg, Envelope, prefill_stage_id
from genmesh.shared.errors import ErrorCode, MeshError
from genmesh.shared.kv_events import BlockStored
from genmesh.shared.settings import parse
from genmesh.shared.subjects import Subjects
from tests.conftest import unique_namespace
from tests.engines.test_vllm_pd import folded, frames_from
from tests.inproc import InProcessMesh

pytestmark = pytest.mark.inproc

PREFILL, DECODE = "wp", "wd"
SMALL = MockConfig(vocab_size=1000, eos_token_id=7, max_model_len=64)


@dataclasses.dataclass
class Pair:
    prefill: MockEngine
    decode: MockEngine
    subjects: Subjects
    nc: Client  # for the tests' own requests
    prefill_nc: Client  # the prefill engine's


@pytest.fixture
async def connect(nats_url: str) -> AsyncIterator[Callable[[], Any]]:
    connections: list[Client] = []

    async def new() -> Client:
        nc = await nats.connect(nats_url)
        connections.append(nc)
        return nc

    yield new
    for nc in connections:
        await nc.close()


@pytest.fixture
async def make_pair(connect: Callable[[], Any]) -> AsyncIterator[Any]:
    """Two mocks attached as prefill worker `wp` and decode worker `wd` of a namespace of
    their own, each on its own NATS connection; closed at the end."""
    engines: list[MockEngine] = []

    async def make(prefill: MockConfig = SMALL, decode: MockConfig | None = None) -> Pair:
        subjects = Subjects(unique_namespace("pd"))
        own, prefill_nc = await connect(), await connect()
        pair = Pair(MockEngine(prefill), MockEngine(decode or prefill), subjects, own, prefill_nc)
        engines.extend((pair.prefill, pair.decode))
        await pair.prefill.pd_attach(pair.prefill_nc, subjects, PREFILL)
        await pair.decode.pd_attach(await connect(), subjects, DECODE)
        return pair

    yield make
    for engine in engines:
        await engine.close()


@pytest.fixture
async def pair(make_pair: Any) -> Pair:
    made: Pair = await make_pair()
    return made


def stage_of(env: Envelope) -> Envelope:
    """The prefill stage a decode worker sends for `env` (shared/envelope.py)."""
    return dataclasses.replace(env, id=prefill_stage_id(env.id), disagg=Disagg(env.id))


async def collect(outputs: AsyncIterator[EngineOutput]) -> list[EngineOutput]:
    return [out async for out in outputs]


async def disaggregated(pair: Pair, env: Envelope) -> tuple[list[EngineOutput], list[EngineOutput]]:
    """The prefill stage's outputs, and the decode's (none when no handle was handed over)."""
    prefilled = await collect(pair.prefill.prefill(stage_of(env), {}))
    handoff = prefilled[-1].handoff
    decoded = await collect(pair.decode.decode(env, {}, handoff)) if handoff else []
    return prefilled, decoded


async def refusal(pair: Pair, env: Envelope, handoff: dict[str, Any] | None) -> MeshError:
    with pytest.raises(MeshError) as info:
        await collect(pair.decode.decode(env, {}, handoff))
    assert info.value.code is ErrorCode.UNAVAILABLE
    return info.value


def envelope(prompt: list[int], **fields: Any) -> Envelope:
    """An envelope with these `sampling` and `output` fields."""
    env = Envelope(id="r1", token_ids=prompt)
    for name, value in fields.items():
        setattr(env.output if hasattr(env.output, name) else env.sampling, name, value)
    return env


# ---------------------------------------------------------------- the pair equals generate


def random_case(rng: random.Random) -> tuple[MockConfig, Envelope]:
    config = rng.choice(
        [
            MockConfig(vocab_size=8, eos_token_id=7, max_model_len=64),
            MockConfig(vocab_size=16, eos_token_id=3, max_model_len=64),
            SMALL,
        ]
    )
    vocab = config.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
    fmt = rng.choice(["tokens", "sglang", "vllm"])
    engine: dict[str, Any] = {}
    if rng.random() < 0.3:
        bias = {str(rng.randrange(vocab)): rng.choice([-100.0, -2.5, 1.5, 100.0])}
        engine = {"sampling_params": {"logit_bias": bias}}
    env = Envelope(id=f"r{rng.randrange(1 << 30)}", token_ids=prompt, format=fmt, engine=engine)
    s, o = env.sampling, env.output
    s.max_tokens = rng.choice([None, 0, 1, 1, 2, rng.randint(3, 40)])
    s.min_tokens = rng.choice([0, 0, rng.randint(0, 10)])
    s.seed = rng.choice([None, rng.randrange(1 << 64)])
    s.stop_token_ids = [rng.randrange(vocab) for _ in range(rng.choice([0, 0, 1, 3]))]
    s.ignore_eos = rng.random() < 0.3
    o.logprobs = rng.random() < 0.5
    o.top_logprobs = rng.choice([0, 0, rng.randint(1, 5)])
    o.prompt_logprobs_start = rng.choice([None, rng.randrange(len(prompt))])
    o.routed_experts_start = rng.choice([None, rng.randrange(len(prompt))])
    if rng.random() < 0.3:
        o.logprob_token_ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
    return config, env


PROMPT_FIELDS = (
    "prompt_logprobs",
    "prompt_ranks",
    "prompt_top_logprobs",
    "prompt_token_ids_logprobs",
)


async def test_prefill_then_decode_equals_generate_field_by_field(
    make_pair: Any,
) -> None:
    """The differential property, over random prompts, budgets 0..40 (1 often), seeds,
    stop ids, min_tokens, logit_bias in each format, logprobs, top-k, listed token ids,
    prompt logprobs and routed experts on and off."""
    rng = random.Random(14)
    cases = 0
    pairs: dict[MockConfig, Pair] = {}
    for _ in range(240):
        config, env = random_case(rng)
        if config not in pairs:
            pairs[config] = await make_pair(config)
        pair = pairs[config]
        whole = await collect(MockEngine(config).generate(copy.deepcopy(env)))
        prefilled, decoded = await disaggregated(pair, env)
        prompt_rows = (
            0
            if env.output.routed_experts_start is None
            else len(env.token_ids) - env.output.routed_experts_start
        )
        budget = env.sampling.max_tokens
        if budget == 0:
            # Nothing to decode: the prefill's answer is generate's, and no handle is kept.
            assert prefilled == whole, env
            assert decoded == []
        else:
            # The prefill: what generate's first output says of the prompt, then a stop.
            [last] = prefilled
            expected = EngineOutput(tokens=[], cached_tokens=whole[0].cached_tokens)
            for name in PROMPT_FIELDS:
                setattr(expected, name, getattr(whole[0], name))
            if prompt_rows or env.output.routed_experts_start is not None:
                expected.routed_experts = (whole[0].routed_experts or [])[:prompt_rows]
            expected.finish = {"reason": "length"}
            expected.usage = usage(len(env.token_ids), 0, whole[0].cached_tokens or 0)
            handoff = last.handoff
            assert handoff is not None
            assert handoff["worker"] == PREFILL
            assert handoff["bytes"] == len(env.token_ids) * config.kv_bytes_per_token
            assert dataclasses.replace(last, handoff=None) == expected, env
            # The decode: generate's outputs, chunk by chunk, less what prefill gave.
            want = copy.deepcopy(whole)
            for name in PROMPT_FIELDS:
                setattr(want[0], name, None)
            if want[0].routed_experts is not None:
                want[0].routed_experts = want[0].routed_experts[prompt_rows:]
            assert decoded == want, env
        cases += 1
    for pair in pairs.values():
        assert pair.prefill.pd_card()["handles"] == 0
        await pair.prefill.close()
        assert cases == 240


# ---------------------------------------------------------------- the handle's life


async def test_the_handle_holds_the_prompts_kv_until_pulled_once(make_pair: Any) -> None:
    cached = MockConfig(vocab_size=1000, eos_token_id=7, kv_blocks=64, block_size=4)
    pair: Pair = await make_pair(cached)
    env = envelope(list(range(100, 110)), max_tokens=3, ignore_eos=True)
    [last] = await collect(pair.prefill.prefill(stage_of(env), {}))
    assert last.handoff is not None
    # The prompt's 3 blocks stay held for the decode, as a NIXL prefill holds them.
    assert pair.prefill.pd_card() == {"local_prefill": True, "handles": 1}
    assert pair.prefill.kv_usage().used_blocks == 3
    decoded = await collect(pair.decode.decode(env, {}, last.handoff))
    assert [t for o in decoded for t in o.tokens]
    assert pair.prefill.pd_card()["handles"] == 0
    assert pair.prefill.kv_usage().used_blocks == 0
    # Pulled once: a second pull of the same handle finds nothing.
    error = await refusal(pair, env, last.handoff)
    assert error.message == (
        f"KV transfer failed: unknown KV handle {last.handoff['handle']!r} (never made here, "
        f"already pulled, or expired after 30s) (prefill worker {PREFILL})"
    )


async def test_an_unpulled_handle_expires_and_frees_its_kv(make_pair: Any) -> None:
    config = dataclasses.replace(SMALL, pd_handle_ttl_s=0.05)
    pair: Pair = await make_pair(config)
    env = envelope([1, 2, 3, 4, 5], max_tokens=4)
    [last] = await collect(pair.prefill.prefill(stage_of(env), {}))
    assert pair.prefill.pd_card()["handles"] == 1
    assert pair.prefill.kv_usage().used_blocks == 1  # 5 tokens, counted without a cache
    # The loop's timers fire in order: the handle's expiry (0.05 s) before this sleep's end.
    await asyncio.sleep(0.1)
    assert pair.prefill.pd_card()["handles"] == 0
    assert pair.prefill.kv_usage().used_blocks == 0
    error = await refusal(pair, env, last.handoff)
    assert error.message == (
        f"KV transfer failed: unknown KV handle {last.handoff['handle']!r} (never made here, "  # type: ignore[index]
        f"already pulled, or expired after 0.05s) (prefill worker {PREFILL})"
    )


async def test_a_ttl_of_zero_forgets_every_handle_at_once(make_pair: Any) -> None:
    pair: Pair = await make_pair(dataclasses.replace(SMALL, pd_handle_ttl_s=0.0))
    env = envelope([1, 2, 3], max_tokens=2)
    [last] = await collect(pair.prefill.prefill(stage_of(env), {}))
    assert last.handoff is not None
    error = await refusal(pair, env, last.handoff)
    assert error.message == (
        f"KV transfer failed: unknown KV handle {last.handoff['handle']!r} (never made here, "
        f"already pulled, or expired after 0s) (prefill worker {PREFILL})"
    )
    assert pair.prefill.kv_usage().used_blocks == 0


async def test_a_budget_of_zero_keeps_no_handle(pair: Pair) -> None:
    env = envelope([1, 2, 3], max_tokens=0)
    [only] = await collect(pair.prefill.prefill(stage_of(env), {}))
    assert only.handoff is None
    assert only.finish == {"reason": "length"}
    assert only.usage == usage(3, 0, 0)
    assert pair.prefill.pd_card()["handles"] == 0


async def test_closing_the_engine_frees_its_handles_and_ends_its_subscription(
    make_pair: Any,
) -> None:
    pair: Pair = await make_pair()
    env = envelope([1, 2, 3], max_tokens=2)
    [last] = await collect(pair.prefill.prefill(stage_of(env), {}))
    assert pair.prefill.kv_usage().used_blocks == 1
    await pair.prefill.close()
    assert pair.prefill.pd_card()["handles"] == 0
    assert pair.prefill.kv_usage().used_blocks == 0
    await flush_in_order(pair.prefill_nc)  # the server has seen the unsubscription
    error = await refusal(pair, env, last.handoff)
    assert error.message == (
        f"KV transfer failed: the prefill worker is gone (no responders) (prefill worker {PREFILL})"
    )


async def test_a_cancelled_prefill_leaves_no_handle(make_pair: Any) -> None:
    # A slow prefill (1% speed: its 16.5 ms of model time take 1.65 s), cancelled as it runs.
    pair: Pair = await make_pair(dataclasses.replace(SMALL, speedup=0.01))
    env = envelope([1, 2, 3], max_tokens=2)
    task = asyncio.ensure_future(collect(pair.prefill.prefill(stage_of(env), {})))
    for _ in range(5):
        await asyncio.sleep(0)
    assert pair.prefill.kv_usage().used_blocks == 1  # it runs
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pair.prefill.pd_card()["handles"] == 0
    assert pair.prefill.kv_usage().used_blocks == 0


async def test_an_aborted_prefill_raises_and_leaves_no_handle(make_pair: Any) -> None:
    # (The abort lands when the prefill's forward pass ends: 16.5 ms at 10% speed.)
    pair: Pair = await make_pair(dataclasses.replace(SMALL, speedup=0.1))
    env = stage_of(envelope([1, 2, 3], max_tokens=2))
    task = asyncio.ensure_future(collect(pair.prefill.prefill(env, {})))
    for _ in range(5):
        await asyncio.sleep(0)
    assert await pair.prefill.abort(env.id)
    with pytest.raises(MeshError) as info:
        await task
    assert (info.value.code, info.value.message) == (
        ErrorCode.UNAVAILABLE,
        "the prefill was aborted",
    )
    assert pair.prefill.pd_card()["handles"] == 0


# ---------------------------------------------------------------- failures, as an engine fails


async def test_a_handle_made_for_another_prompt_is_refused(pair: Pair) -> None:
    env = envelope([1, 2, 3], max_tokens=2)
    [last] = await collect(pair.prefill.prefill(stage_of(env), {}))
    assert last.handoff is not None
    error = await refusal(pair, envelope([1, 2, 4], max_tokens=2), last.handoff)
    assert error.message == (
        f"KV transfer failed: KV handle {last.handoff['handle']!r} holds another prompt's KV "
        f"(prefill worker {PREFILL})"
    )
    # The seed is part of what the KV was made from too.
    [last] = await collect(pair.prefill.prefill(stage_of(env), {}))
    assert last.handoff is not None
    error = await refusal(pair, envelope([1, 2, 3], max_tokens=2, seed=5), last.handoff)
    assert "holds another prompt's KV" in error.message


async def test_an_unknown_handle_is_refused(pair: Pair) -> None:
    env = envelope([1, 2, 3], max_tokens=2)
    error = await refusal(pair, env, {"worker": PREFILL, "handle": "nope", "bytes": 1})
    assert error.message == (
        "KV transfer failed: unknown KV handle 'nope' (never made here, already pulled, "
        f"or expired after 30s) (prefill worker {PREFILL})"
    )
    assert error.retryable


@pytest.mark.parametrize(
    "handoff",
    [None, {}, {"worker": PREFILL}, {"handle": "h"}, {"worker": "*", "handle": "h"}],
)
async def test_a_handoff_without_a_handle_is_refused(
    pair: Pair, handoff: dict[str, Any] | None
) -> None:
    error = await refusal(pair, envelope([1, 2, 3], max_tokens=2), handoff)
    assert error.message == f"KV transfer failed: no KV handle in the handoff {handoff!r}"


async def test_a_prefill_worker_that_does_not_answer_times_out(
    make_pair: Any, connect: Callable[[], Any]
) -> None:
    pair: Pair = await make_pair(dataclasses.replace(SMALL, pd_transfer_timeout_s=0.2))
    silent = await connect()
    asked: list[bytes] = []

    async def swallow(msg: Any) -> None:
        asked.append(msg.data)

    await silent.subscribe(pair.subjects.worker_kv_pull("mute"), cb=swallow)
    await flush_in_order(silent)
    env = envelope([1, 2, 3], max_tokens=2)
    loop = asyncio.get_running_loop()
    began = loop.time()
    error = await refusal(pair, env, {"worker": "mute", "handle": "h1", "bytes": 1})
    assert loop.time() - began >= 0.2
    assert error.message == "KV transfer failed: no answer within 0.2s (prefill worker mute)"
    assert [get_codec(None).decode(data) for data in asked] == [{"handle": "h1"}]


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (b"\xc1", "an unreadable answer: not valid msgpack: "),
        (b"\x93\x01\x02\x03", "an unreadable answer: [1, 2, 3]"),
        (b"\x81\xa1x\x01", "an unreadable answer: {'x': 1}"),
    ],
)
async def test_an_answer_that_is_no_handle_is_refused(
    pair: Pair, connect: Callable[[], Any], answer: bytes, why: str
) -> None:
    impostor = await connect()

    async def answer_badly(msg: Any) -> None:
        await msg.respond(answer)

    await impostor.subscribe(pair.subjects.worker_kv_pull("odd"), cb=answer_badly)
    await flush_in_order(impostor)
    error = await refusal(pair, envelope([1, 2], max_tokens=2), {"worker": "odd", "handle": "h"})
    assert error.message.startswith(f"KV transfer failed: {why}")
    assert error.message.endswith("(prefill worker odd)")


async def test_the_kv_pull_subject_answers_a_bad_request_with_an_error(pair: Pair) -> None:
    codec = get_codec(None)
    subject = pair.subjects.worker_kv_pull(PREFILL)
    assert subject == f"genmesh.{pair.subjects.namespace}.worker.{PREFILL}.kv_pull"
    for request in ({}, {"handle": 5}, [1]):
        reply = await pair.nc.request(subject, codec.encode(request), timeout=2)
        assert codec.decode(reply.data) == {"error": BAD_PULL}
    # A pull over plain NATS: the payload, once.
    env = envelope([1, 2, 3], max_tokens=2)
    [last] = await collect(pair.prefill.prefill(stage_of(env), {}))
    assert last.handoff is not None
    reply = await pair.nc.request(
        subject, codec.encode({"handle": last.handoff["handle"]}), timeout=2
    )
    payload = codec.decode(reply.data)
    assert sorted(payload) == ["bytes", "cached_tokens", "prompt", "state"]
    assert payload["bytes"] == 3 * 131_072
    assert pair.prefill.pd_card()["handles"] == 0


# ---------------------------------------------------------------- time, cache, settings


async def test_the_decode_waits_the_transfer_time(make_pair: Any) -> None:
    # 50 tokens of 128 KiB (the prefill's setting) at 0.1 GB/s: 66 ms; at half speed 131 ms.
    slow_link = dataclasses.replace(SMALL, transfer_gbps=0.1, speedup=0.5)
    pair: Pair = await make_pair(SMALL, slow_link)
    env = envelope(list(range(50)), max_tokens=1)
    [last] = await collect(pair.prefill.prefill(stage_of(env), {}))
    assert last.handoff is not None
    assert last.handoff["bytes"] == 50 * 131_072
    loop = asyncio.get_running_loop()
    began = loop.time()
    decoded = await collect(pair.decode.decode(env, {}, last.handoff))
    assert loop.time() - began >= 50 * 131_072 / 0.1e9 / 0.5
    assert len(decoded[-1].tokens) == 1


async def test_the_decode_caches_the_transferred_blocks_and_says_so(make_pair: Any) -> None:
    cached = MockConfig(vocab_size=1000, eos_token_id=7, kv_blocks=64, block_size=4)
    pair: Pair = await make_pair(cached)
    aggregated = MockEngine(cached)
    env = envelope(list(range(100, 110)), max_tokens=9, ignore_eos=True)

    async def stored_by(engine: MockEngine, run: Any) -> list[bytes]:
        events = engine.kv_events()
        assert events is not None
        await run
        hashes: list[bytes] = []
        while True:
            try:
                batch = await asyncio.wait_for(anext(events), 0.2)
            except TimeoutError:
                break
            hashes += [
                h for e in batch.events if isinstance(e, BlockStored) for h in e.block_hashes
            ]  # type: ignore[misc]
        await events.aclose()  # type: ignore[attr-defined]
        return hashes

    whole = await stored_by(aggregated, collect(aggregated.generate(copy.deepcopy(env))))
    [last] = await collect(pair.prefill.prefill(stage_of(env), {}))
    decoded = await stored_by(pair.decode, collect(pair.decode.decode(env, {}, last.handoff)))
    # The decode holds what an aggregated engine holds: the prompt's blocks (computed by
    # the prefill, transferred) and its output's.
    assert decoded == whole
    assert len(whole) == (10 + 9 - 1) // 4
    # Its prefix cache finds them for the next request.
    again = await collect(pair.decode.generate(envelope([*range(100, 110), 1], max_tokens=1)))
    assert again[0].cached_tokens == 8


async def test_a_flush_waits_for_the_handles_as_for_running_requests(pair: Pair) -> None:
    env = envelope([1, 2, 3], max_tokens=2)
    await collect(pair.prefill.prefill(stage_of(env), {}))
    with pytest.raises(MeshError) as info:
        await pair.prefill.flush_cache()
    assert info.value.message == (
        "Cache not flushed because there are pending requests (#running-req: 1)"
    )


def test_the_options_and_their_refusals() -> None:
    config = parse(
        MockConfig,
        [
            "--mock-kv-bytes-per-token",
            "1024",
            "--mock-transfer-gbps",
            "0",
            "--mock-pd-handle-ttl",
            "2.5",
            "--mock-pd-transfer-timeout",
            "1",
        ],
    )
    assert (
        config.kv_bytes_per_token,
        config.transfer_gbps,
        config.pd_handle_ttl_s,
        config.pd_transfer_timeout_s,
    ) == (1024, 0.0, 2.5, 1.0)
    defaults = MockConfig()
    assert (defaults.kv_bytes_per_token, defaults.pd_handle_ttl_s) == (131_072, 30.0)
    assert defaults.pd_transfer_timeout_s == 10.0
    for flag, value in (("--mock-pd-handle-ttl", "-1"), ("--mock-pd-transfer-timeout", "0")):
        with pytest.raises(SystemExit):
            parse(MockConfig, [flag, value])
    assert parse(MockConfig, ["--mock-pd-handle-ttl", "0"]).pd_handle_ttl_s == 0


async def test_decode_and_prefill_need_a_mesh() -> None:
    engine = MockEngine(SMALL)
    env = envelope([1, 2, 3], max_tokens=2)
    for outputs in (engine.prefill(stage_of(env), {}), engine.decode(env, {}, None)):
        with pytest.raises(MeshError) as info:
            await collect(outputs)
        assert info.value.code is ErrorCode.INTERNAL
    # A budget of 0 needs no handle, so no mesh.
    assert (await collect(engine.prefill(stage_of(envelope([1], max_tokens=0)), {})))[0].finish


# ---------------------------------------------------------------- on a worker


async def test_prefill_and_decode_workers_attach_their_mocks(
    empty_mesh: InProcessMesh, nats_url: str
) -> None:
    """The worker's own start attaches the mock (`pd_attach`) under the worker's id and
    announces its P/D facts; the kv_pull subject lives as long as the worker."""
    empty_mesh.add_frontend()
    prefill = empty_mesh.add_worker(
        "wpre", extra_args=("--role", "prefill", "--mock-pd-handle-ttl", "7")
    )
    empty_mesh.add_worker("wdec", extra_args=("--role", "decode"))
    workers = {w["id"]: w for w in empty_mesh.server_info()["genmesh"]["workers"]}
    for wid in ("wpre", "wdec"):
        assert workers[wid]["disagg"] == {"kind": "mock", "local_prefill": True, "handles": 0}
    codec = get_codec(None)
    subject = Subjects(empty_mesh.namespace).worker_kv_pull("wpre")
    nc = await nats.connect(nats_url)
    try:
        reply = await nc.request(subject, codec.encode({"handle": "h"}), timeout=5)
        assert codec.decode(reply.data) == {
            "error": "unknown KV handle 'h' (never made here, already pulled, or expired after 7s)"
        }
        empty_mesh.stop_service(prefill)
        with pytest.raises(NoRespondersError):
            await nc.request(subject, codec.encode({"handle": "h"}), timeout=5)
    finally:
        await nc.close()


@pytest.mark.parametrize(
    "options",
    [
        {"max_tokens": 0, "prompt_logprobs_start": 2},
        {"max_tokens": 1, "routed_experts_start": 0},
        {"max_tokens": 40, "logprobs": True, "top_logprobs": 2, "routed_experts_start": 3},
        {"max_tokens": 9, "min_tokens": 9, "seed": 7, "prompt_logprobs_start": 0},
    ],
    ids=["budget0", "budget1_experts", "chunks_logprobs_experts", "seeded_prompt_logprobs"],
)
async def test_a_decode_worker_paired_by_header_answers_as_it_does_alone(
    empty_mesh: InProcessMesh, options: dict[str, Any]
) -> None:
    """The decode worker's orchestrator (services/worker/disagg.py) over two mock workers:
    the paired answer's frames add up to the aggregated one's, expert rows joined."""
    prefill = empty_mesh.add_worker("m-prefill", wait=False, extra_args=("--role", "prefill"))
    empty_mesh.add_worker("m-decode", wait=False, extra_args=("--role", "decode"))
    empty_mesh.add_frontend()
    empty_mesh.wait_for_workers(lambda known: {"m-prefill", "m-decode"} <= known)

    def env(rid: str) -> Envelope:
        e = envelope(list(range(10, 30)), **options)
        e.id = rid
        return e

    alone = await frames_from(empty_mesh, "m-decode", env("a" * 32), None)
    paired = await frames_from(empty_mesh, "m-decode", env("b" * 32), {PREFILL_HEADER: "m-prefill"})
    assert paired[-1]["t"] == "end", paired[-1]
    assert folded(paired) == folded(alone)
    # The prefill ran there (and nowhere for the request alone), and left no handle.
    assert sum(prefill.value.stage_stats.values()) == 1
    assert prefill.value.engine.pd_card()["handles"] == 0

"""A deterministic, GPU-free engine.

The next token is a pure function of (seed, every token so far), computed with chained
checksums (CRC-32 and Adler-32, in C), so any worker continues any sequence exactly as
another would: the property mid-stream migration relies on. The mock decodes greedily: the
sampled token is the top candidate unless min-tokens masking forbids it. Logprobs are
derived from the same state, so they too are identical everywhere.

Timing follows Dynamo's mocker polynomials (reference `dynamo-generate.md` §14), divided
by a speed-up factor; speed-up 0 means an instant engine.
"""

from __future__ import annotations

import asyncio
import functools
import json
import zlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import xxhash

from genmesh import __version__
from genmesh.codecs.int32 import all_below, to_le_bytes
from genmesh.engines.base import EngineOutput, KvUsage, usage
from genmesh.engines.kv_feed import KvEventFeed
from genmesh.engines.kv_transfer import KvHandles, TransferFailed, pull_kv, serve_kv_pull
from genmesh.engines.logit_bias import BIASED_LOGPROB_FORMATS, BiasedStep, read_logit_bias
from genmesh.engines.prefix_cache import BlockPool, RequestBlocks
from genmesh.shared.bus import unsubscribe_quietly
from genmesh.shared.engine_info import SAMPLING_DEFAULT_KEYS, EngineInfo, sampling_defaults
from genmesh.shared.envelope import Envelope
from genmesh.shared.errors import ErrorCode, MeshError
from genmesh.shared.frames import Finish, TopLogprobs
from genmesh.shared.ids import is_subject_token
from genmesh.shared.kv_events import KvEventBatch, request_extra_keys
from genmesh.shared.micro import MicroEndpoint
from genmesh.shared.multimodal import FeaturesError, envelope_items
from genmesh.shared.settings import non_negative_float, option, positive_float, positive_int

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.subscription import Subscription

    from genmesh.shared.micro import MicroService
    from genmesh.shared.subjects import Subjects

_MASK = (1 << 64) - 1
# The most top-logprob alternatives the mock reports per position (vLLM's default cap).
MAX_TOP_LOGPROBS = 20
# Tokens the instant mock (speed-up 0) makes per scheduling point, as one output.
MOCK_CHUNK_TOKENS = 32
# The KV capacity the mock advertises when --mock-kv-blocks is unset.
DEFAULT_KV_TOKENS = 1_048_576
_GUIDED_KEYS = ("json_schema", "regex", "ebnf", "structural_tag", "structured_outputs")


def _mix(x: int) -> int:
    """splitmix64's finaliser: a cheap bijective 64-bit scrambler."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


# A sequence's state is (CRC-32 << 32 | Adler-32) of its bytes: the seed as 8 bytes, then
# each token as 4, little-endian. Both checksums chain (zlib continues from a previous
# value), so the state is a pure function of the whole sequence however it is split between
# prompt and output, and a prompt of any length is one call in C rather than a Python step
# per token. The models scramble the state (`_mix`) before reading bits from it.
_M32 = 0xFFFFFFFF


def _chain(state: int, data: bytes) -> int:
    return zlib.crc32(data, state >> 32) << 32 | zlib.adler32(data, state & _M32)


def initial_state(seed: int) -> int:
    return _chain(0 << 32 | 1, (seed & _MASK).to_bytes(8, "little"))


def advance(state: int, token: int) -> int:
    return _chain(state, token.to_bytes(4, "little"))


def advance_all(state: int, ids: Sequence[int]) -> int:
    """`advance` over every token of `ids`, in one pass in C over the array's bytes."""
    return _chain(state, to_le_bytes(ids)) if ids else state


def prefill_ms(new_tokens: int) -> float:
    t = float(new_tokens)
    return 4.209989e-07 * t * t + 1.518344e-02 * t + 16.50142


def decode_step_ms(kv_fraction: float) -> float:
    p = min(max(kv_fraction, 0.0), 1.0)
    return max(1.0, -25.74 * p * p + 54.01 * p + 5.74)


@dataclass(frozen=True, slots=True)
class TokenModel:
    """The hash-defined "language model": candidates and logprobs at a state."""

    vocab_size: int

    def greedy_token(self, state: int) -> int:
        return _mix(state) % self.vocab_size

    def greedy_logprob(self, state: int) -> float:
        return round(-0.001 - ((_mix(state) >> 17) % 3000) / 1000.0, 6)

    def top(self, state: int, k: int) -> TopLogprobs:
        """The k best candidates, best first; the first is the greedy token."""
        best = self.greedy_logprob(state)
        out: TopLogprobs = [(self.greedy_token(state), best)]
        seen = {out[0][0]}
        j = 0
        while len(out) < min(k, self.vocab_size):
            j += 1
            h = _mix(state ^ (0xA5A5A5A5 + j))
            tid = h % self.vocab_size
            if tid in seen:
                continue
            seen.add(tid)
            rank = len(out)
            out.append((tid, round(best - 0.25 * rank - ((h >> 13) % 250) / 1000.0, 6)))
        return out

    def score(self, state: int, token: int) -> tuple[float, int]:
        """`token`'s logprob and 1-based rank at `state`, consistent with `top`."""
        if token == self.greedy_token(state):
            return self.greedy_logprob(state), 1
        for rank, (tid, lp) in enumerate(self.top(state, MAX_TOP_LOGPROBS), start=1):
            if tid == token:
                return lp, rank
        return self._below_top(state, token)

    def _below_top(self, state: int, token: int) -> tuple[float, int]:
        """The logprob and rank of a token outside the top MAX_TOP_LOGPROBS."""
        # Below every listed alternative, so top lists and token logprobs agree.
        h = _mix(state ^ token ^ 0x5BD1E995)
        tail = ((h >> 11) % 4000) / 1000.0
        logprob = round(self.greedy_logprob(state) - 0.25 * (MAX_TOP_LOGPROBS + 1) - tail, 6)
        rank = MAX_TOP_LOGPROBS + 1 + int(tail * 10)  # lower logprob, worse rank
        return logprob, min(rank, self.vocab_size)

    def logprob(self, state: int, token: int) -> float:
        return self.score(state, token)[0]

    def biased(self, state: int, bias: dict[int, float]) -> BiasedStep:
        """The candidates at `state` with `bias` added to their logits (logit_bias.py)."""
        top = self.top(state, MAX_TOP_LOGPROBS)
        listed = {t for t, _ in top}
        extra = {t: self._below_top(state, t)[0] for t in bias if t not in listed}
        return BiasedStep.at(top, extra, bias)


@dataclass(frozen=True, slots=True)
class ExpertModel:
    """Deterministic MoE routing: which experts each layer picks at a position."""

    layers: int
    top_k: int
    experts: int

    def row(self, state: int) -> list[int]:
        """layers x top_k distinct-per-layer expert ids, flattened, for the position whose
        forward pass left the sequence in `state`."""
        row: list[int] = []
        for layer in range(self.layers):
            picked: list[int] = []
            h = _mix(state ^ (0xE4E4 + layer))
            while len(picked) < min(self.top_k, self.experts):
                expert = h % self.experts
                if expert not in picked:
                    picked.append(expert)
                h = _mix(h)
            row += picked
        return row


# (name, value) pairs: immutable, so a frozen config can hold them as its default.
SamplingDefaults = tuple[tuple[str, float | int], ...]


def parse_sampling_defaults(text: str) -> SamplingDefaults:
    """`--mock-sampling-defaults`: a JSON object of generation-config names to numbers;
    anything else is refused, so a typo stops the command instead of vanishing."""
    obj = json.loads(text) if text.strip() else {}
    parsed = sampling_defaults(obj)
    if not isinstance(obj, dict) or parsed.keys() != obj.keys():
        names = ", ".join(sorted(SAMPLING_DEFAULT_KEYS))
        raise ValueError(f"expected a JSON object of numbers named {names}: {text}")
    return tuple(parsed.items())


def render_sampling_defaults(value: SamplingDefaults) -> str:
    return json.dumps(dict(value))


@dataclass(frozen=True, slots=True)
class MockConfig:
    """The mock engine's settings; the options of a worker's (and `up`'s) `--mock-*`."""

    model: str = option("genmesh-mock", flag="--mock-model", help="model name the mock serves")
    vocab_size: int = option(
        151_936, flag="--mock-vocab-size", parse=positive_int, help="mock vocabulary"
    )
    eos_token_id: int = option(151_645, flag="--mock-eos-token-id", help="mock EOS token id")
    max_model_len: int = option(
        32_768,
        flag="--mock-max-model-len",
        parse=positive_int,
        help="mock context length (prompt + output)",
    )
    # What the card's engine_info advertises besides the context length: the KV cache's
    # capacity and block size, and the defaults for unset sampling parameters (as a
    # model's generation config gives them, by generation-config name).
    block_size: int = option(
        16, flag="--mock-block-size", parse=positive_int, help="mock KV block (page) size"
    )
    # The one setting of the KV cache's size, in blocks as vLLM's is (`num_gpu_blocks`);
    # unset, the mock advertises 1,048,576 tokens whatever its block size.
    kv_blocks: int | None = option(
        None,
        flag="--mock-kv-blocks",
        parse=positive_int,
        help="blocks of a mock worker's KV cache (max_total_num_tokens = blocks x block size); "
        "giving it turns the prefix cache on; unset: 1048576 tokens' worth, cache off",
    )
    sampling_defaults: SamplingDefaults = option(
        (),
        flag="--mock-sampling-defaults",
        parse=parse_sampling_defaults,
        render=render_sampling_defaults,
        metavar="JSON",
        help="mock generation-config sampling defaults, e.g. '{\"temperature\": 0.6}'",
    )
    # 1.0 = the polynomial timing model in real time; 0 = no delay at all (a worker's
    # mock runs in real time unless told otherwise: services/worker/config.py).
    speedup: float = option(
        0.0,
        flag="--mock-speedup",
        parse=non_negative_float,
        help="mock engine speed-up over its timing model; 0 = instant",
    )
    # A paged prefix cache (engines/prefix_cache.py) that `cached_tokens` reports, a
    # flush empties and KV events announce (`kv_events`). Off by default: then what the
    # mock answers is a pure function of the request, whatever ran before on the worker.
    prefix_cache: bool = option(
        False,
        flag="--mock-prefix-cache",
        help="give the mock a prefix cache (reported as cached_tokens, published as KV "
        "events, emptied by a flush); --mock-kv-blocks turns it on too",
    )
    # Prefill/decode disaggregation (docs/disaggregation.md, "The mock's P/D"): what a
    # prompt's KV weighs, how fast it moves to the decode worker, how long a prefill keeps
    # it for its decode, how long a decode waits for it.
    kv_bytes_per_token: int = option(
        131_072,
        flag="--mock-kv-bytes-per-token",
        parse=positive_int,
        help="P/D: KV bytes per prompt token a mock prefill hands over (default: a "
        "Llama-3-8B fp16 token, 32 layers x 8 KV heads x 128 x K,V x 2 bytes)",
    )
    transfer_gbps: float = option(
        50.0,
        flag="--mock-transfer-gbps",
        parse=non_negative_float,
        help="P/D: KV transfer bandwidth in GB/s (default: one 400 Gb/s RDMA NIC), scaled "
        "by --mock-speedup; 0 = instant (still one NATS round trip)",
    )
    pd_handle_ttl_s: float = option(
        30.0,
        flag="--mock-pd-handle-ttl",
        parse=non_negative_float,
        help="P/D: seconds a mock prefill keeps a KV handle no decode has pulled "
        "(0: forgotten at once, so every decode fails: for tests)",
    )
    pd_transfer_timeout_s: float = option(
        10.0,
        flag="--mock-pd-transfer-timeout",
        parse=positive_float,
        help="P/D: seconds a mock decode waits for its prefill worker's answer to a KV pull",
    )
    # The shape of the routed-expert rows it reports.
    moe_layers: int = 4
    moe_top_k: int = 2
    moe_experts: int = 16

    @property
    def kv_capacity_blocks(self) -> int:
        return self.kv_blocks or max(DEFAULT_KV_TOKENS // self.block_size, 1)

    @property
    def caches_prefixes(self) -> bool:
        return self.prefix_cache or self.kv_blocks is not None


class MockEngine:
    name = "mock"

    def __init__(self, config: MockConfig | None = None) -> None:
        self.config = config or MockConfig()
        if self.config.vocab_size < 2:
            raise ValueError("vocab_size must be at least 2")
        if not 0 <= self.config.eos_token_id < self.config.vocab_size:
            raise ValueError("eos_token_id must lie inside the vocabulary")
        if self.config.speedup < 0:
            raise ValueError("speedup must be >= 0")
        if self.config.transfer_gbps < 0:
            raise ValueError("transfer_gbps must be >= 0")
        if not (self.config.pd_handle_ttl_s >= 0 and self.config.pd_transfer_timeout_s > 0):
            raise ValueError("pd_handle_ttl_s must be >= 0, pd_transfer_timeout_s > 0")
        self.model = TokenModel(self.config.vocab_size)
        self.experts = ExpertModel(
            self.config.moe_layers, self.config.moe_top_k, self.config.moe_experts
        )
        self._active_kv_tokens = 0
        self._kv_feed = KvEventFeed()
        self.cache = (
            BlockPool(
                self.config.kv_capacity_blocks,
                self.config.block_size,
                on_step=self._kv_feed.publish,
            )
            if self.config.caches_prefixes
            else None
        )
        # Every generation in progress (by envelope id), with the flag that aborts it.
        self._running: dict[str, asyncio.Event] = {}
        # P/D: the KV handles its prefills keep, and the mesh they travel over.
        self._handles = KvHandles(self.config.pd_handle_ttl_s)
        self._pd: _PdLink | None = None

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        if self._pd is not None:
            await unsubscribe_quietly(self._pd.kv_pull)
            self._pd = None
        self._handles.close()

    async def healthy(self) -> bool:
        return True

    async def abort(self, request_id: str) -> bool:
        """The generation stops before its next token with SGLang's abort finish."""
        flag = self._running.get(request_id)
        if flag is None:
            return False
        flag.set()
        return True

    async def flush_cache(self) -> None:
        """Empty the prefix cache; refused while requests run, as SGLang refuses (a
        prefill's KV held for its decode counts: SGLang's `Scheduler.is_fully_idle`,
        which its flush requires, counts the disaggregation queues too,
        python/sglang/srt/managers/scheduler.py)."""
        pending = len(self._running) + len(self._handles)
        if pending:
            raise MeshError(
                ErrorCode.UNAVAILABLE,
                f"Cache not flushed because there are pending requests (#running-req: {pending})",
            )
        if self.cache is not None:
            self.cache.clear()

    def kv_events(self) -> AsyncIterator[KvEventBatch] | None:
        """The cache's events as vLLM publishes them with --kv-events-config: one batch
        per step (kv_feed.py); None without a cache."""
        return self._kv_feed.subscribe() if self.cache is not None else None

    def kv_usage(self) -> KvUsage:
        """The blocks its running requests hold out of all: with the cache, the pool's
        held blocks, a prefix running requests share counted once (vLLM's
        `BlockPool.get_usage`); without it, every running request's tokens (prompt and
        output so far) in blocks. Cached blocks nothing running holds are free."""
        if self.cache is not None:
            return KvUsage(self.cache.held_blocks, self.cache.num_blocks)
        size, total = self.config.block_size, self.config.kv_capacity_blocks
        return KvUsage(min(-(-self._active_kv_tokens // size), total), total)

    def describe(self) -> dict[str, Any]:
        c = self.config
        return {
            "model": c.model,
            "formats": ["*"],
            "vocab_size": c.vocab_size,
            "eos_token_id": c.eos_token_id,
            "max_model_len": c.max_model_len,
            "engine_info": EngineInfo(
                model=c.model,
                context_length=c.max_model_len,
                max_total_num_tokens=c.kv_capacity_blocks * c.block_size,
                block_size=c.block_size,
                sampling_defaults=dict(c.sampling_defaults),
                engine_version=f"genmesh-mock-{__version__}",
                vocab_size=c.vocab_size,
                max_logprobs=MAX_TOP_LOGPROBS,
            ).to_wire(),
            "speedup": c.speedup,
            "moe": {"layers": c.moe_layers, "top_k": c.moe_top_k, "experts": c.moe_experts},
        }

    def _check(self, env: Envelope) -> int:
        """Refuse what the mock cannot do; return the token budget."""
        c = self.config
        prompt_len = len(env.token_ids)
        if prompt_len >= c.max_model_len:
            raise MeshError(
                ErrorCode.INVALID_ARGUMENT,
                f"The input ({prompt_len} tokens) is longer than the model's context length "
                f"({c.max_model_len} tokens).",
            )
        # In C first (`all_below`): a Python loop over a 32k prompt costs milliseconds.
        if not all_below(env.token_ids, c.vocab_size):
            i, tid = next((i, t) for i, t in enumerate(env.token_ids) if t >= c.vocab_size)
            raise MeshError(
                ErrorCode.INVALID_ARGUMENT,
                f"token id {tid} at position {i} is outside the vocabulary (size {c.vocab_size})",
            )
        native_sampling = env.engine.get("sampling_params")
        if isinstance(native_sampling, dict):
            for key in _GUIDED_KEYS:
                if native_sampling.get(key) is not None:
                    raise MeshError(
                        ErrorCode.INVALID_ARGUMENT,
                        f"the mock engine cannot do guided decoding ({key})",
                    )
        try:
            # No vision model: items only key the prefix cache, but a layout vLLM refuses
            # is refused in its words.
            envelope_items(env)
        except FeaturesError as exc:
            raise MeshError(ErrorCode.INVALID_ARGUMENT, str(exc)) from None
        lora = env.engine.get("lora_path")
        if lora is not None:
            raise MeshError(
                ErrorCode.INVALID_ARGUMENT,
                f"the mock engine serves no LoRA adapters; unknown lora_path {lora!r}",
            )
        for tid in env.output.logprob_token_ids or ():
            if tid >= c.vocab_size:
                raise MeshError(
                    ErrorCode.INVALID_ARGUMENT,
                    f"token_ids_logprob contains out-of-vocabulary token id {tid}; "
                    f"valid range is [0, {c.vocab_size}).",
                )
        if env.output.top_logprobs > MAX_TOP_LOGPROBS:
            raise MeshError(ErrorCode.INVALID_ARGUMENT, self._too_many_logprobs(env))
        room = c.max_model_len - prompt_len
        budget = env.sampling.max_tokens
        return room if budget is None else min(budget, room)

    def _too_many_logprobs(self, env: Envelope) -> str:
        """The refusal of more top logprobs than the mock has: vLLM's words (its
        `SamplingParams._validate_logprobs`, max_logprobs = 20) for a vLLM-format request,
        whose frontend did not catch it because it did not know the limit."""
        sp = env.engine.get("sampling_params") if env.format == "vllm" else None
        if isinstance(sp, dict):
            for kind, name in (("sample", "logprobs"), ("prompt", "prompt_logprobs")):
                count = sp.get(name)
                if count == -1:
                    count = self.config.vocab_size
                if isinstance(count, int) and count > MAX_TOP_LOGPROBS:
                    return (
                        f"Requested {kind} logprobs of {count}, which is greater than max "
                        f"allowed: {MAX_TOP_LOGPROBS} (parameter={name}, value={count})"
                    )
        return (
            f"at most {MAX_TOP_LOGPROBS} top logprobs per position, "
            f"asked for {env.output.top_logprobs}"
        )

    async def _sleep_ms(self, ms: float) -> None:
        if self.config.speedup > 0:
            await asyncio.sleep(ms / self.config.speedup / 1000.0)
        else:
            # Instant, but still a scheduling point: cancellation lands between tokens.
            await asyncio.sleep(0)

    def generate(self, env: Envelope) -> AsyncGenerator[EngineOutput, None]:
        return self._generation(env, self._prefill)

    def _prompt_pass(self, env: Envelope) -> tuple[EngineOutput, int]:
        """The prompt through the token model: the first output with what it reports of
        the prompt (logprobs and routing rows, as asked), and the state after it."""
        model = self.model
        prompt = env.token_ids
        k = env.output.top_logprobs
        start = env.output.prompt_logprobs_start
        experts_from = env.output.routed_experts_start
        # The listed token IDs' logprobs at a position: SGLang's token_ids_logprob.
        listed = env.output.logprob_token_ids
        state = initial_state(env.sampling.seed or 0)
        prompt_lps: list[float | None] = []
        prompt_ranks: list[int | None] = []
        prompt_tops: list[TopLogprobs | None] = []
        prompt_listed: list[TopLogprobs | None] = []
        rows: list[list[int]] = []
        # Only positions whose logprobs or routing rows are asked for are walked in Python.
        walk_from = min(
            len(prompt) if start is None else start,
            len(prompt) if experts_from is None else experts_from,
        )
        state = advance_all(state, prompt[:walk_from])
        for i, tid in enumerate(prompt[walk_from:], start=walk_from):
            if start is not None and i >= start:
                # SGLang's shift: the first requested position has no logprob.
                lp, rank = (None, None) if i == start else model.score(state, tid)
                prompt_lps.append(lp)
                prompt_ranks.append(rank)
                prompt_tops.append(model.top(state, k) if k and i > start else None)
                prompt_listed.append(
                    [(t, model.logprob(state, t)) for t in listed] if listed and i > start else None
                )
            state = advance(state, tid)
            if experts_from is not None and i >= experts_from:
                rows.append(self.experts.row(state))
        first = EngineOutput(tokens=[])
        if start is not None:
            first.prompt_logprobs = prompt_lps
            first.prompt_ranks = prompt_ranks
            first.prompt_top_logprobs = prompt_tops if k else None
            first.prompt_token_ids_logprobs = prompt_listed if listed else None
        if experts_from is not None:
            first.routed_experts = rows
        return first, state

    async def _prefill(self, env: Envelope, run: _Run) -> tuple[EngineOutput, int]:
        """The prompt's pass and its forward pass's time (from the tokens not found
        cached): the first output and the state, as `_generation`'s `begin`."""
        first, state = self._prompt_pass(env)
        if self.config.speedup > 0:
            # (An instant prefill is no scheduling point: the first token comes in the
            # request's first step, and goes out with the worker's ack.)
            await self._sleep_ms(prefill_ms(run.prompt_tokens - run.cached))
        if run.blocks is not None:
            run.blocks.prefilled()
        first.cached_tokens = run.cached
        return first, state

    async def _generation(
        self,
        env: Envelope,
        begin: Callable[[Envelope, _Run], Awaitable[tuple[EngineOutput, int]]],
    ) -> AsyncGenerator[EngineOutput, None]:
        """One generation: refused before any output if it must be, brought to the end of
        its prompt by `begin` (which gives the first output, with what it reports of the
        prompt, and the token model's state there: `_prefill` runs the prompt, a decode
        pulls it), then sampled token by token."""
        budget = self._check(env)
        # A bad logit_bias is refused here, before any output.
        bias = read_logit_bias(env.format, env.engine, self.config.vocab_size)
        run = _Run(self, env, budget)
        # Output tokens in the KV accounting (`kv_usage` without a cache) until the end.
        made = 0
        try:
            first, state = await begin(env, run)
            if budget == 0:
                yield _ends_after_prompt(first, run.prompt_tokens)
                return
            model = self.model
            prompt_len = run.prompt_tokens
            cached = first.cached_tokens or 0
            want_lp = env.output.logprobs
            k = env.output.top_logprobs
            experts_from = env.output.routed_experts_start
            listed = env.output.logprob_token_ids
            blocks = run.blocks
            # logit_bias changes the greedy pick; what logprobs show depends on the engine
            # the format speaks: SGLang's are after the bias, vLLM's before (logit_bias.py).
            biased_logprobs = bias is not None and env.format in BIASED_LOGPROB_FORMATS

            def listed_at(at: int, step: BiasedStep | None) -> TopLogprobs:
                if step is not None and bias is not None:
                    return [
                        (tid, step.logprob(model.logprob(at, tid) + bias.get(tid, 0.0)))
                        for tid in listed or ()
                    ]
                return [(tid, model.logprob(at, tid)) for tid in listed or ()]

            stops = set(env.sampling.stop_token_ids)
            eos = self.config.eos_token_id
            ignore_eos = env.sampling.ignore_eos
            banned = stops if ignore_eos else stops | {eos}
            min_tokens = env.sampling.min_tokens
            # The output in the making: `first`, then one per chunk. At speed-up 0 the
            # mock produces MOCK_CHUNK_TOKENS tokens per scheduling point and yields them
            # as one output (a loop round trip per token would dominate its cost); the
            # first token goes alone, as after a prefill. Otherwise one token per step.
            chunk = MOCK_CHUNK_TOKENS if self.config.speedup == 0 else 1
            out = first
            for n in range(budget):
                if n and (n - 1) % chunk == 0:
                    if out.tokens:
                        if blocks is not None:
                            blocks.extend(out.tokens)
                        yield out
                        out = EngineOutput(tokens=[])
                    # What slows a step: the share of the cache in use (Dynamo's
                    # mocker, lib/mocker scheduler `simulate_decode`: its active blocks
                    # over its capacity).
                    held = self.kv_usage()
                    await self._sleep_ms(decode_step_ms(held.used_blocks / held.total_blocks))
                if run.aborted.is_set():
                    # SGLang's finish for a request /abort_request stopped while running.
                    out.finish = {"reason": "abort", "message": "Aborted"}
                    out.usage = usage(prompt_len, n, cached)
                    if blocks is not None:
                        blocks.extend(out.tokens)
                    yield out
                    return
                step: BiasedStep | None = None
                if bias is None and not want_lp and n >= min_tokens:
                    # Only the token is wanted: the greedy one, as `top` would rank it
                    # first, without its logprob and list (a third of the cost per token).
                    token = model.greedy_token(state)
                else:
                    if bias is None:
                        candidates = model.top(state, MAX_TOP_LOGPROBS if n < min_tokens else 1)
                    else:
                        step = model.biased(state, bias)
                        # Best biased logit first; each carries its raw logprob (vLLM's).
                        candidates = [(t, lp) for t, lp, _ in step.ranked]
                    token, logprob = candidates[0]
                    if n < min_tokens and token in banned:
                        # Masked as a real engine masks stop logits: the best allowed one.
                        token, logprob = next(
                            ((t, lp) for t, lp in candidates if t not in banned), candidates[0]
                        )
                shown = step if biased_logprobs else None
                if not out.tokens:
                    # The chunk's first token: its per-token lists start here.
                    lps: list[float] = []
                    ranks: list[int] = []
                    tops: list[TopLogprobs] = []
                    listed_rows: list[TopLogprobs] = []
                    expert_rows: list[list[int]] = out.routed_experts or []
                    if want_lp:
                        out.logprobs, out.ranks = lps, ranks
                    if k:
                        out.top_logprobs = tops
                    if listed:
                        out.token_ids_logprobs = listed_rows
                    if experts_from is not None:
                        out.routed_experts = expert_rows
                out.tokens.append(token)
                if want_lp:
                    if shown is not None and bias is not None:
                        logprob = shown.logprob(logprob + bias.get(token, 0.0))
                    lps.append(logprob)
                    ranks.append(model.score(state, token)[1])
                if k:
                    tops.append(shown.top(k) if shown else model.top(state, k))
                if listed:
                    listed_rows.append(listed_at(state, shown))
                if experts_from is not None and n:
                    # The previous token's forward pass; the last token never gets one.
                    expert_rows.append(self.experts.row(state))
                state = advance(state, token)
                self._active_kv_tokens += 1
                made += 1
                finish: Finish | None = None
                if n >= min_tokens and token == eos and not ignore_eos:
                    finish = {"reason": "eos", "matched": token}
                elif n >= min_tokens and token in stops:
                    finish = {"reason": "stop", "matched": token}
                elif n + 1 == budget:
                    finish = {"reason": "length"}
                if finish is not None:
                    out.finish = finish
                    out.usage = usage(prompt_len, n + 1, cached)
                    if blocks is not None:
                        blocks.extend(out.tokens)
                    yield out
                    return
        finally:
            self._active_kv_tokens -= made
            run.end()

    # -- prefill/decode disaggregation (docs/disaggregation.md, "The mock's P/D") -------

    pd_kind = "mock"
    # The decode half starts once the prefill has handed its KV handle over.
    pd_concurrent = False

    async def pd_attach(
        self, nc: Client, subjects: Subjects, worker_id: str, micro: MicroService | None = None
    ) -> None:
        """Serve this engine's KV handles on its worker's kv_pull subject (an endpoint of
        the worker's `micro`), and pull from other workers' (until `close`)."""
        if self._pd is not None:
            raise RuntimeError("the mock is attached to a mesh already")
        endpoint = MicroEndpoint("kv_pull", subjects.worker_kv_pull(worker_id))
        if micro is not None:
            micro.add(endpoint)
        sub = await serve_kv_pull(nc, endpoint.subject, self._handles, endpoint)
        self._pd = _PdLink(nc, subjects, worker_id, sub)

    def pd_card(self) -> dict[str, Any]:
        # `handles`: the KV handles held now (what a test reads to find leaks).
        return {"local_prefill": True, "handles": len(self._handles)}

    def pd_ticket(self, envelope: Envelope, prefill: dict[str, Any]) -> dict[str, Any]:
        return {}

    async def prefill(
        self, env: Envelope, ticket: dict[str, Any]
    ) -> AsyncGenerator[EngineOutput, None]:
        """The prompt run as `generate` runs it, ending after the prompt with a KV handle
        for the decode half (none with a budget of 0: that answer is complete)."""
        budget = self._check(env)
        read_logit_bias(env.format, env.engine, self.config.vocab_size)
        link = self._link() if budget else None
        run = _Run(self, env, budget)
        try:
            first, state = await self._prefill(env, run)
            if link is not None:
                if run.aborted.is_set():
                    # An aborted prefill has no KV to hand over: its decode must not start.
                    raise MeshError(ErrorCode.UNAVAILABLE, "the prefill was aborted")
                tokens = run.prompt_tokens
                payload = {
                    "prompt": _prompt_digest(env),
                    "state": state,
                    "cached_tokens": run.cached,
                    "bytes": tokens * self.config.kv_bytes_per_token,
                }
                handle = self._handles.keep(payload, run.hand_over())
                first.handoff = {
                    "worker": link.worker_id,
                    "handle": handle,
                    "bytes": payload["bytes"],
                }
            yield _ends_after_prompt(first, run.prompt_tokens)
        finally:
            run.end()

    def decode(
        self, env: Envelope, ticket: dict[str, Any], handoff: dict[str, Any] | None
    ) -> AsyncGenerator[EngineOutput, None]:
        """What `generate` gives after the prompt, from the state the prefill's KV handle
        holds, pulled from its worker (`MeshError` unavailable when that fails)."""
        return self._generation(env, functools.partial(self._pulled, handoff))

    async def _pulled(
        self, handoff: dict[str, Any] | None, env: Envelope, run: _Run
    ) -> tuple[EngineOutput, int]:
        """A decode's `begin`: the prompt's KV pulled from the prefill's worker, after the
        time its bytes take over the link. Dynamo's mocker times a P/D handoff so too:
        bytes per token x the whole prompt / bandwidth (lib/mocker/src/common/handoff.rs,
        `HandoffTransferTiming`; 1.6.1's `--kv-bytes-per-token`, `--kv-transfer-bandwidth`
        in GB/s and its default `--kv-transfer-timing-mode full_prompt`, dynamo/mocker/args.py)."""
        link = self._link()
        worker, handle = _handle_of(handoff)
        payload = await self._pull(link, worker, handle, env)
        if self.config.transfer_gbps > 0:
            await self._sleep_ms(payload.bytes / self.config.transfer_gbps / 1e6)
        if run.blocks is not None:
            # The transferred blocks are computed here now, and cached as a prefill's.
            run.blocks.prefilled()
        return EngineOutput(tokens=[], cached_tokens=payload.cached_tokens), payload.state

    def _link(self) -> _PdLink:
        if self._pd is None:
            raise MeshError(
                ErrorCode.INTERNAL, "the mock takes part in P/D only on a prefill or decode worker"
            )
        return self._pd

    async def _pull(self, link: _PdLink, worker: str, handle: str, env: Envelope) -> _Payload:
        subject = link.subjects.worker_kv_pull(worker)
        try:
            answer = await pull_kv(link.nc, subject, handle, self.config.pd_transfer_timeout_s)
            payload = _Payload.read(answer)
            if payload.prompt != _prompt_digest(env):
                raise TransferFailed(f"KV handle {handle!r} holds another prompt's KV")
        except TransferFailed as exc:
            raise MeshError(
                ErrorCode.UNAVAILABLE, f"KV transfer failed: {exc} (prefill worker {worker})"
            ) from None
        return payload


def _ends_after_prompt(first: EngineOutput, prompt_tokens: int) -> EngineOutput:
    """`first` as the last output of a generation that stops after its prompt."""
    first.finish = {"reason": "length"}
    first.usage = usage(prompt_tokens, 0, first.cached_tokens or 0)
    return first


class _Run:
    """One request's hold on the engine, from its admission to its `end`: the flag that
    aborts it, its prompt in the KV accounting (`kv_usage` without a cache), and its blocks
    in the prefix cache. A prefill hands its KV over to a handle (`hand_over`) that
    outlives it."""

    __slots__ = ("_engine", "_id", "_kv", "aborted", "blocks", "cached", "prompt_tokens")

    def __init__(self, engine: MockEngine, env: Envelope, budget: int) -> None:
        self._engine = engine
        self._id = env.id
        self.prompt_tokens = len(env.token_ids)
        self.blocks: RequestBlocks | None = None
        if engine.cache is not None:
            # Keys for every block the sequence may fill: an item in the prompt's last
            # partial block keys the block its output completes too.
            extra = request_extra_keys(env, engine.config.block_size, self.prompt_tokens + budget)
            self.blocks = engine.cache.open(env.token_ids, extra)
        self.cached = self.blocks.cached_tokens if self.blocks is not None else 0
        self.aborted = engine._running.setdefault(env.id, asyncio.Event())
        self._kv = self.prompt_tokens
        engine._active_kv_tokens += self._kv

    def hand_over(self) -> Callable[[], None]:
        """Keep the request's KV past its end; the call returned frees it."""
        engine, kv, blocks = self._engine, self._kv, self.blocks
        self._kv, self.blocks = 0, None

        def free() -> None:
            engine._active_kv_tokens -= kv
            if blocks is not None:
                blocks.release()

        return free

    def end(self) -> None:
        engine = self._engine
        engine._active_kv_tokens -= self._kv
        self._kv = 0
        if engine._running.get(self._id) is self.aborted:
            del engine._running[self._id]
        if self.blocks is not None:
            # What it cached stays cached, free to be evicted.
            self.blocks.release()
            self.blocks = None


@dataclass(frozen=True, slots=True)
class _PdLink:
    """The mesh a P/D mock is attached to (`pd_attach`)."""

    nc: Client
    subjects: Subjects
    worker_id: str
    kv_pull: Subscription


@dataclass(frozen=True, slots=True)
class _Payload:
    """What a KV handle carries to the decode: the token model's state after the prompt
    (all the decode needs to continue exactly), a digest of the prompt it was made for,
    the prefill's cached tokens, and the KV's size in bytes."""

    prompt: str
    state: int
    cached_tokens: int
    bytes: int

    @classmethod
    def read(cls, answer: dict[str, Any]) -> _Payload:
        prompt, state, cached, size = (
            answer.get(name) for name in ("prompt", "state", "cached_tokens", "bytes")
        )
        if (
            isinstance(prompt, str)
            and isinstance(state, int)
            and isinstance(cached, int)
            and isinstance(size, int)
            and min(state, cached, size) >= 0
        ):
            return cls(prompt, state, cached, size)
        raise TransferFailed(f"an unreadable answer: {answer!r}")


def _prompt_digest(env: Envelope) -> str:
    """What a KV handle was made for: the seed and the prompt (the state's inputs)."""
    seed = ((env.sampling.seed or 0) & _MASK).to_bytes(8, "little")
    return xxhash.xxh3_128_hexdigest(seed + to_le_bytes(env.token_ids))


def _handle_of(handoff: dict[str, Any] | None) -> tuple[str, str]:
    """The prefill worker and handle a handoff names."""
    worker = handoff.get("worker") if handoff else None
    handle = handoff.get("handle") if handoff else None
    # (A worker id is one subject token: never a wildcard to publish the pull to.)
    if not (isinstance(worker, str) and is_subject_token(worker) and isinstance(handle, str)):
        raise MeshError(
            ErrorCode.UNAVAILABLE, f"KV transfer failed: no KV handle in the handoff {handoff!r}"
        )
    return worker, handle

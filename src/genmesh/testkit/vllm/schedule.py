"""The mock vLLM engine: its running requests (admission, aborts by id) and the run of
one accepted generate request, from its first decode step to its last byte.

Faults (`genmesh.testkit.common`), consulted once per generate request that passed
validation, fire after `after_tokens` decode steps (if the generation lasts that long):
`http_error` answers `status` with vLLM's error envelope (with `after_tokens > 0`: a stream
gets an in-band error event + `[DONE]`, a unary request the error status after generating);
`abort` finishes with `finish_reason: "abort"` (vLLM's abort carries no status or message,
so `status`/`message` are unused); `drop` aborts the TCP connection; `no_terminal` ends a
stream without terminal chunk and `[DONE]`; `done_early` sends `[DONE]` without terminal
chunk; `hang` stops sending until the client goes away or the request is aborted (then it
finishes with "abort"). For a unary request `no_terminal` and `done_early` both answer 200
with a JSON body cut short.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from genmesh.engines.faults import Fault, Running, ServerState
from genmesh.engines.mock import TokenModel
from genmesh.engines.prefix_cache import RequestBlocks
from genmesh.shared.kv_events import block_extra_keys
from genmesh.shared.tasks import wait_event
from genmesh.testkit.config import MockServerConfig
from genmesh.testkit.kv_cache import ServerCache
from genmesh.testkit.pd import Handles
from genmesh.testkit.vllm import pd
from genmesh.testkit.vllm.decode import Sample, prompt_state
from genmesh.testkit.vllm.errors import error_body
from genmesh.testkit.vllm.request import ENGINE_ID_PREFIX, GenerateOptions, budget
from genmesh.testkit.vllm.response import (
    chunk,
    dumps,
    json_response,
    prompt_logprobs,
    unary_body,
    usage_chunk,
    usage_counts,
)

KV_BLOCK_SIZE = 16
NIXL_SIDE_CHANNEL_PORT = 5600


@dataclass(slots=True)
class Engine:
    """The mock vLLM engine: what outlives one request."""

    config: MockServerConfig
    profile: str
    state: ServerState
    # The engine id of each running request, by its key in `state.running`.
    engine_ids: dict[str, str] = field(default_factory=dict)
    # The NIXL identity and the next free KV block a P/D prefill hands out.
    engine_uuid: str = field(default_factory=lambda: str(uuid.uuid4()))
    next_block: int = 0
    # The prefix cache, with --kv-events-config.
    cache: ServerCache | None = None
    # P/D (--disaggregation-mode prefill): the KV blocks kept for decode servers.
    handles: Handles | None = None

    def admit(self, engine_id: str) -> tuple[str, Running]:
        """Start a request under a key of its own: vLLM tells duplicate ids apart
        internally."""
        key = engine_id
        suffix = 0
        while key in self.state.running:
            suffix += 1
            key = f"{engine_id}#{suffix}"
        running = self.state.start(key)
        self.engine_ids[key] = engine_id
        return key, running

    def release(self, key: str, running: Running, *, completed: bool) -> None:
        self.engine_ids.pop(key, None)
        self.state.finish(running, completed=completed)

    def abort(self, wanted: set[str]) -> None:
        """Abort the running requests with these ids: vLLM knows requests by their engine
        id; the bare id is accepted too."""

        def matches(key: str) -> bool:
            engine_id = self.engine_ids.get(key)
            if engine_id is None or self.state.running[key].aborted.is_set():
                return False
            return engine_id in wanted or engine_id.removeprefix(ENGINE_ID_PREFIX) in wanted

        self.state.abort_matching(matches)


class ClientGone(Exception):
    """The client closed the connection."""


@dataclass
class Run:
    """One accepted generate request, from its first decode step to its last byte."""

    request: web.Request
    options: GenerateOptions
    engine: Engine
    running: Running
    fault: Fault | None
    key: str
    samples: list[Sample] = field(default_factory=list)
    # Each sample's cache blocks while it runs (with a cache).
    blocks: list[RequestBlocks] = field(default_factory=list)
    response: web.StreamResponse | None = None
    fault_abort: bool = False
    dropped: bool = False
    completed: bool = False

    async def execute(self) -> web.StreamResponse:
        self._start_samples()
        cache = self.engine.cache
        if cache is not None:
            opts = self.options
            # vLLM's generate_block_hash_extra_keys, over every block the run can fill.
            length = len(opts.prompt) + max(s.budget for s in self.samples)
            extra = block_extra_keys(opts.mm_items, opts.cache_salt, cache.pool.block_size, length)
            self.blocks = [cache.open(opts.prompt, extra) for _ in self.samples]
        self.running.waiting = False
        if self.options.stream:
            self.response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream; charset=utf-8"}
            )
            await self.response.prepare(self.request)
        ended = await self._decode()
        if ended is not None:
            return ended
        self.completed = all(s.finish_reason in ("stop", "length") for s in self.samples)
        if self.response is None:
            return json_response(self.body())
        if self.options.include_usage:
            await self.write(usage_chunk(self.options, self.usage()))
        await self.write("[DONE]")
        await self.response.write_eof()
        return self.response

    def _start_samples(self) -> None:
        """One sample per choice, the `i`th seeded with seed + i."""
        opts, config = self.options, self.engine.config
        sampling = opts.sampling
        model = TokenModel(config.vocab_size)
        limit = budget(opts, config, self.engine.profile)
        for index in range(sampling.n):
            seed = sampling.seed if sampling.seed is None else sampling.seed + index
            self.samples.append(
                Sample(
                    model=model,
                    state=prompt_state(model, seed, opts.prompt),
                    budget=limit,
                    min_tokens=sampling.min_tokens,
                    stops=frozenset(sampling.stop_token_ids),
                    eos=config.eos_token_id,
                    ignore_eos=sampling.ignore_eos,
                    top_k=sampling.logprobs or 0,
                    index=index,
                )
            )

    async def _decode(self) -> web.StreamResponse | None:
        """Decode steps until every sample has finished (None), or a fault ends the
        request early (its response)."""
        steps = 0
        while True:
            live = [s for s in self.samples if s.finish_reason is None]
            if not live:
                return None
            if self.fault is not None and steps >= self.fault.after_tokens:
                fault, self.fault = self.fault, None
                ended = await self.apply_fault(fault)
                if ended is not None:
                    return ended
            if not self.aborted():
                await self.pause()
            if self.aborted():
                await self._abort(live)
                return None
            if not steps:  # the prefill has run: its full blocks are cached
                for blocks in self.blocks:
                    blocks.prefilled()
            for sample in live:
                step = sample.step()
                if self.blocks:
                    self.blocks[sample.index].extend([step.token])
                if self.options.stream:
                    await self.write(chunk(self.options, self.engine.profile, sample, step))
            steps += 1

    async def _abort(self, live: list[Sample]) -> None:
        """Every live sample finishes with "abort"; a stream sends each one's terminal
        chunk."""
        for sample in live:
            sample.finish_reason = "abort"
            if self.options.stream:
                await self.write(chunk(self.options, self.engine.profile, sample, None))

    def release_blocks(self) -> None:
        """The request ended: its cache blocks are free (what it cached stays cached)."""
        for blocks in self.blocks:
            blocks.release()
        self.blocks = []

    def aborted(self) -> bool:
        return self.fault_abort or self.running.aborted.is_set()

    def usage(self) -> dict[str, Any]:
        counts = usage_counts(len(self.options.prompt), sum(len(s.tokens) for s in self.samples))
        cached = self.blocks[0].cached_tokens if self.blocks else 0
        if self.engine.config.enable_prompt_tokens_details and cached:
            counts["prompt_tokens_details"] = {"cached_tokens": cached}
        return counts

    def check_connection(self) -> None:
        transport = self.request.transport
        if transport is None or transport.is_closing():
            raise ClientGone

    async def pause(self) -> None:
        """One decode step's time (`state.token_delay_s`, re-read while waiting, so
        `/testkit/config` changes running requests at once); wakes early on abort."""
        started = time.monotonic()
        await asyncio.sleep(0)
        while not self.running.aborted.is_set():
            remaining = started + self.engine.state.token_delay_s - time.monotonic()
            if remaining <= 0:
                break
            if not await wait_event(self.running.aborted, min(remaining, 0.05)):
                self.check_connection()
        self.check_connection()

    async def write(self, payload: Any) -> None:
        assert self.response is not None
        data = payload if isinstance(payload, str) else dumps(payload)
        try:
            await self.response.write(f"data: {data}\n\n".encode())
        except ConnectionResetError:
            raise ClientGone from None

    def body(self) -> dict[str, Any]:
        """The unary reply."""
        opts = self.options
        plp = None
        if opts.sampling.prompt_logprobs is not None:
            model = TokenModel(self.engine.config.vocab_size)
            plp = prompt_logprobs(
                model, opts.sampling.seed, opts.prompt, opts.sampling.prompt_logprobs
            )
        return unary_body(
            opts,
            self.engine.profile,
            model=self.engine.config.model,
            samples=self.samples,
            counts=self.usage(),
            prompt_lps=plp,
            kv_transfer_params=self.kv_transfer_out(),
        )

    def kv_transfer_out(self) -> dict[str, Any] | None:
        """A P/D prefill's reply (NIXL connector `request_finished`): only for a request
        sent with `do_remote_decode` that finished length-capped."""
        params = self.options.kv_transfer_params
        if not params or not params.get("do_remote_decode"):
            return None
        if any(s.finish_reason != "length" for s in self.samples):
            return None
        # Full blocks only: the decode side recomputes a partial last block.
        count = len(self.options.prompt) // KV_BLOCK_SIZE
        start = self.engine.next_block
        self.engine.next_block = start + count
        transport = self.request.transport
        sockname = transport.get_extra_info("sockname") if transport is not None else None
        host = sockname[0] if isinstance(sockname, tuple) else "127.0.0.1"
        handles = self.engine.handles
        # A P/D prefill mock's side channel is its own HTTP port (testkit/pd.py).
        port = sockname[1] if handles is not None and sockname else NIXL_SIDE_CHANNEL_PORT
        out = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(range(start, start + count))],
            "remote_engine_id": self.engine.engine_uuid,
            "remote_request_id": self.options.engine_id,
            "remote_host": host,
            "remote_port": port,
            "tp_size": 1,
        }
        if handles is not None:
            pd.offer(handles, out)
        return out

    async def apply_fault(self, fault: Fault) -> web.StreamResponse | None:
        """Act out an injected fault; a response ends the request, None carries on."""
        stream = self.response is not None
        if fault.kind == "abort":
            self.fault_abort = True
            return None
        if fault.kind == "hang":
            while not self.running.aborted.is_set():
                if not await wait_event(self.running.aborted, 0.05):
                    self.check_connection()
            return None
        if fault.kind == "http_error":
            if not stream:
                return json_response(error_body(fault.message, fault.status), fault.status)
            await self.write(error_body(fault.message, fault.status))
            await self.write("[DONE]")
            assert self.response is not None
            await self.response.write_eof()
            return self.response
        if fault.kind == "drop":
            transport = self.request.transport
            if transport is not None:
                transport.abort()
            self.dropped = True
            return self.response if self.response is not None else web.Response()
        # no_terminal, done_early
        if not stream:
            text = dumps(self.body())
            return web.Response(
                text=text[: len(text) // 2], status=200, content_type="application/json"
            )
        assert self.response is not None
        if fault.kind == "done_early":
            await self.write("[DONE]")
        await self.response.write_eof()
        return self.response

"""One accepted generate request in the mock vLLM server, from first decode step to last byte.

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
from genmesh.shared.tasks import wait_event
from genmesh.testkit.common import MockServerConfig
from genmesh.testkit.vllm.decode import Sample, Step, prompt_state
from genmesh.testkit.vllm.request import GenerateOptions, budget
from genmesh.testkit.vllm.response import (
    dumps,
    error_body,
    json_response,
    logprob_content,
    prompt_logprobs,
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
    response: web.StreamResponse | None = None
    fault_abort: bool = False
    dropped: bool = False
    completed: bool = False

    @property
    def k(self) -> int:
        return self.options.sampling.logprobs or 0

    def aborted(self) -> bool:
        return self.fault_abort or self.running.aborted.is_set()

    def completion_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.samples)

    def usage(self, completion: int | None = None) -> dict[str, Any]:
        prompt = len(self.options.prompt)
        done = self.completion_tokens() if completion is None else completion
        return {"prompt_tokens": prompt, "total_tokens": prompt + done, "completion_tokens": done}

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

    async def execute(self) -> web.StreamResponse:
        opts = self.options
        model = TokenModel(self.engine.config.vocab_size)
        limit = budget(opts, self.engine.config, self.engine.profile)
        for index in range(opts.sampling.n):
            seed = opts.sampling.seed if opts.sampling.seed is None else opts.sampling.seed + index
            self.samples.append(
                Sample(
                    model=model,
                    state=prompt_state(model, seed, opts.prompt),
                    budget=limit,
                    min_tokens=opts.sampling.min_tokens,
                    stops=frozenset(opts.sampling.stop_token_ids),
                    eos=self.engine.config.eos_token_id,
                    ignore_eos=opts.sampling.ignore_eos,
                    top_k=self.k,
                    index=index,
                )
            )
        self.running.waiting = False
        if opts.stream:
            self.response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream; charset=utf-8"}
            )
            await self.response.prepare(self.request)

        steps = 0
        while True:
            live = [s for s in self.samples if s.finish_reason is None]
            if not live:
                break
            if self.fault is not None and steps >= self.fault.after_tokens:
                fault, self.fault = self.fault, None
                done = await self.apply_fault(fault)
                if done is not None:
                    return done
            if not self.aborted():
                await self.pause()
            if self.aborted():
                for sample in live:
                    sample.finish_reason = "abort"
                    if opts.stream:
                        await self.write(self.chunk(sample, None))
                break
            for sample in live:
                step = sample.step()
                if opts.stream:
                    await self.write(self.chunk(sample, step))
            steps += 1
        self.completed = all(s.finish_reason in ("stop", "length") for s in self.samples)
        if self.response is not None:
            if opts.include_usage:
                await self.write(
                    {
                        "request_id": opts.engine_id,
                        "usage": self.usage(),
                        "output_mode": "tokens",
                        "choices": [],
                    }
                )
            await self.write("[DONE]")
            await self.response.write_eof()
            return self.response
        return json_response(self.body())

    def chunk(self, sample: Sample, step: Step | None) -> dict[str, Any]:
        """One SSE event: a delta of one choice (`step` None = the abort terminal)."""
        logprobs = None
        if self.options.sampling.logprobs is not None:
            content = [] if step is None else [logprob_content(step, self.k, self.engine.profile)]
            logprobs = {"content": content}
        usage = None
        if self.options.continuous_usage:
            usage = {**self.usage(len(sample.tokens)), "prompt_tokens_details": None}
        return {
            "request_id": self.options.engine_id,
            "usage": usage,
            "prompt_token_ids": None,
            "mm_placeholders": None,
            "metrics": None,
            "output_mode": "tokens",
            "choices": [
                {
                    "index": sample.index,
                    "finish_reason": sample.finish_reason,
                    "token_ids": [] if step is None else [step.token],
                    "routed_experts": None,
                    "sampling_mask": None,
                    "weight_versions": None,
                    "logprobs": logprobs,
                    "stop_reason": sample.stop_reason,
                }
            ],
        }

    def body(self) -> dict[str, Any]:
        opts = self.options
        model = TokenModel(self.engine.config.vocab_size)
        choices = []
        for sample in self.samples:
            logprobs = None
            if opts.sampling.logprobs is not None:
                logprobs = {
                    "content": [
                        logprob_content(s, self.k, self.engine.profile) for s in sample.steps
                    ]
                }
            if self.engine.profile == "new":
                choices.append(
                    {
                        "index": sample.index,
                        # A null finish is reported as "stop".
                        "finish_reason": sample.finish_reason or "stop",
                        "token_ids": list(sample.tokens),
                        "routed_experts": None,
                        "sampling_mask": None,
                        "weight_versions": None,
                        "logprobs": logprobs,
                        "stop_reason": sample.stop_reason,
                    }
                )
            else:
                choices.append(
                    {
                        "index": sample.index,
                        "logprobs": logprobs,
                        "finish_reason": sample.finish_reason or "stop",
                        "token_ids": list(sample.tokens),
                        "stop_reason": sample.stop_reason,
                    }
                )
        plp = None
        if opts.sampling.prompt_logprobs is not None:
            plp = prompt_logprobs(
                model, opts.sampling.seed, opts.prompt, opts.sampling.prompt_logprobs
            )
        out: dict[str, Any] = {
            "request_id": opts.engine_id,
            "model": self.engine.config.model,
            "created": int(time.time()),
            "usage": {**self.usage(), "prompt_tokens_details": None},
            "prompt_logprobs": plp,
        }
        if self.engine.profile == "new":
            out.update(prompt_token_id_logprobs=None, prompt_token_ids=None,
                       mm_placeholders=None, metrics=None)  # fmt: skip
        out["kv_transfer_params"] = self.kv_transfer_out()
        if self.engine.profile == "new":
            out.update(ec_transfer_params=None, output_mode="tokens")
        out["choices"] = choices
        return out

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
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(range(start, start + count))],
            "remote_engine_id": self.engine.engine_uuid,
            "remote_request_id": self.options.engine_id,
            "remote_host": host,
            "remote_port": NIXL_SIDE_CHANNEL_PORT,
            "tp_size": 1,
        }

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

"""The mock SGLang scheduler: admission, the waiting queue, prefill, decode steps, aborts.

Each `Item` runs as a `Generation`, which pushes `Event`s to the HTTP handler: stream
chunks, the final output, or an injected transport fault for the handler to act on. A
generation spends the token delay in the waiting queue (aborted there, it finishes with
`Abort in waiting queue`); a request that failed the scheduler's own checks finishes after
one forward pass with a 400 abort finish reason; the others decode until
`Req.check_finished` ends them: an abort, the length cap, a stop token. Aborts match rids
by prefix. Tokens come from genmesh's deterministic token model (`genmesh.engines.mock`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Literal

from genmesh.engines.faults import Fault, Running, ServerState
from genmesh.engines.mock import (
    MAX_TOP_LOGPROBS,
    ExpertModel,
    MockConfig,
    TokenModel,
    advance,
    initial_state,
)
from genmesh.engines.prefix_cache import RequestBlocks
from genmesh.engines.sglang_pd import FAKE_BOOTSTRAP_HOST
from genmesh.shared.tasks import wait_event
from genmesh.testkit.config import MockServerConfig
from genmesh.testkit.kv_cache import ServerCache, server_cache
from genmesh.testkit.pd import Handles, TransferFailed, fetch
from genmesh.testkit.sglang import pd
from genmesh.testkit.sglang.normalize import Item, normalize
from genmesh.testkit.sglang.request import JSON, Rejected
from genmesh.testkit.sglang.response import (
    LogprobEntry,
    Transcript,
    abort_reason,
    output,
    scheduler_abort,
    triple,
    waiting_abort,
)

# The MoE shape of the routed-expert rows, the mock worker engine's defaults.
_MOE = MockConfig()
# ServerArgs.page_size when not given: one token per KV page.
DEFAULT_PAGE_SIZE = 1


class Scheduler:
    """SGLang's tokenizer manager and scheduler as far as the mock has them: the token and
    expert models, and the requests waiting or running (`state`)."""

    def __init__(self, config: MockServerConfig, state: ServerState) -> None:
        self.config = config
        self.state = state
        self.model = TokenModel(config.vocab_size)
        self.experts = ExpertModel(_MOE.moe_layers, _MOE.moe_top_k, _MOE.moe_experts)
        # The radix cache, with --kv-events-config.
        self.cache: ServerCache | None = server_cache(
            "sglang", config, config.block_size or DEFAULT_PAGE_SIZE
        )
        # P/D: the KV handles this prefill server holds for its decode servers.
        self.handles = Handles(config.disaggregation_mode, config.disaggregation_timeout_s)

    def admit(self, body: JSON) -> tuple[list[Item], bool]:
        items, single = normalize(body, self.config)
        for it in items:
            if it.rid in self.state.running:
                raise Rejected(f"Duplicate request ID: {it.rid} is already running.")
        if self.config.disaggregation_mode != "null":
            for it in items:
                it.bootstrap = pd.bootstrap_of(body, it.index)
        return items, single

    def abort(self, rid: str = "", *, abort_all: bool = False) -> list[str]:
        """TokenizerManager.abort_request + Scheduler.abort_request.

        The tokenizer manager forwards only a rid it knows exactly; the scheduler then
        aborts every waiting or running request whose rid *starts with* it."""
        if abort_all:
            return self.state.abort_matching(lambda _: True)
        if rid not in self.state.running:
            return []
        return self.state.abort_matching(lambda other: other.startswith(rid))


@dataclass(slots=True)
class Event:
    index: int
    kind: Literal["chunk", "final", "fault", "crash"]
    payload: JSON | None = None
    fault: str | None = None


class Generation:
    """One item's run through the "scheduler": waiting queue, prefill, decode steps.

    It pushes events to the HTTP handler's queue: stream chunks, the final output, or a
    transport fault for the handler to act on."""

    def __init__(
        self,
        scheduler: Scheduler,
        item: Item,
        fault: Fault | None,
        *,
        stream: bool,
        created: float,
        queue: asyncio.Queue[Event],
    ) -> None:
        self.scheduler = scheduler
        self.item = item
        self.fault = fault
        self.stream = stream
        self.incremental = stream and scheduler.config.incremental
        self.created = created
        self.queue = queue
        self.running: Running = scheduler.state.start(item.rid)
        self.record = Transcript()
        self.sent = 0  # output tokens already delivered (incremental streaming)
        # The cache blocks the request holds while it runs (with a cache).
        self.blocks: RequestBlocks | None = None

    async def run(self) -> None:
        completed = False
        try:
            completed = await self._run()
        except asyncio.CancelledError:
            raise
        except Exception:
            self.queue.put_nowait(Event(self.item.index, "crash"))
            raise
        finally:
            if self.blocks is not None:
                self.blocks.release()
            # "completed" means a natural end (stop or length), as the vLLM mock counts it.
            natural = completed and not self.running.aborted.is_set()
            self.scheduler.state.finish(self.running, completed=natural)

    def _emit(self, kind: Literal["chunk", "final"], payload: JSON) -> None:
        self.queue.put_nowait(Event(self.item.index, kind, payload))

    async def _run(self) -> bool:
        """Generate; True when a final output was produced."""
        it = self.item
        if self.scheduler.config.disaggregation_mode != "null" and it.bootstrap is None:
            # handle_generate_request: aborted before it is queued, no forward pass.
            self._emit("final", scheduler_abort(it, [], pd.missing_room(it.rid), self.created))
            return True
        if await self._waiting():
            self._emit("final", waiting_abort(self.item))
            return True
        self.running.waiting = False
        if self.item.scheduler_abort is not None:
            self._scheduler_abort(self.item.scheduler_abort)
            return True
        cache = self.scheduler.cache
        if cache is not None:
            self.blocks = cache.open(self.item.prompt)
            self.record.cached_tokens = self.blocks.cached_tokens
        state = self._prompt_pass()
        if self.blocks is not None:
            self.blocks.prefilled()
        mode = self.scheduler.config.disaggregation_mode
        if mode == "prefill":
            return await self._prefill(state)
        first = None
        if mode == "decode":
            first = await self._receive()
            if first is None:
                return True
        return await self._decode(state, first)

    async def _prefill(self, state: int) -> bool:
        """P/D prefill: sample the first token, hand it (with the KV) to the decode side of
        the room, and once it has been taken reply with that token alone."""
        it = self.item
        assert it.bootstrap is not None
        token, logprob = self._sample(state, 0, self.banned)
        self._record(state, token, logprob)
        if it.bootstrap.host == FAKE_BOOTSTRAP_HOST:  # the fake sender: no decode waits
            self._emit("final", self._out(pd.PREFILL_FINISH))
            return True
        handles = self.scheduler.handles
        key = str(it.bootstrap.room)
        handles.offer(key, {"token": token, "logprob": logprob})
        timeout = self.scheduler.config.disaggregation_timeout_s
        failure = await handles.wait_taken(key, timeout, self.running.aborted)
        if failure is None:
            self._emit("final", self._out(pd.PREFILL_FINISH))
        else:
            message = pd.prefill_failed(it.rid, it.bootstrap.room, failure)
            self._emit("final", self._out(abort_reason(message, 500)))
        return True

    async def _receive(self) -> tuple[int, float] | None:
        """P/D decode: the first token and its logprob from the prefill of the room, or
        None after finishing with the engine's 500 abort."""
        it = self.item
        boot = it.bootstrap
        assert boot is not None
        wait_s = self.scheduler.config.disaggregation_timeout_s
        try:
            got = await fetch(boot.host, boot.port, str(boot.room), wait_s)
        except TransferFailed as exc:
            message = pd.decode_failed(it.rid, boot.room, str(exc))
            self._emit("final", self._out(abort_reason(message, 500)))
            return None
        return int(got["token"]), float(got["logprob"])

    async def _waiting(self) -> bool:
        """The prefill delay, spent in the waiting queue; True if aborted meanwhile."""
        delay = self.scheduler.state.token_delay_s
        if delay <= 0:
            await asyncio.sleep(0)
            return self.running.aborted.is_set()
        return await wait_event(self.running.aborted, delay)

    def _scheduler_abort(self, message: str) -> None:
        # set_finish_with_abort: the prompt became [0] and logprobs were switched off;
        # one forward pass later the request finishes with the abort.
        token = self.scheduler.model.greedy_token(advance(initial_state(self.item.seed), 0))
        self.record.output_ids = [token]
        self._emit("final", scheduler_abort(self.item, [token], message, self.created))

    def _prompt_pass(self) -> int:
        """Run the prompt: input logprobs and routed-expert rows; the state after it."""
        it = self.item
        model = self.scheduler.model
        record = self.record
        state = initial_state(it.seed)
        for i, tid in enumerate(it.prompt):
            # A P/D decode computes no prompt logprobs: the prefill ran the prompt.
            if it.return_logprob and i >= it.logprob_start and not self.decode_only:
                # SGLang's shift: the first requested position has no logprob.
                first = i == it.logprob_start
                record.in_lps.append(triple(None if first else model.logprob(state, tid), tid))
                if it.top_logprobs_num:
                    record.in_tops.append(None if first else self._top(state))
                if it.token_ids_logprob is not None:
                    record.in_tids.append(None if first else self._tids(state))
            state = advance(state, tid)
            if it.return_routed_experts and i >= it.routed_experts_start:
                record.rows.append(self.scheduler.experts.row(state))
        return state

    async def _decode(self, state: int, first: tuple[int, float] | None = None) -> bool:
        """Decode steps from `state` until a finish (True) or a transport fault (False);
        `first`: the first token and its logprob, sampled by a P/D prefill."""
        it = self.item
        fault = self.fault
        k = 0
        while True:
            # The fault fires only while the generation is still running.
            if fault is not None and k == fault.after_tokens and k < it.max_new_tokens:
                if fault.kind != "hang":
                    return self._fire(fault)
                # Nothing more until an abort (or the client leaving cancels us).
                await self.running.aborted.wait()
                fault = None
            if k >= it.max_new_tokens:  # max_new_tokens == 0: prefill only
                self._emit("final", self._out({"type": "length", "length": it.max_new_tokens}))
                return True
            if k:
                await asyncio.sleep(self.scheduler.state.token_delay_s)
            token, logprob = (
                first if k == 0 and first is not None else self._sample(state, k, self.banned)
            )
            self._record(state, token, logprob)
            if self.blocks is not None:
                self.blocks.extend([token])
            state = advance(state, token)
            k += 1
            finish = self._check_finished(token, k)
            if it.return_routed_experts:
                self.record.rows.append(self.scheduler.experts.row(state))
            if finish is not None:
                self._emit("final", self._out(finish))
                return True
            if self.stream and (k - 1) % it.stream_interval == 0:
                self._emit("chunk", self._out(None))

    def _fire(self, fault: Fault) -> bool:
        """Any injected fault but `hang`: `abort` finishes the generation with its reason
        (True); drop, no_terminal and done_early leave the handler to end the response."""
        if fault.kind == "abort":
            self._emit("final", self._out(abort_reason(fault.message, fault.status or None)))
            return True
        payload = None if self.stream else self._out(None)
        self.queue.put_nowait(Event(self.item.index, "fault", payload, fault=fault.kind))
        return False

    def _sample(self, state: int, k: int, banned: frozenset[int]) -> tuple[int, float]:
        """The `k`th output token: greedy, unless min_new_tokens forbids it."""
        model = self.scheduler.model
        if k < self.item.min_new_tokens:
            # Masked like a real engine masks stop logits: the best allowed candidate.
            candidates = model.top(state, MAX_TOP_LOGPROBS)
            return next(((t, lp) for t, lp in candidates if t not in banned), candidates[0])
        return model.greedy_token(state), model.greedy_logprob(state)

    def _check_finished(self, token: int, k: int) -> JSON | None:
        """Req.check_finished after `k` tokens: a pending abort, then the length cap, then
        stop tokens."""
        it = self.item
        if self.running.aborted.is_set():
            return abort_reason("Aborted", None)
        if k >= it.max_new_tokens:
            return {"type": "length", "length": it.max_new_tokens}
        stops = token == self.eos or token in it.stop_token_ids
        if not it.ignore_eos and k > it.min_new_tokens and stops:
            return {"type": "stop", "matched": token}
        return None

    @property
    def eos(self) -> int:
        return self.scheduler.config.eos_token_id

    @property
    def banned(self) -> frozenset[int]:
        it = self.item
        return it.stop_token_ids if it.ignore_eos else it.stop_token_ids | {self.eos}

    @property
    def decode_only(self) -> bool:
        return self.scheduler.config.disaggregation_mode == "decode"

    def _top(self, state: int) -> list[LogprobEntry]:
        return [
            triple(lp, t) for t, lp in self.scheduler.model.top(state, self.item.top_logprobs_num)
        ]

    def _tids(self, state: int) -> list[LogprobEntry]:
        model = self.scheduler.model
        return [triple(model.logprob(state, t), t) for t in self.item.token_ids_logprob or []]

    def _record(self, state: int, token: int, logprob: float) -> None:
        it = self.item
        record = self.record
        record.output_ids.append(token)
        if it.return_logprob:
            record.out_lps.append(triple(logprob, token))
            if it.top_logprobs_num:
                record.out_tops.append(self._top(state))
            if it.token_ids_logprob is not None:
                record.out_tids.append(self._tids(state))

    def _out(self, finish: JSON | None) -> JSON:
        """The output object now: in incremental streaming, only what is new since the
        last one."""
        offset = self.sent if self.incremental else 0
        out = output(self.item, self.record, finish, offset=offset, created=self.created)
        self.sent = len(self.record.output_ids)
        return out

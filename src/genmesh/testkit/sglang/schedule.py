"""The mock SGLang scheduler: admission, the waiting queue, prefill, decode steps, aborts.

Each `Item` runs as a `Generation`, which pushes `Event`s to the HTTP handler: stream
chunks, the final output, or an injected transport fault for the handler to act on.
Tokens come from genmesh's deterministic token model (`genmesh.engines.mock`).
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
from dataclasses import dataclass
from typing import Any, Literal

from genmesh.engines.faults import Fault, Running, ServerState
from genmesh.engines.mock import (
    MAX_TOP_LOGPROBS,
    ExpertModel,
    MockConfig,
    TokenModel,
    advance,
    initial_state,
)
from genmesh.shared.tasks import wait_event
from genmesh.testkit.common import MockServerConfig
from genmesh.testkit.sglang.normalize import Item, normalize
from genmesh.testkit.sglang.request import JSON, Rejected
from genmesh.testkit.sglang.response import WAITING_ABORT, WEIGHT_VERSION, abort_reason

# The MoE shape of the routed-expert rows, the mock worker engine's defaults.
_MOE = MockConfig()

LogprobEntry = list[Any]  # [logprob | None, token_id, None]


class Scheduler:
    """SGLang's tokenizer manager and scheduler as far as the mock has them: the token and
    expert models, and the requests waiting or running (`state`)."""

    def __init__(self, config: MockServerConfig, state: ServerState) -> None:
        self.config = config
        self.state = state
        self.model = TokenModel(config.vocab_size)
        self.experts = ExpertModel(_MOE.moe_layers, _MOE.moe_top_k, _MOE.moe_experts)

    def admit(self, body: JSON) -> tuple[list[Item], bool]:
        items, single = normalize(body, self.config)
        for it in items:
            if it.rid in self.state.running:
                raise Rejected(f"Duplicate request ID: {it.rid} is already running.")
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


def triple(logprob: float | None, token: int) -> LogprobEntry:
    return [logprob, token, None]


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
        self.output_ids: list[int] = []
        self.out_lps: list[LogprobEntry] = []
        self.out_tops: list[list[LogprobEntry] | None] = []
        self.out_tids: list[list[LogprobEntry] | None] = []
        self.in_lps: list[LogprobEntry] = []
        self.in_tops: list[list[LogprobEntry] | None] = []
        self.in_tids: list[list[LogprobEntry] | None] = []
        self.rows: list[list[int]] = []
        self.sent = 0  # output tokens already delivered (incremental streaming)

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
            # "completed" means a natural end (stop or length), as the vLLM mock counts it.
            natural = completed and not self.running.aborted.is_set()
            self.scheduler.state.finish(self.running, completed=natural)

    def _emit(self, kind: Literal["chunk", "final"], payload: JSON) -> None:
        self.queue.put_nowait(Event(self.item.index, kind, payload))

    async def _waiting(self) -> bool:
        """The prefill delay, spent in the waiting queue; True if aborted meanwhile."""
        delay = self.scheduler.state.token_delay_s
        if delay <= 0:
            await asyncio.sleep(0)
            return self.running.aborted.is_set()
        return await wait_event(self.running.aborted, delay)

    async def _run(self) -> bool:
        """Generate; True when a final output was produced."""
        it = self.item
        model = self.scheduler.model
        if await self._waiting():
            self._emit("final", self._waiting_abort())
            return True
        self.running.waiting = False
        if it.scheduler_abort is not None:
            # set_finish_with_abort: the prompt became [0] and logprobs were switched off;
            # one forward pass later the request finishes with the abort.
            self.output_ids = [advance(initial_state(it.seed), 0) % model.vocab_size]
            self._emit("final", self._scheduler_abort(it.scheduler_abort))
            return True

        state = self._prompt_pass()
        banned = it.stop_token_ids if it.ignore_eos else it.stop_token_ids | {self.eos}
        fault = self.fault
        k = 0
        while True:
            if fault is not None and k == fault.after_tokens and k < it.max_new_tokens:
                # The fault fires only while the generation is still running.
                if fault.kind == "abort":
                    reason = abort_reason(fault.message, fault.status or None)
                    self._emit("final", self._out(reason))
                    return True
                if fault.kind == "hang":
                    # Nothing more until an abort (or the client leaving cancels us).
                    await self.running.aborted.wait()
                else:  # drop, no_terminal, done_early: the handler ends the response
                    payload = None if self.stream else self._out(None)
                    self.queue.put_nowait(Event(it.index, "fault", payload, fault=fault.kind))
                    return False
                fault = None
            if k >= it.max_new_tokens:  # max_new_tokens == 0: prefill only
                self._emit("final", self._out({"type": "length", "length": it.max_new_tokens}))
                return True
            if k:
                await asyncio.sleep(self.scheduler.state.token_delay_s)
            if k < it.min_new_tokens:
                # Masked like a real engine masks stop logits: the best allowed candidate.
                candidates = model.top(state, MAX_TOP_LOGPROBS)
                token, logprob = next(
                    ((t, lp) for t, lp in candidates if t not in banned), candidates[0]
                )
            else:
                token, logprob = state % model.vocab_size, model.greedy_logprob(state)
            self._record(state, token, logprob)
            state = advance(state, token)
            k += 1
            finish: JSON | None = None
            # Req.check_finished: a pending abort, then the length cap, then stop tokens.
            if self.running.aborted.is_set():
                finish = abort_reason("Aborted", None)
            elif k >= it.max_new_tokens:
                finish = {"type": "length", "length": it.max_new_tokens}
            elif (
                not it.ignore_eos
                and k > it.min_new_tokens
                and (token == self.eos or token in it.stop_token_ids)
            ):
                finish = {"type": "stop", "matched": token}
            if it.return_routed_experts:
                self.rows.append(self.scheduler.experts.row(state))
            if finish is not None:
                self._emit("final", self._out(finish))
                return True
            if self.stream and (k - 1) % it.stream_interval == 0:
                self._emit("chunk", self._out(None))

    @property
    def eos(self) -> int:
        return self.scheduler.config.eos_token_id

    def _prompt_pass(self) -> int:
        """Run the prompt: input logprobs and routed-expert rows; the state after it."""
        it = self.item
        model = self.scheduler.model
        state = initial_state(it.seed)
        for i, tid in enumerate(it.prompt):
            if it.return_logprob and i >= it.logprob_start:
                # SGLang's shift: the first requested position has no logprob.
                first = i == it.logprob_start
                self.in_lps.append(triple(None if first else model.logprob(state, tid), tid))
                if it.top_logprobs_num:
                    self.in_tops.append(None if first else self._top(state, it.top_logprobs_num))
                if it.token_ids_logprob is not None:
                    self.in_tids.append(None if first else self._tids(state))
            state = advance(state, tid)
            if it.return_routed_experts and i >= it.routed_experts_start:
                self.rows.append(self.scheduler.experts.row(state))
        return state

    def _top(self, state: int, k: int) -> list[LogprobEntry]:
        return [triple(lp, t) for t, lp in self.scheduler.model.top(state, k)]

    def _tids(self, state: int) -> list[LogprobEntry]:
        model = self.scheduler.model
        return [triple(model.logprob(state, t), t) for t in self.item.token_ids_logprob or []]

    def _record(self, state: int, token: int, logprob: float) -> None:
        it = self.item
        self.output_ids.append(token)
        if it.return_logprob:
            self.out_lps.append(triple(logprob, token))
            if it.top_logprobs_num:
                self.out_tops.append(self._top(state, it.top_logprobs_num))
            if it.token_ids_logprob is not None:
                self.out_tids.append(self._tids(state))

    def _latency(self) -> float:
        return round(time.monotonic() - self.created, 6)

    def _routed_experts(self) -> str:
        """Rows for positions [start, seqlen - 1): the last token has had no forward pass."""
        it = self.item
        want = max(0, len(it.prompt) + len(self.output_ids) - 1 - it.routed_experts_start)
        flat = [e for row in self.rows[:want] for e in row]
        return base64.b64encode(struct.pack(f"<{len(flat)}i", *flat)).decode("ascii")

    def _out(self, finish: JSON | None) -> JSON:
        """An output object as the tokenizer manager builds it (BatchTokenIDOutput)."""
        it = self.item
        offset = self.sent if self.incremental else 0
        meta: JSON = {
            "id": it.rid,
            "finish_reason": finish,
            "prompt_tokens": len(it.prompt),
            "weight_version": WEIGHT_VERSION,
            "num_retractions": 0,
        }
        if it.return_logprob:
            meta["input_token_logprobs"] = list(self.in_lps)
            meta["output_token_logprobs"] = self.out_lps[offset:]
            meta["output_token_logprobs_length"] = len(self.out_lps)
            if it.top_logprobs_num:
                meta["input_top_logprobs"] = list(self.in_tops)
                meta["output_top_logprobs"] = self.out_tops[offset:]
            if it.token_ids_logprob is not None:
                meta["input_token_ids_logprobs"] = list(self.in_tids)
                meta["output_token_ids_logprobs"] = self.out_tids[offset:]
        meta["reasoning_tokens"] = 0
        meta["completion_tokens"] = len(self.output_ids)
        meta["cached_tokens"] = 0
        if finish is not None:
            if it.return_routed_experts:
                meta["routed_experts"] = self._routed_experts()
            meta["e2e_latency"] = self._latency()
        output_ids = self.output_ids[offset:]
        self.sent = len(self.output_ids)
        return {"output_ids": output_ids, "meta_info": meta}

    def _waiting_abort(self) -> JSON:
        """The tokenizer manager's `_handle_abort_req`: a request aborted while waiting.

        Its output carries an empty `text` even under --skip-tokenizer-init."""
        it = self.item
        meta: JSON = {"id": it.rid, "finish_reason": {"type": "abort", "message": WAITING_ABORT}}
        if it.return_logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = []
            meta["output_token_logprobs_length"] = 0
            if it.top_logprobs_num:
                meta["input_top_logprobs"] = []
                meta["output_top_logprobs"] = []
            if it.token_ids_logprob is not None:
                meta["input_token_ids_logprobs"] = []
                meta["output_token_ids_logprobs"] = []
        meta["completion_tokens"] = 0
        return {"text": "", "output_ids": [], "meta_info": meta}

    def _scheduler_abort(self, message: str) -> JSON:
        return {
            "output_ids": list(self.output_ids),
            "meta_info": {
                "id": self.item.rid,
                "finish_reason": abort_reason(message, 400),
                "prompt_tokens": 1,
                "weight_version": WEIGHT_VERSION,
                "num_retractions": 0,
                "reasoning_tokens": 0,
                "completion_tokens": len(self.output_ids),
                "cached_tokens": 0,
                "e2e_latency": self._latency(),
            },
        }

"""Coalescing: an engine's outputs that are ready at once travel as one output.

NATS costs per message and a frontend per frame, so one frame per token is itself the
ceiling when an engine produces faster than its frames are sent. `coalesce` merges the
outputs the engine yields without suspending (all of them were available now) and passes
the merged output on when the engine would block, so a slow engine (a real decode step per
token) still gets one frame per token and no latency is added. vLLM does the same
(`RequestOutputCollector` merges DELTA outputs while its consumer is behind), and SGLang's
`stream_interval` and speculative decoding send several tokens per chunk.

The engine's generator is stepped by hand: `__anext__()` is started with `send(None)`; if
it finishes at once, its output was ready; if it suspends, what is pending goes out first
and then the rest of the step is awaited (`_Rest`) exactly as `await` would have done it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Coroutine, Generator
from typing import Any, TypeVar

from genmesh.engines.base import EngineOutput

T = TypeVar("T")

# Bounds of one merged output: a frame never grows past NATS's max_payload (1 MiB by
# default) and the first output is never held back behind a long synchronous burst.
# Size is counted in per-position entries (tokens, top/listed logprob pairs, expert ids),
# each a few to ~30 bytes encoded.
MAX_MERGED_ENTRIES = 8192
MAX_HOLD_S = 0.002

# Per-token fields: one entry per token of the output they belong to.
_PER_TOKEN = ("logprobs", "ranks", "top_logprobs", "token_ids_logprobs")
# Once-per-request fields: the first output carries them.
_ONCE = (
    "prompt_logprobs",
    "prompt_ranks",
    "prompt_top_logprobs",
    "prompt_token_ids_logprobs",
    "cached_tokens",
)


def mergeable(a: EngineOutput, b: EngineOutput) -> bool:
    """Whether `merge(a, b)` says exactly what `a` then `b` say."""
    if a.finish is not None:
        return False
    for name in _PER_TOKEN:
        # A per-token list both have, or neither has; an output without tokens has
        # nothing to align (the first output, the prompt's facts, often has no token).
        if (getattr(a, name) is None) != (getattr(b, name) is None) and a.tokens and b.tokens:
            return False
    return all(getattr(a, name) is None or getattr(b, name) is None for name in _ONCE)


def merge(a: EngineOutput, b: EngineOutput) -> EngineOutput:
    """`a` then `b` as one output (`mergeable(a, b)` must hold): per-token lists and
    routed-expert rows concatenated, once-only fields from whichever has them, the finish
    and usage of `b`. Engine extras are the newest value of each key, as an engine that
    had sent both chunks as one would report them (SGLang's meta_info is per chunk)."""
    return EngineOutput(
        tokens=a.tokens + b.tokens,
        logprobs=_cat(a.logprobs, b.logprobs),
        ranks=_cat(a.ranks, b.ranks),
        top_logprobs=_cat(a.top_logprobs, b.top_logprobs),
        prompt_logprobs=_first(a.prompt_logprobs, b.prompt_logprobs),
        prompt_ranks=_first(a.prompt_ranks, b.prompt_ranks),
        prompt_top_logprobs=_first(a.prompt_top_logprobs, b.prompt_top_logprobs),
        token_ids_logprobs=_cat(a.token_ids_logprobs, b.token_ids_logprobs),
        prompt_token_ids_logprobs=_first(a.prompt_token_ids_logprobs, b.prompt_token_ids_logprobs),
        routed_experts=_cat(a.routed_experts, b.routed_experts),
        cached_tokens=_first(a.cached_tokens, b.cached_tokens),
        finish=b.finish,
        usage=b.usage,
        engine={**a.engine, **b.engine} if a.engine and b.engine else a.engine or b.engine,
        handoff=b.handoff,
    )


def split(out: EngineOutput, k: int) -> tuple[EngineOutput, EngineOutput]:
    """`out` as its first `k` tokens and the rest (0 < k < len(out.tokens)), the inverse of
    `merge`: the head has the once-only fields, the tail the finish, usage and extras. The
    routed-expert rows at the end of an output are its last tokens' (one per token, for the
    token before it), so the tail takes as many rows as it has tokens, where there are."""
    rest = len(out.tokens) - k
    rows = out.routed_experts
    cut = max(len(rows) - rest, 0) if rows is not None else 0
    head = EngineOutput(
        tokens=out.tokens[:k],
        logprobs=None if out.logprobs is None else out.logprobs[:k],
        ranks=None if out.ranks is None else out.ranks[:k],
        top_logprobs=None if out.top_logprobs is None else out.top_logprobs[:k],
        prompt_logprobs=out.prompt_logprobs,
        prompt_ranks=out.prompt_ranks,
        prompt_top_logprobs=out.prompt_top_logprobs,
        token_ids_logprobs=None if out.token_ids_logprobs is None else out.token_ids_logprobs[:k],
        prompt_token_ids_logprobs=out.prompt_token_ids_logprobs,
        routed_experts=None if rows is None else rows[:cut],
        cached_tokens=out.cached_tokens,
    )
    tail = EngineOutput(
        tokens=out.tokens[k:],
        logprobs=None if out.logprobs is None else out.logprobs[k:],
        ranks=None if out.ranks is None else out.ranks[k:],
        top_logprobs=None if out.top_logprobs is None else out.top_logprobs[k:],
        token_ids_logprobs=None if out.token_ids_logprobs is None else out.token_ids_logprobs[k:],
        routed_experts=None if rows is None else rows[cut:],
        finish=out.finish,
        usage=out.usage,
        engine=out.engine,
        handoff=out.handoff,
    )
    return head, tail


def _cat(a: list[T] | None, b: list[T] | None) -> list[T] | None:
    if a is None:
        return b
    return a if b is None else a + b


def _first(a: T | None, b: T | None) -> T | None:
    return b if a is None else a


def _entries(out: EngineOutput) -> int:
    """The output's size in per-position entries (see MAX_MERGED_ENTRIES)."""
    n = len(out.tokens)
    for rows in (out.top_logprobs, out.token_ids_logprobs, out.routed_experts):
        if rows:
            n += sum(len(row) for row in rows)
    return n


async def coalesce(
    outputs: AsyncGenerator[EngineOutput, None],
) -> AsyncGenerator[EngineOutput, None]:
    """`outputs`, with those ready at once merged (see the module's docstring); ends after
    the output that carries a finish. Close it (aclosing) before closing `outputs`: it may
    hold a step of `outputs` half done."""
    pending: EngineOutput | None = None
    held_since = 0.0
    size = 0
    while True:
        step = outputs.__anext__()
        try:
            blocked_on = step.send(None)
        except StopIteration as ready:
            out: EngineOutput = ready.value
        except StopAsyncIteration:
            break
        except BaseException:
            if pending is not None:
                yield pending  # what the engine made before it failed still goes
            raise
        else:
            # The engine would block: send what is pending now, then wait as `await` would.
            if pending is not None:
                try:
                    yield pending
                except BaseException as exc:
                    # Closed (or thrown into) meanwhile: the half-done step sees it at its
                    # await, as it would have without us, so the engine unwinds now.
                    with contextlib.suppress(StopAsyncIteration):
                        await _Rest(step, None, exc)
                    raise
                pending = None
            out = await _Rest(step, blocked_on)
        if pending is not None and mergeable(pending, out):
            pending = merge(pending, out)
            size += _entries(out)
        else:
            if pending is not None:
                yield pending
            pending, held_since, size = out, time.monotonic(), _entries(out)
        if pending.finish is not None:
            break
        if size >= MAX_MERGED_ENTRIES or time.monotonic() - held_since >= MAX_HOLD_S:
            yield pending
            pending = None
    if pending is not None:
        yield pending


class _Rest:
    """The rest of a step (`__anext__()`) that suspended on `blocked_on`, awaitable: it
    passes what it waits on to the task and what the task sends or throws back into it,
    as `await` does. With `throw`, it starts by throwing that into the step instead."""

    __slots__ = ("blocked_on", "step", "throw")

    def __init__(
        self,
        step: Coroutine[Any, Any, EngineOutput],
        blocked_on: Any,
        throw: BaseException | None = None,
    ) -> None:
        self.step = step
        self.blocked_on = blocked_on
        self.throw = throw

    def __await__(self) -> Generator[Any, Any, EngineOutput]:
        step = self.step
        try:
            value = self.blocked_on if self.throw is None else step.throw(self.throw)
            while True:
                try:
                    sent = yield value
                except BaseException as exc:
                    value = step.throw(exc)
                else:
                    value = step.send(sent)
        except StopIteration as done:
            result: EngineOutput = done.value
            return result

"""The conformance scenarios: one list, run against every engine adapter.

Families, as in the seed system's sidecar testkit: streaming (tokens, terminal placement,
length reason, usage), failure (opening failure, premature EOF, read error, exact
delivered prefix), cancellation (before submit, while opening, during read; A cancelled
while B stays live) and cleanup (idempotent; no leaked tasks or connections).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable

from genmesh.engines.base import EngineOutput
from genmesh.shared.errors import ErrorCode, MeshError
from tests.conformance.harness import EOS, Harness, envelope, expected

Scenario = Callable[[Harness], Awaitable[None]]


async def collect(h: Harness, **kwargs: object) -> list[EngineOutput]:
    return [out async for out in h.engine.generate(envelope(**kwargs))]  # type: ignore[arg-type]


async def fail_after(h: Harness, **kwargs: object) -> tuple[list[int], MeshError]:
    """Tokens delivered before the engine failed, and the failure."""
    delivered: list[int] = []
    try:
        async for out in h.engine.generate(envelope(**kwargs)):  # type: ignore[arg-type]
            delivered += out.tokens
    except MeshError as error:
        return delivered, error
    raise AssertionError(f"the engine did not fail; it delivered {delivered}")


async def engine_stopped(h: Harness, before: dict[str, object], timeout: float = 3.0) -> None:
    """The engine no longer runs anything, and it saw one more abort or disconnect."""

    def gone(state: dict[str, object]) -> int:
        return len(state["aborted"]) + len(state["disconnected"])  # type: ignore[arg-type]

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = await h.state()
        if not state["running"] and gone(state) > gone(before):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the engine request was not stopped: {await h.state()}")


# ---------------------------------------------------------------- streaming


async def tokens(h: Harness) -> None:
    outs = await collect(h, max_tokens=12, ignore_eos=True)
    env = envelope(max_tokens=12, ignore_eos=True)
    assert [t for out in outs for t in out.tokens] == await expected(env)


async def terminal_placement(h: Harness) -> None:
    outs = await collect(h, max_tokens=5, ignore_eos=True)
    finishes = [i for i, out in enumerate(outs) if out.finish is not None]
    assert finishes == [len(outs) - 1], "exactly one terminal output, and it is the last"
    assert all(out.tokens for out in outs), "no empty outputs: every one carries a token"


async def length_reason(h: Harness) -> None:
    outs = await collect(h, max_tokens=4, ignore_eos=True)
    assert outs[-1].finish is not None
    assert outs[-1].finish["reason"] == "length"
    stop_at = (await expected(envelope(max_tokens=4, ignore_eos=True)))[2]
    # (Without ignore_eos: SGLang's ignore_eos silences stop token ids too.)
    outs = await collect(h, max_tokens=10, stop_token_ids=[stop_at])
    assert outs[-1].finish is not None
    assert outs[-1].finish["reason"] in ("stop", "eos")
    assert outs[-1].finish.get("matched") == stop_at
    assert outs[-1].tokens[-1] == stop_at


async def stop_ids_under_ignore_eos(h: Harness) -> None:
    """Canonical stop token ids hold under ignore_eos on every engine (SGLang itself
    skips them then: its adapter watches for them)."""
    full = await expected(envelope(max_tokens=10, ignore_eos=True))
    outs = await collect(h, max_tokens=10, stop_token_ids=[full[4]], ignore_eos=True)
    assert [t for o in outs for t in o.tokens] == full[:5]
    assert outs[-1].finish == {"reason": "stop", "matched": full[4]}
    assert outs[-1].usage is not None
    assert outs[-1].usage["completion_tokens"] == 5


async def usage(h: Harness) -> None:
    outs = await collect(h, prompt=[1, 2, 3, 4, 5], max_tokens=6, ignore_eos=True)
    assert outs[-1].usage is not None
    assert outs[-1].usage["prompt_tokens"] == 5
    assert outs[-1].usage["completion_tokens"] == 6 == sum(len(o.tokens) for o in outs)
    assert outs[-1].usage.get("cached_tokens", 0) >= 0


async def logprobs(h: Harness) -> None:
    kwargs = {"max_tokens": 4, "ignore_eos": True, "logprobs": True, "top_logprobs": 2}
    outs = await collect(h, **kwargs)
    reference = [o async for o in _reference_outputs(**kwargs)]
    assert [lp for o in outs for lp in o.logprobs or []] == [
        lp for o in reference for lp in o.logprobs or []
    ]
    assert [t for o in outs for t in o.top_logprobs or []] == [
        t for o in reference for t in o.top_logprobs or []
    ]


async def _reference_outputs(**kwargs: object):  # type: ignore[no-untyped-def]
    from genmesh.engines.mock import MockConfig, MockEngine
    from tests.conformance.harness import VOCAB

    engine = MockEngine(MockConfig(vocab_size=VOCAB, eos_token_id=EOS))
    async for out in engine.generate(envelope(**kwargs)):  # type: ignore[arg-type]
        yield out


# ---------------------------------------------------------------- failure


async def opening_failure(h: Harness) -> None:
    await h.inject("http_error", status=500)
    delivered, error = await fail_after(h, max_tokens=5)
    assert delivered == []
    assert error.code is ErrorCode.UNAVAILABLE
    assert error.retryable
    await h.inject("http_error", status=400, message="bad prompt")
    delivered, error = await fail_after(h, max_tokens=5)
    assert delivered == []
    assert error.code is ErrorCode.INVALID_ARGUMENT
    assert "bad prompt" in error.message
    assert not error.retryable


async def premature_eof(h: Harness) -> None:
    for kind in ("no_terminal", "done_early"):
        await h.inject(kind, after_tokens=3)
        delivered, error = await fail_after(h, max_tokens=8, ignore_eos=True)
        assert len(delivered) == 3, kind
        assert error.code is ErrorCode.UNAVAILABLE, kind
        assert error.retryable
        assert error.detail.get("reason") == "stream_incomplete", (kind, error)


async def read_error(h: Harness) -> None:
    await h.inject("drop", after_tokens=2)
    delivered, error = await fail_after(h, max_tokens=8, ignore_eos=True)
    assert len(delivered) == 2
    assert error.code is ErrorCode.UNAVAILABLE
    assert error.retryable


async def exact_delivered_prefix(h: Harness) -> None:
    full = await expected(envelope(max_tokens=10, ignore_eos=True))
    for kind, after in (("drop", 4), ("no_terminal", 5), ("done_early", 1)):
        await h.inject(kind, after_tokens=after)
        delivered, _ = await fail_after(h, max_tokens=10, ignore_eos=True)
        assert delivered == full[:after], kind


async def engine_aborts(h: Harness) -> None:
    if h.aborts_carry_a_status:
        # An abort with a 4xx status before any token: the request was wrong.
        await h.inject("abort", status=400, message="grammar does not compile", after_tokens=0)
        delivered, error = await fail_after(h, max_tokens=5)
        assert delivered == []
        assert error.code is ErrorCode.INVALID_ARGUMENT
        assert "grammar does not compile" in error.message
    # A plain abort on decode: the engine stopped the request; it ends, not fails.
    await h.inject("abort", status=0, after_tokens=2)
    outs = await collect(h, max_tokens=8, ignore_eos=True)
    assert sum(len(o.tokens) for o in outs) >= 2
    assert outs[-1].finish is not None
    assert outs[-1].finish["reason"] == "abort"


# ---------------------------------------------------------------- cancellation


async def cancel_before_submit(h: Harness) -> None:
    before = await h.state()
    generation = h.engine.generate(envelope(max_tokens=5))
    await generation.aclose()  # never started: nothing may reach the engine
    await asyncio.sleep(0.05)
    assert (await h.state())["received"] == before["received"]


async def cancel_while_opening(h: Harness) -> None:
    await h.inject("hang", after_tokens=0)
    before = await h.state()
    task = asyncio.create_task(collect(h, max_tokens=5))
    await _until_running(h)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await engine_stopped(h, before)


async def cancel_during_read(h: Harness) -> None:
    await h.token_delay(20)
    before = await h.state()
    seen: list[int] = []

    two_tokens = asyncio.Event()

    async def read() -> None:
        async for out in h.engine.generate(envelope(max_tokens=500, ignore_eos=True)):
            seen.extend(out.tokens)
            if len(seen) >= 2:
                two_tokens.set()

    task = asyncio.create_task(read())
    await two_tokens.wait()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await engine_stopped(h, before)
    assert len(seen) < 50


async def one_cancelled_other_lives(h: Harness) -> None:
    await h.token_delay(10)
    env_b = envelope(prompt=[5, 6], max_tokens=12, ignore_eos=True)
    first_token = asyncio.Event()

    async def run_a() -> None:
        async for _ in h.engine.generate(envelope(max_tokens=500, ignore_eos=True)):
            first_token.set()

    async def run_b() -> list[int]:
        return [t async for out in h.engine.generate(env_b) for t in out.tokens]

    a = asyncio.create_task(run_a())
    b = asyncio.create_task(run_b())
    await first_token.wait()
    a.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await a
    assert await b == await expected(env_b)


async def _until_running(h: Harness, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not (await h.state())["running"]:
        assert time.monotonic() < deadline, "the request never reached the engine"
        await asyncio.sleep(0.01)


# ---------------------------------------------------------------- cleanup


async def idempotent_cleanup(h: Harness) -> None:
    generation = h.engine.generate(envelope(max_tokens=3, ignore_eos=True))
    [out async for out in generation]
    await generation.aclose()
    await generation.aclose()
    await h.engine.close()
    await h.engine.close()
    await h.engine.start()  # and usable again
    assert len(await collect(h, max_tokens=2, ignore_eos=True)) == 2


async def no_leaks(h: Harness) -> None:
    await collect(h, max_tokens=2, ignore_eos=True)  # warm any pools
    tasks_before = len(asyncio.all_tasks())
    fds_before = _open_fds()
    for i in range(30):
        if i % 3 == 0:
            await h.inject("drop", after_tokens=1)
        generation = h.engine.generate(envelope(max_tokens=6, ignore_eos=True))
        with contextlib.suppress(MeshError):
            async for out in generation:
                if i % 3 == 1 and out.tokens:
                    break  # the consumer leaves early: the engine request must go too
        await generation.aclose()
    await asyncio.sleep(0.2)
    state = await h.state()
    assert state["running"] == [], state
    # Keep-alive pools may hold a few idle connections; closing the engine must release
    # them all, and with them every task and socket the 30 requests used.
    await h.engine.close()
    await asyncio.sleep(0.2)
    assert len(asyncio.all_tasks()) <= tasks_before
    assert _open_fds() <= fds_before


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


SCENARIOS: list[tuple[str, str, Scenario]] = [
    ("streaming", "tokens", tokens),
    ("streaming", "terminal_placement", terminal_placement),
    ("streaming", "length_reason", length_reason),
    ("streaming", "usage", usage),
    ("streaming", "stop_ids_under_ignore_eos", stop_ids_under_ignore_eos),
    ("streaming", "logprobs", logprobs),
    ("failure", "opening_failure", opening_failure),
    ("failure", "premature_eof", premature_eof),
    ("failure", "read_error", read_error),
    ("failure", "exact_delivered_prefix", exact_delivered_prefix),
    ("failure", "engine_aborts", engine_aborts),
    ("cancellation", "before_submit", cancel_before_submit),
    ("cancellation", "while_opening", cancel_while_opening),
    ("cancellation", "during_read", cancel_during_read),
    ("cancellation", "one_cancelled_other_lives", one_cancelled_other_lives),
    ("cleanup", "idempotent", idempotent_cleanup),
    ("cleanup", "no_leaks", no_leaks),
]

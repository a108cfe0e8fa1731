"""An attempt's one timer (`Attempt._get`): armed for the earliest time a timeout may be
due, kept while frames come, re-armed when it goes off early or a sooner wake is asked."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from genmesh.client.attempt import Attempt, Failure, Incoming
from genmesh.shared.envelope import Envelope
from genmesh.shared.errors import ErrorCode

pytestmark = pytest.mark.unit

# What the queue holds does not matter to `_get`: a failure stands for a reply.
FRAME = Failure(None, ErrorCode.UNAVAILABLE, "a reply")
NEXT = Failure(None, ErrorCode.UNAVAILABLE, "the next reply")


def _attempt() -> Attempt:
    # `_get` reads nothing of the client or the envelope.
    return Attempt(cast(Any, None), cast(Envelope, None), "subject", None)


async def test_a_frame_wins_and_the_timer_stays_armed() -> None:
    loop = asyncio.get_running_loop()
    attempt, queue = _attempt(), asyncio.Queue[Incoming]()
    loop.call_later(0.01, queue.put_nowait, FRAME)
    assert await attempt._get(queue, loop.time() + 5) is FRAME
    assert attempt._timer is not None  # no new timer per frame
    first = attempt._timer
    loop.call_later(0.01, queue.put_nowait, NEXT)
    assert await attempt._get(queue, loop.time() + 6) is NEXT
    assert attempt._timer is first  # a later wake keeps the earlier timer
    first.cancel()


async def test_an_early_timer_is_rearmed_and_none_comes_at_the_wake() -> None:
    loop = asyncio.get_running_loop()
    attempt, queue = _attempt(), asyncio.Queue[Incoming]()
    loop.call_later(0.01, queue.put_nowait, FRAME)
    assert await attempt._get(queue, loop.time() + 0.05) is FRAME
    wake = loop.time() + 0.2  # the armed timer goes off first, early for this wait
    assert await attempt._get(queue, wake) is None
    assert loop.time() >= wake
    assert attempt._timer is None


async def test_a_sooner_wake_rearms_the_timer_sooner() -> None:
    loop = asyncio.get_running_loop()
    attempt, queue = _attempt(), asyncio.Queue[Incoming]()
    loop.call_later(0.01, queue.put_nowait, FRAME)
    assert await attempt._get(queue, loop.time() + 30) is FRAME
    wake = loop.time() + 0.02
    assert await asyncio.wait_for(attempt._get(queue, wake), 5) is None
    assert loop.time() >= wake

"""Owned tasks and the event wait that never swallows a cancellation."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable

import pytest

from genmesh.shared.tasks import TaskOwner, keep_cancel, wait_event

pytestmark = pytest.mark.unit


async def test_wait_event_reports_set_and_timeout() -> None:
    event = asyncio.Event()
    assert await wait_event(event, 0.01) is False
    event.set()
    assert await wait_event(event, 10) is True


async def _waiter_cancelled_as_event_is_set(
    wait: Callable[[asyncio.Event], Awaitable[object]],
) -> asyncio.Future[object]:
    """A task waiting on an event, cancelled in the same loop step as the event is set:
    the race in which Python 3.11's `wait_for` returns normally instead of raising."""
    event = asyncio.Event()
    task = asyncio.ensure_future(wait(event))
    for _ in range(3):
        await asyncio.sleep(0)  # let it start waiting
    event.set()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return task


async def test_wait_event_never_swallows_a_cancellation() -> None:
    task = await _waiter_cancelled_as_event_is_set(lambda ev: wait_event(ev, 10))
    assert task.cancelled()


async def test_a_loop_on_wait_event_stops_when_its_owner_closes() -> None:
    """The worker's announce loop in small: every pass waits for a change; the owner's
    close lands while a change is being signalled, and must still end the loop."""
    owner = TaskOwner("test")
    changed = asyncio.Event()
    passes = 0

    async def loop() -> None:
        nonlocal passes
        while True:
            passes += 1
            changed.clear()
            await wait_event(changed, 10)

    task = owner.spawn(loop(), name="loop")
    await asyncio.sleep(0)
    changed.set()
    await asyncio.wait_for(owner.close(), 2)
    assert task.cancelled()
    assert passes >= 1


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="the wait_for race is in Python 3.11")
async def test_the_race_is_real_on_this_python() -> None:
    """Shows why wait_event exists: here, wait_for loses the same cancellation."""

    async def with_wait_for(ev: asyncio.Event) -> None:
        await asyncio.wait_for(ev.wait(), 10)

    task = await _waiter_cancelled_as_event_is_set(with_wait_for)
    assert not task.cancelled()


async def test_close_does_not_wait_forever_on_a_task_that_ignores_its_cancel(
    caplog: pytest.LogCaptureFixture,
) -> None:
    owner = TaskOwner("test")
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass  # the defect being guarded against

    task = owner.spawn(stubborn(), name="stubborn")
    await asyncio.sleep(0)
    await asyncio.wait_for(owner.close(timeout=0.1), 2)
    assert not task.done()
    assert "task test: stubborn ignored its cancellation for 0.1s" in caplog.text
    release.set()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _like_nats_request(reply: asyncio.Future[str]) -> str:
    """nats-py's request in small: a reply future awaited under wait_for."""
    return await asyncio.wait_for(reply, 10)


async def _cancelled_as_the_reply_arrives(
    wrap: Callable[[Awaitable[str]], Awaitable[str]],
) -> asyncio.Future[object]:
    reply: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    task = asyncio.ensure_future(wrap(_like_nats_request(reply)))
    for _ in range(3):
        await asyncio.sleep(0)
    reply.set_result("pong")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return task


async def test_keep_cancel_raises_a_cancel_the_library_swallowed() -> None:
    task = await _cancelled_as_the_reply_arrives(keep_cancel)
    assert task.cancelled()


async def test_keep_cancel_passes_results_and_errors_through() -> None:
    done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    done.set_result("pong")
    assert await keep_cancel(done) == "pong"
    with pytest.raises(TimeoutError):
        await keep_cancel(asyncio.wait_for(asyncio.Event().wait(), 0.01))


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="the wait_for race is in Python 3.11")
async def test_without_keep_cancel_the_caller_carries_on() -> None:
    async def bare(aw: Awaitable[str]) -> str:
        return await aw

    task = await _cancelled_as_the_reply_arrives(bare)
    assert not task.cancelled()
    assert task.result() == "pong"

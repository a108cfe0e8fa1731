"""Owned background tasks: kept alive by a strong reference, logged when they fail,
cancelled and awaited on close. Every service spawns through one of these."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class TaskOwner:
    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    def spawn(self, coro: Coroutine[Any, Any, T], *, name: str) -> asyncio.Task[T]:
        if self._closed:
            coro.close()
            raise RuntimeError(f"{self.owner} is closed; cannot start {name}")
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.owner}: {name}")
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task %s failed", task.get_name(), exc_info=task.exception())

    def __len__(self) -> int:
        return len(self._tasks)

    @property
    def closed(self) -> bool:
        return self._closed

    async def close(self, timeout: float = 5.0) -> None:
        """Cancel every task and wait for them, at most `timeout` seconds: a task that
        ignores its cancellation is reported and left behind, never waited on forever."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if not tasks:
            return
        _, stuck = await asyncio.wait(tasks, timeout=timeout)
        for task in stuck:
            log.error("task %s ignored its cancellation for %gs", task.get_name(), timeout)


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait up to `timeout` seconds for `event`; True if it is set.

    Not `asyncio.wait_for(event.wait(), ...)`: on Python 3.11 that swallows a cancellation
    arriving as the event is set (CPython gh-86296), and a loop whose cancel is swallowed
    never stops (a worker kept announcing itself through its drain that way)."""
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def keep_cancel(awaitable: Awaitable[T]) -> T:
    """Await `awaitable`, and raise a cancellation it swallowed.

    Libraries built on `asyncio.wait_for` (nats-py's `request` and `flush`) lose, on
    Python 3.11, a cancel that arrives as their result does (CPython gh-86296): they
    return normally, and the cancelled caller carries on as if nothing happened. The
    task's count of cancel requests still shows it."""
    task = asyncio.current_task()
    before = task.cancelling() if task is not None else 0
    try:
        return await awaitable
    finally:
        if task is not None and task.cancelling() > before:
            raise asyncio.CancelledError

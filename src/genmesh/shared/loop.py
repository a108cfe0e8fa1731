"""The event loop a genmesh process runs on (`--event-loop`, declared in
`shared/connection.py`): uvloop by default, asyncio's own loop on request. uvloop's
libuv-based transports and callbacks cut the frontend's CPU per request, the path every
streamed token takes (docs/performance.md)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def _loop_factory(event_loop: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    if event_loop == "uvloop":
        import uvloop  # imported on use: parsing a command line stays quick

        return uvloop.new_event_loop
    return None  # asyncio's default loop


def run(main: Coroutine[Any, Any, T], event_loop: str) -> T:
    """`asyncio.run(main)` on the loop `event_loop` names ("uvloop" or "asyncio")."""
    with asyncio.Runner(loop_factory=_loop_factory(event_loop)) as runner:
        return runner.run(main)

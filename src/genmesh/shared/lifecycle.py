"""What every genmesh service and process does the same way: start and stop (`async with`),
stop on a signal, log to stderr."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import sys
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Self


class Service(ABC):
    """A service that starts and stops; `async with service:` runs it for the block."""

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def stop(self) -> None: ...

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# The exit status of a command stopped by Ctrl-C or SIGTERM, as a shell reports SIGINT.
STOPPED_BY_SIGNAL = 130
# A frontend's /health names its process, so that frontends sharing a port (SO_REUSEPORT)
# can be told apart by whoever waits for all of them (`genmesh up --frontends N`).
PID_HEADER = "X-Genmesh-Pid"


@contextlib.asynccontextmanager
async def stop_signals(*, insist: bool = False) -> AsyncIterator[asyncio.Event]:
    """An event set by SIGINT, SIGTERM or SIGHUP (a closed terminal). Enter it before
    announcing readiness, so that a supervisor's early SIGTERM still means a clean stop,
    not the default instant death.

    With `insist`, a signal after the first raises KeyboardInterrupt out of the event loop
    (whose runner then cancels every task): for a command whose clean stop still has work
    to do (`genmesh bench` reports what it measured), a second Ctrl-C means now."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if insist and stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal)
    try:
        yield stop
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)


# Allocations (less deallocations) of container objects between two young collections;
# CPython's default is 700. See `tune_gc`.
GC_YOUNG_THRESHOLD = 20_000


def tune_gc() -> None:
    """Set the garbage collector up for serving; call once, when the service is up.

    What the service built to start (modules, schemas, settings, connections) lives as
    long as the process: frozen, it is out of every later collection's walk. And a young
    generation of 700 objects is collected while the requests in flight still hold theirs
    (frames, envelopes, spans), which then survive into the older generations and set off
    full collections, on the event loop; at 20,000 they are mostly gone before the next
    collection. With tracing on (each request's spans) this cut the mesh's CPU by ~90 µs
    per request; off, it is neutral (docs/performance.md, "Levers")."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


def configure_logging(level: str, label: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s {label} %(levelname)s %(name)s: %(message)s",
    )

"""What every genmesh service and process does the same way: start and stop (`async with`),
stop on a signal, log to stderr."""

from __future__ import annotations

import asyncio
import contextlib
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
# A frontend's /health names its process, so that frontends sharing a port (SO_REUSEPORT)
# can be told apart by whoever waits for all of them (`genmesh up --frontends N`).
PID_HEADER = "X-Genmesh-Pid"


@contextlib.asynccontextmanager
async def stop_signals() -> AsyncIterator[asyncio.Event]:
    """An event set by SIGINT, SIGTERM or SIGHUP (a closed terminal). Enter it before
    announcing readiness, so that a supervisor's early SIGTERM still means a clean stop,
    not the default instant death."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    try:
        yield stop
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)


def configure_logging(level: str, label: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s {label} %(levelname)s %(name)s: %(message)s",
    )

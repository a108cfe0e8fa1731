"""A TCP proxy on loopback that can be cut and restored: one client's NATS node dying.

Services given the proxy's URL reach the real NATS server through it; `cut()` closes
their connections and refuses new ones until `restore()`, as a node that died and came
back would, while every other client of the server stays connected. A lone server
advertises no other URLs, so a cut client can only wait for the proxy to come back.

The proxy runs on an event loop of its own thread: the in-process meshes block the test's
loop while a service starts, and a service connects through the proxy then.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from genmesh.supervisor import free_port

T = TypeVar("T")
_PIPE_CHUNK = 1 << 16


class TcpProxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tcp-proxy")
        self._thread.daemon = True
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.connections = 0  # accepted so far

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def start(self) -> TcpProxy:
        self._thread.start()
        self.restore()
        return self

    def restore(self) -> None:
        """Listen again, on the same port."""

        async def listen() -> asyncio.Server:
            return await asyncio.start_server(self._accept, "127.0.0.1", self.port)

        self._server = self._run(listen())

    def cut(self) -> None:
        """Stop listening and drop every connection through the proxy."""

        async def cut() -> None:
            if self._server is not None:
                self._server.close()
                self._server = None
            for writer in list(self._writers):
                writer.transport.abort()
            self._writers.clear()

        self._run(cut())

    def close(self) -> None:
        self.cut()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_w.transport.abort()
            return
        self._writers |= {client_w, server_w}
        await asyncio.gather(self._pipe(client_r, server_w), self._pipe(server_r, client_w))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy until either side closes, then close both (a half-open NATS link is dead)."""
        with contextlib.suppress(OSError):
            while data := await reader.read(_PIPE_CHUNK):
                writer.write(data)
                await writer.drain()
        self._writers.discard(writer)
        writer.transport.abort()

"""A bound on the frontend's open HTTP connections (`--max-connections`).

aiohttp accepts every connection it is offered, and each holds a file descriptor and a
request handler until the client closes it (docs/limits.md): a client that opens
thousands would take descriptors from NATS and from every other client. Past the bound, a
new connection is answered 503 with `Retry-After: 1` and closed at once, before anything
is read from it. aiohttp has no such setting, so the listening socket is given a protocol
factory that counts: it wraps each connection's own protocol (aiohttp's request handler),
whose `connection_lost` gives the place back.
"""

from __future__ import annotations

import asyncio

from aiohttp import web


class _Counted(asyncio.Protocol):
    """aiohttp's protocol for one connection, counted while the connection is open."""

    __slots__ = ("inner", "limit")

    def __init__(self, inner: asyncio.Protocol, limit: ConnectionLimit) -> None:
        self.inner = inner
        self.limit = limit

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.limit.open -= 1
        self.inner.connection_lost(exc)


class _Refused(asyncio.Protocol):
    """A connection past the bound: the canned answer, then closed."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(self.answer)
        transport.close()


class ConnectionLimit:
    """The protocol factory of a listening socket: aiohttp's `server` for each of at most
    `limit` open connections (0: no bound), `answer` (a whole HTTP response) for more."""

    def __init__(self, server: web.Server, limit: int, answer: bytes) -> None:
        self.server = server
        self.limit = limit
        self.answer = answer
        self.open = 0

    def __call__(self) -> asyncio.Protocol:
        if self.limit and self.open >= self.limit:
            return _Refused(self.answer)
        self.open += 1
        return _Counted(self.server(), self)


def refusal(body: bytes) -> bytes:
    """The 503 a connection past the bound gets (`body`: JSON)."""
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "Content-Type: application/json; charset=utf-8\r\n"
        "Retry-After: 1\r\n"
        "Connection: close\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class BoundedTCPSite(web.TCPSite):
    """aiohttp's TCP site, listening through a `ConnectionLimit` instead of handing
    aiohttp's server to the socket directly (what `TCPSite.start` does, otherwise alike)."""

    def __init__(
        self,
        runner: web.AppRunner,
        host: str,
        port: int,
        *,
        limit: int,
        answer: bytes,
        reuse_port: bool,
    ) -> None:
        super().__init__(runner, host, port, reuse_port=reuse_port)
        self.limit = limit
        self.answer = answer
        self.connections: ConnectionLimit | None = None

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        server = self._runner.server
        assert server is not None
        self.connections = ConnectionLimit(server, self.limit, self.answer)
        self._server = await asyncio.get_running_loop().create_server(
            self.connections,
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )
        self._bound_port = self._server.sockets[0].getsockname()[1]

"""The shared generate handler: one request lifecycle for every format.

bind (format) -> running-ID check (the IDs the real server refuses to see twice) ->
readiness -> private ID -> dispatch (backend) -> frames rendered by the
format into SSE events or folded into a unary body -> cancel on client disconnect.
Nothing here knows a native field name.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any
from urllib.parse import quote

import orjson
from aiohttp import web

from genmesh.client import MIG, ClientFrame
from genmesh.formats.base import Bound, Exchange, GenerateFormat, RequestRejected
from genmesh.services.frontend.items import ItemRecords
from genmesh.services.frontend.observers import Observation, RequestInfo
from genmesh.services.frontend.running import RunningIds
from genmesh.services.frontend.state import FrontendState
from genmesh.shared import frames
from genmesh.shared.errors import ErrorCode, MeshError, http_status
from genmesh.shared.ids import MAX_CLIENT_ID_BYTES, id_problem, new_request_id

log = logging.getLogger(__name__)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
SSE_DONE = b"data: [DONE]\n\n"
SSE_KEEPALIVE = b": keep-alive\n\n"
TIMEOUT_HEADER = "X-Request-Timeout"


def dumps(obj: Any) -> str:
    """Compact JSON, as SGLang writes it (orjson: also the fastest on the per-token path).
    orjson refuses a lone surrogate (JSON's `"\\ud800"`, which a client may send in a field
    name that an error message then names); `json` writes it back escaped, as it came."""
    try:
        return orjson.dumps(obj).decode()
    except orjson.JSONEncodeError:
        return json.dumps(obj, separators=(",", ":"))


# What a client ID may carry into the `x-request-id` header as it is: visible ASCII but
# `%`. The rest is percent-encoded (UTF-8; docs/formats.md §1): CR/LF would end the
# header, NUL and non-ASCII are no header text. The body echoes the ID unchanged.
_HEADER_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if c != ord("%"))
_AS_IS = re.compile(r"[!-$&-~]*")  # the same characters: most IDs skip quote() (3 µs)


def header_id(public_id: str) -> str:
    """`public_id` as the value of the `x-request-id` header."""
    if _AS_IS.fullmatch(public_id):
        return public_id
    return quote(public_id, safe=_HEADER_SAFE, errors="surrogatepass")


def sse_event(payloads: list[Any]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(p) + b"\n\n" for p in payloads)


class GenerateHandler:
    def __init__(
        self,
        fmt: GenerateFormat,
        state: FrontendState,
        body_limit_bytes: int,
        body_timeout_s: float,
    ) -> None:
        self.format = fmt
        self.state = state
        self.body_limit_bytes = body_limit_bytes
        self.body_timeout_s = body_timeout_s
        # The running IDs (`Bound.running_ids`) of this format's requests in flight.
        self.running = RunningIds()

    def json_error(
        self, status: int, message: str, headers: dict[str, str] | None = None
    ) -> web.Response:
        return web.json_response(
            self.format.error_body(status, message), status=status, headers=headers, dumps=dumps
        )

    async def handle(self, request: web.Request) -> web.StreamResponse:
        info = RequestInfo(
            self.format.name, request.method, request.path, time.monotonic(), time.time()
        )
        info.headers = request.headers
        obs = Observation(self.state.observers, info)
        try:
            response = await self._handle(request, obs)
        except (asyncio.CancelledError, ConnectionResetError):
            obs.finished(499, ErrorCode.CANCELLED.value)
            raise
        except BaseException:
            obs.finished(500, ErrorCode.INTERNAL.value)
            raise
        obs.finished(response.status, obs.error_type)
        return response

    async def _handle(self, request: web.Request, obs: Observation) -> web.StreamResponse:
        info = obs.info
        try:
            async with asyncio.timeout(self.body_timeout_s):
                body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            obs.error_type = ErrorCode.INVALID_ARGUMENT.value
            return self.json_error(
                413, f"request body is larger than the limit of {self.body_limit_bytes} bytes"
            )
        except TimeoutError:
            # A body sent slowly holds a connection and a handler: cut off, and the
            # connection closed (what is left of the body is not read).
            obs.error_type = ErrorCode.INVALID_ARGUMENT.value
            late = self.json_error(
                408, f"request body did not arrive within {self.body_timeout_s:g} seconds"
            )
            late.force_close()
            return late
        info.body = body
        try:
            bound = self.format.bind(
                self.format.parse(body), request.headers, self.state.backend.engines()
            )
        except RequestRejected as rejected:
            obs.error_type = ErrorCode.INVALID_ARGUMENT.value
            return web.json_response(rejected.body, status=rejected.status, dumps=dumps)
        # Client IDs travel in every envelope (and one in a header): one the mesh cannot
        # carry is refused before anything runs, since no answer could name it.
        problem = client_id_problem(bound)
        if problem is not None:
            obs.error_type = ErrorCode.INVALID_ARGUMENT.value
            return self.json_error(400, problem)

        # The client IDs the real server would refuse to see twice while they run.
        duplicate = self.running.duplicate(bound.running_ids)
        if duplicate is not None:
            obs.error_type = ErrorCode.INVALID_ARGUMENT.value
            refusal = self.format.duplicate_id(duplicate)
            return web.json_response(refusal.body, status=refusal.status, dumps=dumps)
        with self.running.hold(bound.running_ids):
            return await self._dispatch(request, bound, obs)

    async def _dispatch(
        self, request: web.Request, bound: Bound, obs: Observation
    ) -> web.StreamResponse:
        info = obs.info
        public_id = bound.client_id or self.format.new_public_id()
        info.public_id, info.client_id, info.stream = public_id, bound.client_id, bound.stream
        headers = {"x-request-id": header_id(public_id)}
        try:
            timeout = self._timeout(request.headers)
        except ValueError as exc:
            obs.error_type = ErrorCode.INVALID_ARGUMENT.value
            return self.json_error(400, str(exc), headers)
        # From before a wait for NATS to reconnect (`ready`): the wait counts.
        deadline = None if timeout is None else time.time() + timeout
        not_ready = await self.state.backend.ready(timeout)
        if not_ready:
            obs.error_type = ErrorCode.UNAVAILABLE.value
            return self.json_error(503, not_ready, {**headers, "Retry-After": "1"})
        for envelope in bound.items:
            envelope.id = new_request_id()
            envelope.deadline = deadline
            # The ID the client sees is the one it can abort by (admin.py), even if it
            # did not choose one.
            envelope.client_id = envelope.client_id or public_id
        info.items = bound.items
        rid = (
            bound.items[0].id
            if len(bound.items) == 1
            else f"{bound.items[0].id}+{len(bound.items) - 1}"
        )
        exchange = self.format.exchange(bound, public_id, info.received_at)
        log.debug("request %s (client id %s) dispatched", rid, bound.client_id)
        obs.dispatched()
        stream = interleave(
            [
                self.state.backend.generate(item, no_migration=bound.migration)
                for item in bound.items
            ],
            obs,
        )
        try:
            async with contextlib.aclosing(stream):
                if bound.stream:
                    return await self._stream(
                        request, stream, exchange, headers, rid, len(bound.items), obs
                    )
                return await self._unary(stream, exchange, headers, rid, len(bound.items), obs)
        except asyncio.CancelledError:
            # Handler cancellation: the client disconnected. aclosing() published the cancels.
            log.info("request %s: client disconnected (499); cancelled", rid)
            raise

    def _timeout(self, headers: Mapping[str, str]) -> float | None:
        """The request's time limit: the configured one, or a shorter one it asks for."""
        limit = self.state.request_timeout_s
        asked = headers.get(TIMEOUT_HEADER)
        if asked is not None:
            try:
                seconds = float(asked)
            except ValueError:
                seconds = -1.0
            if not 0 < seconds < float("inf"):
                raise ValueError(f"{TIMEOUT_HEADER} must be a positive number of seconds")
            limit = seconds if limit is None else min(limit, seconds)
        return limit

    def _failure(self, error: MeshError, rid: str, public_id: str) -> tuple[int, MeshError]:
        status = http_status(error.code)
        if error.code is ErrorCode.INTERNAL:
            log.error("request %s failed: %s", rid, error.message)
            error = MeshError(ErrorCode.INTERNAL, f"Internal server error (request {public_id})")
        else:
            log.info("request %s failed: %s: %s", rid, error.code.value, error.message)
        return status, error

    def _error_response(
        self,
        exchange: Exchange,
        frame: frames.ErrFrame,
        headers: dict[str, str],
        rid: str,
        obs: Observation,
    ) -> web.Response:
        status, error = self._failure(frames.error_of(frame), rid, headers["x-request-id"])
        obs.error_type = error.code.value
        if status == 503:
            headers = {**headers, "Retry-After": "1"}
        return web.json_response(
            exchange.error(error, status), status=status, headers=headers, dumps=dumps
        )

    async def _unary(
        self,
        stream: AsyncIterator[tuple[int, ClientFrame]],
        exchange: Exchange,
        headers: dict[str, str],
        rid: str,
        count: int,
        obs: Observation,
    ) -> web.StreamResponse:
        items = [ItemRecords(self.format, exchange, i, stream=False) for i in range(count)]
        ended = 0
        async for index, frame in stream:
            if frame["t"] == frames.ERR:
                # One failed item fails the request; leaving cancels the others.
                return self._error_response(exchange, frame, headers, rid, obs)
            if frame["t"] == MIG:
                items[index].migrated()
            elif frame["t"] == frames.OUT or frame["t"] == frames.END:
                items[index].add(frame)
                if frame["t"] == frames.END:
                    ended += 1
                    if ended == count:
                        body = exchange.body([item.result() for item in items])
                        return web.json_response(body, headers=headers, dumps=dumps)
        raise AssertionError("reply streams ended without their terminal frames")

    async def _stream(
        self,
        request: web.Request,
        stream: AsyncIterator[tuple[int, ClientFrame]],
        exchange: Exchange,
        headers: dict[str, str],
        rid: str,
        count: int,
        obs: Observation,
    ) -> web.StreamResponse:
        # Prepared at the first frame that is not an error (`_write_stream`).
        response = SseResponse(headers={**SSE_HEADERS, **headers})
        try:
            return await self._write_stream(
                request, response, stream, exchange, headers, rid, count, obs
            )
        except ConnectionResetError as exc:
            # The client went away while we wrote: an INFO line, and the prepared response
            # back to aiohttp, which finds the connection gone without a word (raised, the
            # error would be logged with its traceback). Leaving the stream sends the cancels.
            log.info("request %s: client connection lost (%s); cancelled", rid, exc)
            obs.finished(499, ErrorCode.CANCELLED.value)
            return response

    async def _write_stream(
        self,
        request: web.Request,
        response: web.StreamResponse,
        stream: AsyncIterator[tuple[int, ClientFrame]],
        exchange: Exchange,
        headers: dict[str, str],
        rid: str,
        count: int,
        obs: Observation,
    ) -> web.StreamResponse:
        items = [ItemRecords(self.format, exchange, i, stream=True) for i in range(count)]
        ended = 0
        last = b""
        async for index, frame in stream:
            if frame["t"] == MIG:
                items[index].migrated()
                continue
            if frame["t"] == frames.ACK:
                continue
            if not response.prepared:
                # The status is committed only now, so errors before any output keep theirs.
                if frame["t"] == frames.ERR:
                    return self._error_response(exchange, frame, headers, rid, obs)
                await response.prepare(request)
            if frame["t"] == frames.KA:
                await response.write(SSE_KEEPALIVE)
            elif frame["t"] == frames.ERR:
                status, error = self._failure(frames.error_of(frame), rid, headers["x-request-id"])
                obs.error_type = error.code.value
                last = sse_event([exchange.error(error, status)]) + SSE_DONE
                break
            else:
                data = sse_event(exchange.sse(index, items[index].record(frame)))
                if frame["t"] == frames.END:
                    ended += 1
                    if ended == count:
                        last = data + sse_event(exchange.sse_end()) + SSE_DONE
                        break
                await response.write(data)
        assert response.prepared
        # The last events and the end of the chunked body leave in one write.
        await response.write_eof(last)
        return response


def client_id_problem(bound: Bound) -> str | None:
    """Why the mesh cannot carry one of a request's client IDs (each item's, which its
    envelope carries, and the request's, which the `x-request-id` header echoes)."""
    ids = [bound.client_id, *(item.client_id for item in bound.items)]
    for client_id in ids:
        problem = None if client_id is None else id_problem(client_id, MAX_CLIENT_ID_BYTES)
        if problem is not None:
            return f"the request ID is not accepted: {problem}"
    return None


class SseResponse(web.StreamResponse):
    """A stream whose headers leave with its first event, in one write (a send costs
    about as much CPU as rendering an event): aiohttp's `Response` buffers them so, a
    `StreamResponse` sends them on `prepare()` unless this class attribute says not to."""

    _send_headers_immediately = False


async def interleave(
    streams: list[AsyncGenerator[ClientFrame, None]], obs: Observation
) -> AsyncGenerator[tuple[int, ClientFrame], None]:
    """Frames of several streams as they arrive, tagged with their stream's index and shown
    to the request's observers on the way (here, not in a layer of their own: every
    generator a frame passes through costs it a resumption). Closing this closes every
    stream (each cancels its request if it has not ended)."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for frame in only:
                obs.frame(0, frame)
                yield 0, frame
        return
    queue: asyncio.Queue[tuple[int, ClientFrame | None]] = asyncio.Queue()

    async def pump(index: int, source: AsyncGenerator[ClientFrame, None]) -> None:
        async with contextlib.aclosing(source):
            async for frame in source:
                queue.put_nowait((index, frame))
        queue.put_nowait((index, None))

    pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(streams)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            else:
                obs.frame(index, item)
                yield index, item
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)

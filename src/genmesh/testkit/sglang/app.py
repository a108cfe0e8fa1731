"""The mock SGLang server's application: `build_app`, `/generate` and `/abort_request`.

A /generate request is checked (`request`, `normalize`), its items run in the scheduler
(`schedule`), and the handler turns their events into one JSON reply or an SSE stream,
aborting every rid of the request when its client goes away (SGLang matches by prefix).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from aiohttp import web

from genmesh.engines.faults import Fault, ServerState
from genmesh.testkit.common import add_admin_routes
from genmesh.testkit.config import MockServerConfig
from genmesh.testkit.kv_events import add_kv_event_routes
from genmesh.testkit.pd import add_pd_routes
from genmesh.testkit.sglang.info import InfoRoutes
from genmesh.testkit.sglang.normalize import Item
from genmesh.testkit.sglang.request import JSON, Malformed, Rejected, as_bool, check_body
from genmesh.testkit.sglang.response import (
    DONE,
    error_response,
    fault_response,
    http_exception,
    json_response,
    malformed_response,
    sse,
)
from genmesh.testkit.sglang.schedule import Event, Generation, Scheduler

# How often a handler waiting for tokens checks that its client is still there.
_DISCONNECT_POLL_S = 0.5


@dataclass(slots=True)
class _Exchange:
    """One /generate HTTP request in flight."""

    request: web.Request
    rids: list[str]
    single: bool
    queue: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    dropped: bool = False


class SglangServer:
    """The `/generate` and `/abort_request` handlers, in front of the scheduler."""

    def __init__(self, config: MockServerConfig, state: ServerState) -> None:
        self.config = config
        self.state = state
        self.scheduler = Scheduler(config, state)

    async def abort_request(self, request: web.Request) -> web.Response:
        arrived = time.time()
        raw = await request.read()
        try:
            body = json.loads(raw) if raw.strip() else None
        except ValueError:
            body = None
        rid = body.get("rid", "") if isinstance(body, dict) else None
        abort_all = as_bool(body.get("abort_all", False)) if isinstance(body, dict) else None
        if not isinstance(rid, str) or abort_all is None:
            err = {"type": "model_type", "loc": ("body",), "msg": "Input should be an AbortReq"}
            return malformed_response(Malformed([{**err, "input": body}]))
        self.state.abort_calls.append({"ids": ["*"] if abort_all else [rid], "at": arrived})
        self.scheduler.abort(rid, abort_all=abort_all)
        return web.Response(status=200)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        created = time.monotonic()
        if "traceparent" in request.headers:
            self.state.traceparents.append(request.headers["traceparent"])
        fault = self.state.next_fault()
        if fault is not None and fault.kind == "http_error":
            return fault_response(fault)
        try:
            body = check_body(await request.read())
        except Malformed as exc:
            return malformed_response(exc)
        if not body.get("stream", False):
            try:
                items, single = self.scheduler.admit(body)
            except Rejected as exc:
                return error_response(str(exc))
            exchange = _Exchange(request, [it.rid for it in items], single)
            return await self._serve(exchange, items, fault, created, None)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        try:
            items, single = self.scheduler.admit(body)
        except Rejected as exc:
            # The stream has started: the error travels in-band.
            await resp.write(sse({"error": {"message": str(exc)}}))
            await resp.write(DONE)
            await resp.write_eof()
            return resp
        exchange = _Exchange(request, [it.rid for it in items], single)
        return await self._serve(exchange, items, fault, created, resp)

    async def _serve(
        self,
        ex: _Exchange,
        items: list[Item],
        fault: Fault | None,
        created: float,
        resp: web.StreamResponse | None,
    ) -> web.StreamResponse:
        generations = [
            Generation(
                self.scheduler,
                item,
                fault,
                stream=resp is not None,
                created=created,
                queue=ex.queue,
            )
            for item in items
        ]
        tasks = [asyncio.create_task(g.run()) for g in generations]
        try:
            if resp is None:
                return await self._unary(ex, len(items))
            return await self._stream(ex, resp, len(items))
        except ConnectionResetError:  # a write to a client that has gone
            self._client_gone(ex)
            return resp if resp is not None else web.Response()
        except asyncio.CancelledError:  # aiohttp cancels the handler on disconnect
            self._client_gone(ex)
            raise
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _client_gone(self, ex: _Exchange) -> None:
        """The client went away: SGLang aborts every rid of the request (prefix match)."""
        if ex.dropped:
            return
        self.state.disconnected.extend(ex.rids)
        for rid in ex.rids:
            self.scheduler.abort(rid)

    async def _next(self, ex: _Exchange) -> Event:
        """The next event; notices a client that has gone even if aiohttp does not cancel
        the handler (SGLang polls `request.is_disconnected()` the same way)."""
        getter = asyncio.ensure_future(ex.queue.get())
        try:
            while True:
                done, _ = await asyncio.wait({getter}, timeout=_DISCONNECT_POLL_S)
                if done:
                    return getter.result()
                transport = ex.request.transport
                if transport is None or transport.is_closing():
                    raise ConnectionResetError("the client went away")
        finally:
            getter.cancel()

    async def _unary(self, ex: _Exchange, count: int) -> web.StreamResponse:
        finals: dict[int, JSON] = {}
        while len(finals) < count:
            ev = await self._next(ex)
            if ev.kind == "crash":
                raise web.HTTPInternalServerError(text="mock generation failed")
            if ev.kind == "fault" and ev.fault == "drop":
                self._drop(ex)
                return web.Response()
            if ev.kind in ("final", "fault") and ev.payload is not None:
                finals[ev.index] = ev.payload  # a fault's payload: no finish reason
        outs = [finals[i] for i in range(count)]
        for out in outs:
            # _handle_abort_finish_reason: scheduler aborts with a status become errors.
            reason = out["meta_info"].get("finish_reason")
            if isinstance(reason, dict) and reason.get("type") == "abort":
                status = reason.get("status_code")
                if status == 400:
                    return error_response(reason["message"])
                if status in (500, 503):
                    return http_exception(status, reason["message"])
        return json_response(outs[0] if ex.single else outs)

    async def _stream(
        self, ex: _Exchange, resp: web.StreamResponse, count: int
    ) -> web.StreamResponse:
        pending = count
        while pending:
            ev = await self._next(ex)
            if ev.kind == "crash":
                raise RuntimeError("mock generation failed")
            if ev.kind == "fault":
                if ev.fault == "drop":
                    await self._flush(ex)
                    self._drop(ex)
                    return resp
                if ev.fault == "done_early":
                    await resp.write(DONE)
                await resp.write_eof()  # no_terminal: a clean end, without a terminal chunk
                return resp
            assert ev.payload is not None
            out = ev.payload
            if not ex.single:
                out["index"] = ev.index
            await resp.write(sse(out))
            if ev.kind == "final":
                pending -= 1
        await resp.write(DONE)
        await resp.write_eof()
        return resp

    async def _flush(self, ex: _Exchange) -> None:
        transport = ex.request.transport
        for _ in range(200):
            if transport is None or transport.get_write_buffer_size() == 0:
                return
            await asyncio.sleep(0.005)

    def _drop(self, ex: _Exchange) -> None:
        ex.dropped = True
        transport = ex.request.transport
        if transport is not None:
            transport.abort()


def build_app(config: MockServerConfig) -> web.Application:
    """The mock SGLang server for `config`, with the `/testkit/` admin routes."""
    state = ServerState(token_delay_s=config.token_delay_ms / 1000)
    server = SglangServer(config, state)
    info = InfoRoutes(server.scheduler)
    app = web.Application(client_max_size=1 << 30)
    add_admin_routes(app, state)
    if server.scheduler.cache is not None:
        add_kv_event_routes(app, server.scheduler.cache.publisher)
    if config.disaggregation_mode != "null":
        add_pd_routes(app, server.scheduler.handles)
    app.router.add_route("POST", "/generate", server.generate)
    app.router.add_route("PUT", "/generate", server.generate)
    app.router.add_post("/abort_request", server.abort_request)
    app.router.add_get("/health", info.health)
    app.router.add_get("/health_generate", info.health_generate)
    for path in ("/get_model_info", "/model_info"):
        app.router.add_get(path, info.model_info)
    for path in ("/get_server_info", "/server_info"):
        app.router.add_get(path, info.server_info)
    app.router.add_get("/v1/models", info.models)
    app.router.add_get("/v1/models/{model:.+}", info.model_card)
    app.router.add_route("GET", "/flush_cache", info.flush_cache)
    app.router.add_route("POST", "/flush_cache", info.flush_cache)
    return app

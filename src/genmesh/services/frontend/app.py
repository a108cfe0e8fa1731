"""The HTTP frontend: format routes plus the endpoints SGLang tooling probes (the info
routes: `info.py`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CollectorRegistry

from genmesh.formats.base import GenerateFormat
from genmesh.services.frontend.admin import add_admin_routes, auth_middlewares
from genmesh.services.frontend.generate import GenerateHandler, dumps
from genmesh.services.frontend.info import add_info_routes
from genmesh.services.frontend.state import FrontendState
from genmesh.shared import frames
from genmesh.shared.envelope import Envelope, Sampling, TokenIds
from genmesh.shared.ids import new_request_id
from genmesh.shared.lifecycle import PID_HEADER
from genmesh.shared.metrics import METRICS_PATH, metrics_handler

log = logging.getLogger(__name__)

STATE = web.AppKey("state", FrontendState)
HEALTH_GENERATE_TIMEOUT_S = 20.0


def build_app(
    state: FrontendState,
    formats: list[GenerateFormat],
    *,
    body_limit_bytes: int,
    body_timeout_s: float = 60.0,
    metrics: CollectorRegistry | None = None,
    api_key: str | None = None,
    admin_api_key: str | None = None,
) -> web.Application:
    app = web.Application(
        client_max_size=body_limit_bytes,
        middlewares=[json_method_errors(formats), *auth_middlewares(api_key, admin_api_key)],
    )
    app[STATE] = state
    for fmt in formats:
        handler = GenerateHandler(fmt, state, body_limit_bytes, body_timeout_s)
        for route in fmt.routes:
            app.router.add_route(route.method, route.path, handler.handle)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)
    add_info_routes(app, state)
    add_admin_routes(app, state)
    if metrics is not None:
        app.router.add_get(METRICS_PATH, metrics_handler(metrics))
    return app


def json_method_errors(formats: list[GenerateFormat]) -> Any:
    """A middleware: aiohttp answers a method a route does not take with a text/plain 405;
    this answers JSON, as SGLang's and vLLM's FastAPI apps do: in the shape of the format
    whose route it is, else of the format that serves `/generate` (the first)."""
    by_path = {route.path: fmt for fmt in formats for route in fmt.routes}

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPMethodNotAllowed as exc:
            fmt = by_path.get(request.path, formats[0])
            return web.json_response(
                fmt.error_body(405, "Method Not Allowed"),
                status=405,
                headers={"Allow": exc.headers["Allow"]},
                dumps=dumps,
            )

    return middleware


async def health(request: web.Request) -> web.Response:
    """200 once NATS is connected and a worker is known; 503 (with the reason) before."""
    reason = request.app[STATE].backend.not_ready_reason()
    if reason:
        return web.Response(status=503, text=reason)
    return web.Response(status=200, headers={PID_HEADER: str(os.getpid())})


async def health_generate(request: web.Request) -> web.Response:
    """Generates one token through the whole mesh, as SGLang's probe does."""
    state = request.app[STATE]
    reason = state.backend.not_ready_reason()
    if reason:
        return web.Response(status=503, text=reason)
    envelope = Envelope(
        id=new_request_id(),
        token_ids=TokenIds([0]),
        format="sglang",
        client_id="HEALTH_CHECK",
        sampling=Sampling(max_tokens=1, temperature=0.0),
    )
    stream = state.backend.generate(envelope)
    with contextlib.suppress(TimeoutError):
        async with contextlib.aclosing(stream), asyncio.timeout(HEALTH_GENERATE_TIMEOUT_S):
            async for frame in stream:
                if frame["t"] in (frames.OUT, frames.END):
                    return web.Response(status=200)
                if frame["t"] == frames.ERR:
                    return web.Response(status=503, text=str(frame.get("message")))
    return web.Response(status=503, text="health generation timed out")

"""The mock vLLM server's application: `build_app` and its routes.

Extra admin route (besides `/testkit/...` from `common`): `GET /testkit/vllm/requests`
lists the generate requests the mock accepted (`{"request_id", "headers", "body"}`, the
last 1000), `DELETE` clears it; adapter tests assert on what was sent.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import deque
from typing import Any, Literal

from aiohttp import web

from genmesh.engines.faults import ServerState
from genmesh.testkit.common import STATE as STATE_KEY
from genmesh.testkit.common import add_admin_routes
from genmesh.testkit.config import MockServerConfig
from genmesh.testkit.kv_cache import server_cache
from genmesh.testkit.kv_events import add_kv_event_routes
from genmesh.testkit.pd import Handles, add_pd_routes
from genmesh.testkit.vllm import pd
from genmesh.testkit.vllm.errors import ApiError, error_body
from genmesh.testkit.vllm.info import metrics_handler
from genmesh.testkit.vllm.request import (
    GENERATE_PATH,
    GenerateOptions,
    engine_check,
    parse_generate,
)
from genmesh.testkit.vllm.response import (
    error_response,
    http_exception,
    json_response,
    sse_error,
)
from genmesh.testkit.vllm.schedule import KV_BLOCK_SIZE, ClientGone, Engine, Run

Profile = Literal["new", "old"]
PROFILES: tuple[str, ...] = ("new", "old")

VLLM_VERSION = "0.20.0+genmesh.mock"
_REQUEST_LOG_LIMIT = 1000

ENGINE = web.AppKey("vllm_engine", Engine)
REQUEST_LOG = web.AppKey("vllm_request_log", deque[dict[str, Any]])


async def _generate(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    config = engine.config
    if "traceparent" in request.headers:
        engine.state.traceparents.append(request.headers["traceparent"])
    raw = await request.read()
    try:
        options, body = parse_generate(raw, request.headers, config, engine.profile)
        if options.model is not None and options.model != config.model:
            raise ApiError(f"The model `{options.model}` does not exist.", 404, "model")
    except ApiError as exc:
        return error_response(exc)
    _log_request(request, options, body)
    problem = engine_check(options, config)
    if problem is None and config.disaggregation_mode == "decode":
        try:
            await pd.receive(options.kv_transfer_params, config.disaggregation_timeout_s)
        except ApiError as exc:
            problem = exc
    if problem is None:
        return await _run(request, options, engine)
    if not options.stream:
        return error_response(problem)
    # vLLM has sent its stream headers by the time the engine refuses: the error is in-band.
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await response.prepare(request)
    await response.write(sse_error(problem))
    await response.write_eof()
    return response


def _log_request(request: web.Request, options: GenerateOptions, body: dict[str, Any]) -> None:
    headers = {
        name: request.headers[name]
        for name in ("X-Request-Id", "X-data-parallel-rank")
        if name in request.headers
    }
    request.app[REQUEST_LOG].append(
        {"request_id": options.engine_id, "headers": headers, "body": body}
    )


async def _run(
    request: web.Request, options: GenerateOptions, engine: Engine
) -> web.StreamResponse:
    """Run an accepted request to its end, whatever the end is."""
    state = engine.state
    fault = state.next_fault()
    key, running = engine.admit(options.engine_id)
    run = Run(request, options, engine, running, fault, key)
    try:
        if fault is not None and fault.kind == "http_error" and fault.after_tokens <= 0:
            return json_response(error_body(fault.message, fault.status), fault.status)
        return await run.execute()
    except asyncio.CancelledError:
        if not run.dropped:
            state.disconnected.append(key)
        raise
    except ClientGone:
        state.disconnected.append(key)
        return run.response if run.response is not None else web.Response(status=499)
    finally:
        run.release_blocks()
        engine.release(key, running, completed=run.completed)


async def _abort_requests(request: web.Request) -> web.Response:
    """`POST /abort_requests` (tokens-only servers): fire and forget, 200 with no body."""
    arrived = time.time()
    try:
        body = json.loads(await request.read())
    except ValueError as exc:
        return http_exception(400, f"JSON decode error: {exc}")
    if not isinstance(body, dict):
        return http_exception(400, "request body must be a JSON object")
    ids = body.get("request_ids")
    if ids is None:
        return http_exception(400, "Missing 'request_ids' in request body")
    if isinstance(ids, str):
        ids = [ids]
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        return http_exception(400, "'request_ids' must be a list of strings")
    engine = request.app[ENGINE]
    engine.state.abort_calls.append({"ids": list(ids), "at": arrived})
    engine.abort(set(ids))
    return web.Response(status=200)


async def _reset_prefix_cache(request: web.Request) -> web.Response:
    """`POST /reset_prefix_cache` (vLLM's dev-mode route): 200 with no body. The cache is
    emptied (an AllBlocksCleared event) unless a request holds blocks, which vLLM's
    `reset_prefix_cache` refuses too."""
    engine = request.app[ENGINE]
    engine.state.flush_calls += 1
    if engine.cache is not None:
        engine.cache.clear()
    return web.Response(status=200)


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200 if request.app[STATE_KEY].healthy else 503)


async def _models(request: web.Request) -> web.Response:
    config = request.app[ENGINE].config
    created = int(time.time())
    return json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": config.model,
                    "object": "model",
                    "created": created,
                    "owned_by": "vllm",
                    "root": config.model,
                    "parent": None,
                    "max_model_len": config.max_model_len,
                    "permission": [
                        {
                            "id": f"modelperm-{uuid.uuid4().hex}",
                            "object": "model_permission",
                            "created": created,
                            "allow_create_engine": False,
                            "allow_sampling": True,
                            "allow_logprobs": True,
                            "allow_search_indices": False,
                            "allow_view": True,
                            "allow_fine_tuning": False,
                            "organization": "*",
                            "group": None,
                            "is_blocking": False,
                        }
                    ],
                }
            ],
        }
    )


async def _version(request: web.Request) -> web.Response:
    return json_response({"version": VLLM_VERSION})


async def _requests_log(request: web.Request) -> web.Response:
    log = request.app[REQUEST_LOG]
    return json_response({"requests": list(log)})


async def _clear_requests_log(request: web.Request) -> web.Response:
    request.app[REQUEST_LOG].clear()
    return web.Response()


@web.middleware
async def _fastapi_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Unknown routes and methods answer as FastAPI does: `{"detail": ...}`."""
    try:
        response: web.StreamResponse = await handler(request)
    except web.HTTPNotFound:
        return json_response({"detail": "Not Found"}, 404)
    except web.HTTPMethodNotAllowed:
        return json_response({"detail": "Method Not Allowed"}, 405)
    return response


def build_app(config: MockServerConfig, *, profile: Profile = "new") -> web.Application:
    """The mock vLLM server as an aiohttp application (run it with
    `genmesh.testkit.serving`)."""
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {', '.join(PROFILES)}, got {profile!r}")
    if config.vocab_size < 2 or not 0 <= config.eos_token_id < config.vocab_size:
        raise ValueError("the vocabulary must hold at least 2 tokens, EOS among them")
    app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=[_fastapi_errors])
    state = ServerState(token_delay_s=config.token_delay_ms / 1000)
    add_admin_routes(app, state)
    cache = server_cache("vllm", config, config.block_size or KV_BLOCK_SIZE)
    handles = None
    if config.disaggregation_mode != "null":
        handles = Handles(config.disaggregation_mode, config.disaggregation_timeout_s)
        add_pd_routes(app, handles)
    prefill_handles = handles if config.disaggregation_mode == "prefill" else None
    app[ENGINE] = Engine(config, profile, state, cache=cache, handles=prefill_handles)
    if cache is not None:
        add_kv_event_routes(app, cache.publisher)
    app[REQUEST_LOG] = deque(maxlen=_REQUEST_LOG_LIMIT)
    app.router.add_post(GENERATE_PATH, _generate)
    if config.tokens_only:
        app.router.add_post("/abort_requests", _abort_requests)
    app.router.add_post("/reset_prefix_cache", _reset_prefix_cache)
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/version", _version)
    app.router.add_get("/metrics", metrics_handler(config))
    app.router.add_get("/testkit/vllm/requests", _requests_log)
    app.router.add_delete("/testkit/vllm/requests", _clear_requests_log)
    return app


def state_of(app: web.Application) -> ServerState:
    """The app's generation state (what `/testkit/state` reports)."""
    return app[STATE_KEY]

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
from genmesh.testkit.common import MockServerConfig, add_admin_routes
from genmesh.testkit.vllm.request import (
    ENGINE_ID_PREFIX,
    GENERATE_PATH,
    engine_check,
    parse_generate,
)
from genmesh.testkit.vllm.response import (
    ApiError,
    dumps,
    error_body,
    http_exception,
    json_response,
)
from genmesh.testkit.vllm.schedule import ClientGone, Engine, Run

Profile = Literal["new", "old"]

PROFILES: tuple[str, ...] = ("new", "old")

VLLM_VERSION = "0.20.0+genmesh.mock"

_REQUEST_LOG_LIMIT = 1000

ENGINE = web.AppKey("vllm_engine", Engine)

REQUEST_LOG = web.AppKey("vllm_request_log", deque[dict[str, Any]])


async def _generate(request: web.Request) -> web.StreamResponse:
    app = request.app
    engine = app[ENGINE]
    config, profile, state = engine.config, engine.profile, engine.state
    if "traceparent" in request.headers:
        state.traceparents.append(request.headers["traceparent"])
    raw = await request.read()
    try:
        options, body = parse_generate(raw, request.headers, config, profile)
        if options.model is not None and options.model != config.model:
            raise ApiError(f"The model `{options.model}` does not exist.", 404, "model")
    except ApiError as exc:
        return exc.response()
    log = app[REQUEST_LOG]
    log.append(
        {
            "request_id": options.engine_id,
            "headers": {
                name: request.headers[name]
                for name in ("X-Request-Id", "X-data-parallel-rank")
                if name in request.headers
            },
            "body": body,
        }
    )
    problem = engine_check(options, config)
    if problem is not None:
        if not options.stream:
            return problem.response()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        await response.write(f"data: {dumps(problem.body())}\n\ndata: [DONE]\n\n".encode())
        await response.write_eof()
        return response

    fault = state.next_fault()
    key = options.engine_id
    suffix = 0
    while key in state.running:  # a duplicate id: vLLM tells them apart internally
        suffix += 1
        key = f"{options.engine_id}#{suffix}"
    running = state.start(key)
    engine_ids = engine.engine_ids
    engine_ids[key] = options.engine_id
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
        engine_ids.pop(key, None)
        state.finish(running, completed=run.completed)


async def _abort_requests(request: web.Request) -> web.Response:
    """`POST /abort_requests` (tokens-only servers): fire and forget, 200 with no body.
    vLLM knows requests by their engine id; the bare id is accepted too."""
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
    wanted = set(ids)
    state = request.app[STATE_KEY]
    state.abort_calls.append({"ids": list(ids), "at": arrived})
    engine_ids = request.app[ENGINE].engine_ids

    def matches(key: str) -> bool:
        engine_id = engine_ids.get(key)
        if engine_id is None or state.running[key].aborted.is_set():
            return False
        return engine_id in wanted or engine_id.removeprefix(ENGINE_ID_PREFIX) in wanted

    state.abort_matching(matches)
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
    app[ENGINE] = Engine(config, profile, state)
    app[REQUEST_LOG] = deque(maxlen=_REQUEST_LOG_LIMIT)
    app.router.add_post(GENERATE_PATH, _generate)
    if config.tokens_only:
        app.router.add_post("/abort_requests", _abort_requests)
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/version", _version)
    app.router.add_get("/testkit/vllm/requests", _requests_log)
    app.router.add_delete("/testkit/vllm/requests", _clear_requests_log)
    return app


def state_of(app: web.Application) -> ServerState:
    """The app's generation state (what `/testkit/state` reports)."""
    return app[STATE_KEY]

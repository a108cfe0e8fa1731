"""The HTTP frontend: format routes plus the endpoints SGLang tooling probes."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiohttp import web
from prometheus_client import CollectorRegistry

from genmesh import __version__
from genmesh.formats.base import GenerateFormat
from genmesh.services.frontend.admin import add_admin_routes, auth_middlewares
from genmesh.services.frontend.generate import GenerateHandler, dumps
from genmesh.services.frontend.state import FrontendState
from genmesh.shared import frames
from genmesh.shared.envelope import Envelope, Sampling
from genmesh.shared.ids import new_request_id
from genmesh.shared.metrics import METRICS_PATH, metrics_handler

log = logging.getLogger(__name__)

STATE = web.AppKey("state", FrontendState)
HEALTH_GENERATE_TIMEOUT_S = 20.0
PRIVATE_CARD_FIELDS = frozenset(("engine_url", "host", "pid", "subject"))


def build_app(
    state: FrontendState,
    formats: list[GenerateFormat],
    *,
    body_limit_bytes: int,
    metrics: CollectorRegistry | None = None,
    api_key: str | None = None,
    admin_api_key: str | None = None,
) -> web.Application:
    app = web.Application(
        client_max_size=body_limit_bytes, middlewares=auth_middlewares(api_key, admin_api_key)
    )
    app[STATE] = state
    for fmt in formats:
        handler = GenerateHandler(fmt, state, body_limit_bytes)
        for route in fmt.routes:
            app.router.add_route(route.method, route.path, handler.handle)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)
    for path in ("/get_model_info", "/model_info"):
        app.router.add_get(path, model_info)
    for path in ("/get_server_info", "/server_info"):
        app.router.add_get(path, server_info)
    app.router.add_get("/v1/models", list_models)
    add_admin_routes(app, state)
    if metrics is not None:
        app.router.add_get(METRICS_PATH, metrics_handler(metrics))
    return app


async def health(request: web.Request) -> web.Response:
    """200 once NATS is connected and a worker is known; 503 (with the reason) before."""
    reason = request.app[STATE].backend.not_ready_reason()
    if reason:
        return web.Response(status=503, text=reason)
    return web.Response(status=200)


async def health_generate(request: web.Request) -> web.Response:
    """Generates one token through the whole mesh, as SGLang's probe does."""
    state = request.app[STATE]
    reason = state.backend.not_ready_reason()
    if reason:
        return web.Response(status=503, text=reason)
    envelope = Envelope(
        id=new_request_id(),
        token_ids=[0],
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


async def model_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response(
        {
            "model_path": state.models()[0],
            "tokenizer_path": None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": None,
            "architectures": None,
        },
        dumps=dumps,
    )


async def server_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    workers = state.backend.workers()
    max_len = state.engine_info().context_length
    return web.json_response(
        {
            "model_path": state.models()[0],
            "tokenizer_path": None,
            "skip_tokenizer_init": True,
            "incremental_streaming_output": True,
            "stream_output": True,
            "disaggregation_mode": "null",
            "tp_size": 1,
            "dp_size": 1,
            "context_length": max_len,
            "max_req_input_len": None if max_len is None else max_len - 1,
            "version": f"genmesh-{__version__}",
            "internal_states": [{"num_workers": len(workers)}],
            "genmesh": {
                "namespace": state.namespace,
                "ready": state.backend.not_ready_reason() is None,
                # Cards without the addresses behind the mesh: this page is public.
                "workers": [
                    {k: v for k, v in card.items() if k not in PRIVATE_CARD_FIELDS}
                    for card in workers
                ],
            },
        },
        dumps=dumps,
    )


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": model,
                    "object": "model",
                    "created": int(state.started),
                    "owned_by": "genmesh",
                    "root": model,
                    "max_model_len": state.engine_info(model).context_length,
                }
                for model in state.models()
            ],
        },
        dumps=dumps,
    )

"""The frontend's info routes, answered as SGLang and vLLM answer them, from what the
workers' engines advertise (their cards' `engine_info`, the frontend's `EngineCatalog`).

SGLang's `/server_info` is its ServerArgs flattened, then the scheduler's init info
(`status`, `max_total_num_tokens`, `max_req_input_len`), `internal_states` and `version`;
its `/model_info` is a fixed set of keys (its docs notebook asserts them). Both report one
model: a mesh that serves several reports the first here and every one in `/v1/models`.
The old names (`/get_server_info`, `/get_model_info`) answer the same. A limit no worker
advertises is null.
"""

from __future__ import annotations

import json

from aiohttp import web

from genmesh import __version__
from genmesh.services.frontend.generate import dumps
from genmesh.services.frontend.state import FrontendState
from genmesh.shared.engine_info import EngineInfo

# Card fields that would tell the public where the mesh's engines and workers live.
PRIVATE_CARD_FIELDS = frozenset(("engine_url", "host", "pid", "subject"))
# SGLang's scheduler keeps this many tokens of a request's room back from its input.
_SGLANG_INPUT_RESERVE = 5


def add_info_routes(app: web.Application, state: FrontendState) -> None:
    routes = InfoRoutes(state)
    for path in ("/get_model_info", "/model_info"):
        app.router.add_get(path, routes.model_info)
    for path in ("/get_server_info", "/server_info"):
        app.router.add_get(path, routes.server_info)
    app.router.add_get("/v1/models", routes.list_models)


def max_req_input_len(info: EngineInfo) -> int | None:
    """SGLang's longest input (tp_worker.py): `min(context_len - 1, pool - 1) - 5`."""
    limits = [n - 1 for n in (info.context_length, info.max_total_num_tokens) if n is not None]
    return min(limits) - _SGLANG_INPUT_RESERVE if limits else None


def preferred_sampling_params(info: EngineInfo) -> str | None:
    """The defaults as SGLang reports `--preferred-sampling-params`: its JSON text."""
    return json.dumps(dict(info.sampling_defaults)) if info.sampling_defaults else None


class InfoRoutes:
    """The info routes' handlers, on one frontend's state."""

    def __init__(self, state: FrontendState) -> None:
        self.state = state

    async def model_info(self, request: web.Request) -> web.Response:
        return model_info(self.state)

    async def server_info(self, request: web.Request) -> web.Response:
        return server_info(self.state)

    async def list_models(self, request: web.Request) -> web.Response:
        return list_models(self.state)


def model_info(state: FrontendState) -> web.Response:
    info = state.engine_info()
    return web.json_response(
        {
            "model_path": info.model,
            "tokenizer_path": None,
            "is_generation": True,
            "preferred_sampling_params": preferred_sampling_params(info),
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": None,
            "architectures": None,
        },
        dumps=dumps,
    )


def server_info(state: FrontendState) -> web.Response:
    workers = state.backend.workers()
    catalog = state.backend.engines()
    info = state.engine_info()
    return web.json_response(
        {
            # ServerArgs
            "model_path": info.model,
            "tokenizer_path": None,
            "served_model_name": info.model,
            "skip_tokenizer_init": True,
            "incremental_streaming_output": True,
            "stream_output": True,
            "disaggregation_mode": "null",
            "tp_size": 1,
            "dp_size": 1,
            "context_length": info.context_length,
            "page_size": info.block_size,
            "preferred_sampling_params": preferred_sampling_params(info),
            # the scheduler's init info
            "status": "ready",
            "max_total_num_tokens": info.max_total_num_tokens,
            "max_req_input_len": max_req_input_len(info),
            "internal_states": [{"num_workers": len(workers)}],
            "version": f"genmesh-{__version__}",
            "genmesh": {
                "namespace": state.namespace,
                "ready": state.backend.not_ready_reason() is None,
                # Each model's engine info over its workers (the tightest limits).
                "engines": {m: i.to_wire() for m in catalog.models if (i := catalog.get(m))},
                # Cards without the addresses behind the mesh: this page is public.
                "workers": [
                    {k: v for k, v in card.items() if k not in PRIVATE_CARD_FIELDS}
                    for card in workers
                ],
            },
        },
        dumps=dumps,
    )


def list_models(state: FrontendState) -> web.Response:
    """vLLM's (and SGLang's) `/v1/models`: one card per model, its own context length."""
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

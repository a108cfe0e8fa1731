"""The mock SGLang server's health, model and server info routes."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from genmesh.engines.mock import advance, initial_state
from genmesh.engines.sglang_pd import DEFAULT_BOOTSTRAP_PORT
from genmesh.testkit.config import MockServerConfig
from genmesh.testkit.sglang.normalize import preferred_sampling_params
from genmesh.testkit.sglang.request import JSON
from genmesh.testkit.sglang.response import WEIGHT_VERSION, json_response
from genmesh.testkit.sglang.schedule import DEFAULT_PAGE_SIZE, Scheduler

# The SGLang release this mock imitates: `--incremental-streaming-output` era (sglang#20614).
SGLANG_VERSION = "0.5.10"


def max_req_input_len(config: MockServerConfig) -> int:
    """The scheduler's longest input: `min(context_len - 1, pool - 1) - 5` (tp_worker.py)."""
    return min(config.max_model_len - 1, config.max_total_num_tokens - 1) - 5


class InfoRoutes:
    """The routes that report on the server rather than generate."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.config = scheduler.config
        self.state = scheduler.state
        self.cache = scheduler.cache
        self.model = scheduler.model
        self.started = time.time()
        preferred_sampling_params(self.config)  # as SGLang, refuse to start on bad JSON

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.state.healthy else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        """Generates one token from `input_ids=[0]`; 200 once the "scheduler" answers."""
        if not self.state.healthy:
            return web.Response(status=503)
        await asyncio.sleep(self.state.token_delay_s)
        self.model.top(advance(initial_state(0), 0), 1)
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        return json_response(
            {
                "model_path": self.config.model,
                "tokenizer_path": self.config.model,
                "is_generation": True,
                # ServerArgs' text, as given: clients json.loads it themselves.
                "preferred_sampling_params": self.config.preferred_sampling_params,
                "weight_version": WEIGHT_VERSION,
                "has_image_understanding": False,
                "has_audio_understanding": False,
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        info = {**self._server_args(*_bound_address(request)), **self._scheduler_info()}
        return json_response({**info, "version": SGLANG_VERSION})

    def _server_args(self, host: str, port: int) -> JSON:
        """ServerArgs, flattened (the fields clients read, and some context)."""
        c = self.config
        return {
            "model_path": c.model,
            "tokenizer_path": c.model,
            "tokenizer_mode": "auto",
            "skip_tokenizer_init": True,
            "load_format": "dummy",
            "trust_remote_code": False,
            "context_length": c.max_model_len,
            "page_size": c.block_size or DEFAULT_PAGE_SIZE,
            "preferred_sampling_params": c.preferred_sampling_params,
            # "model": a model's generation_config.json gives the OpenAI routes' defaults.
            "sampling_defaults": "model",
            "is_embedding": False,
            "host": host,
            "port": port,
            "served_model_name": c.model,
            "weight_version": WEIGHT_VERSION,
            "dtype": "auto",
            "tp_size": 1,
            "pp_size": 1,
            "dp_size": 1,
            "ep_size": 1,
            "stream_interval": 1,
            "incremental_streaming_output": c.incremental,
            "stream_output": c.incremental,
            "max_running_requests": None,
            "max_queued_requests": None,
            "chunked_prefill_size": 8192,
            "schedule_policy": "fcfs",
            "random_seed": 0,
            "disable_radix_cache": False,
            "allow_auto_truncate": False,
            "enable_lora": False,
            "enable_return_hidden_states": False,
            "enable_return_routed_experts": True,
            "enable_custom_logit_processor": False,
            "enable_priority_scheduling": False,
            "enable_metrics": False,
            "api_key": None,
            "admin_api_key": None,
            "disaggregation_mode": c.disaggregation_mode,
            # The mock's bootstrap server is its HTTP port (testkit/pd.py), so that a
            # worker in front of it learns where decode servers find it, as from SGLang.
            "disaggregation_bootstrap_port": (
                DEFAULT_BOOTSTRAP_PORT if c.disaggregation_mode == "null" else port
            ),
            "disaggregation_transfer_backend": "mooncake",
        }

    def _scheduler_info(self) -> JSON:
        c = self.config
        running = list(self.state.running.values())
        return {
            # The scheduler's get_init_info().
            "status": "ready",
            "max_total_num_tokens": c.max_total_num_tokens,
            "max_req_input_len": max_req_input_len(c),
            "internal_states": [
                {
                    "last_gen_throughput": 0.0,
                    "num_running_reqs": sum(1 for r in running if not r.waiting),
                    "num_waiting_reqs": sum(1 for r in running if r.waiting),
                }
            ],
        }

    def _model_card(self) -> JSON:
        name = self.config.model
        return {
            "id": name,
            "object": "model",
            "created": int(self.started),
            "owned_by": "sglang",
            "root": name,
            "max_model_len": self.config.max_model_len,
        }

    async def models(self, request: web.Request) -> web.Response:
        return json_response({"object": "list", "data": [self._model_card()]})

    async def model_card(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.config.model:
            error = {
                "message": f"The model '{name}' does not exist",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
            return json_response({"error": error}, 404)
        return json_response(self._model_card())

    async def flush_cache(self, request: web.Request) -> web.Response:
        """SGLang's reply text either way; 400 while requests run or wait (its
        scheduler refuses to flush then)."""
        self.state.flush_calls += 1
        if self.cache is not None and not self.state.running:
            self.cache.clear()  # RadixCache.reset: an AllBlocksCleared event
        return web.Response(
            text="Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be "
            "performed.)\n",
            status=400 if self.state.running else 200,
        )


def _bound_address(request: web.Request) -> tuple[str, int]:
    """The host and port this request came in on."""
    transport = request.transport
    sockname = transport.get_extra_info("sockname") if transport is not None else None
    if isinstance(sockname, tuple) and len(sockname) >= 2:
        return str(sockname[0]), int(sockname[1])
    return "127.0.0.1", 0

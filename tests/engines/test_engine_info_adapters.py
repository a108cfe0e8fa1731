"""The SGLang and vLLM adapters advertise what their servers state about themselves (the
card's `engine_info`), read over real HTTP from the testkit's mock servers launched with
known limits: SGLang's `/server_info` (or the older `/get_server_info`) and `/v1/models`;
vLLM's `/v1/models`, `/version`, the `vllm:cache_config_info` series of `/metrics` and,
in dev mode, `/server_info`'s `max_logprobs`."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from genmesh.engines.http import HttpEngineConfig
from genmesh.engines.sglang import SglangEngine
from genmesh.engines.vllm import (
    ABORT_PROBE_ID,
    VllmEngine,
    cache_config_labels,
    dev_max_logprobs,
)
from genmesh.shared.engine_info import EngineInfo
from genmesh.testkit import sglang as sglang_kit
from genmesh.testkit import vllm as vllm_kit
from genmesh.testkit.common import serving
from genmesh.testkit.config import MockServerConfig
from genmesh.testkit.sglang.info import SGLANG_VERSION
from genmesh.testkit.vllm.app import VLLM_VERSION

pytestmark = pytest.mark.inproc

PREFERRED = '{"temperature": 0.6, "top_p": 0.95, "max_new_tokens": 64}'
CONFIG = MockServerConfig(
    model="served-model",
    vocab_size=1000,
    eos_token_id=7,
    max_model_len=4096,
    max_total_num_tokens=8192,
    block_size=32,
    preferred_sampling_params=PREFERRED,
)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def without(*paths: str) -> Any:
    """Middleware: the server answers `paths` 404, as a build without those routes does."""

    @web.middleware
    async def missing(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in paths:
            return web.json_response({"detail": "Not Found"}, status=404)
        return await handler(request)

    return missing


async def learnt(engine: SglangEngine | VllmEngine) -> EngineInfo | None:
    await engine.start()
    try:
        assert await engine.healthy()
        return EngineInfo.from_wire(engine.describe()["engine_info"])
    finally:
        await engine.close()


async def set_health(url: str, healthy: bool) -> None:
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{url}/testkit/config", json={"healthy": healthy}) as r,
    ):
        assert r.status == 200


# ---------------------------------------------------------------------------- SGLang


async def test_sglang_adapter_advertises_the_servers_limits_and_preferred_params() -> None:
    async with serving(sglang_kit.build_app(CONFIG)) as url:
        info = await learnt(SglangEngine(HttpEngineConfig(url)))
    assert info == EngineInfo(
        model="served-model",
        context_length=4096,
        max_total_num_tokens=8192,
        block_size=32,
        sampling_defaults={"temperature": 0.6, "top_p": 0.95, "max_new_tokens": 64},
        engine_version=f"sglang-{SGLANG_VERSION}",
    )


async def test_sglang_adapter_reads_an_older_server_through_get_server_info() -> None:
    """Before the `/server_info` alias SGLang had only `/get_server_info`."""
    app = sglang_kit.build_app(CONFIG)
    app.middlewares.append(without("/server_info"))
    async with serving(app) as url:
        info = await learnt(SglangEngine(HttpEngineConfig(url)))
    assert info is not None
    assert (info.model, info.max_total_num_tokens, info.block_size) == ("served-model", 8192, 32)


async def test_sglang_context_length_is_the_models_not_the_override() -> None:
    """ServerArgs' context_length is only `--context-length` (null without it); the
    model's own comes from `/v1/models`, and wins."""
    app = sglang_kit.build_app(CONFIG)

    @web.middleware
    async def no_override(request: web.Request, handler: Handler) -> web.StreamResponse:
        response = await handler(request)
        if request.path == "/server_info" and isinstance(response, web.Response):
            body = json.loads(response.text or "{}")
            return web.json_response({**body, "context_length": None})
        return response

    app.middlewares.append(no_override)
    async with serving(app) as url:
        info = await learnt(SglangEngine(HttpEngineConfig(url)))
    assert info is not None
    assert info.context_length == 4096


async def test_sglang_without_preferred_params_has_no_defaults() -> None:
    config = dataclasses.replace(CONFIG, preferred_sampling_params=None, block_size=0)
    async with serving(sglang_kit.build_app(config)) as url:
        info = await learnt(SglangEngine(HttpEngineConfig(url)))
    assert info is not None
    assert info.sampling_defaults == {}
    assert info.block_size == 1  # SGLang's default page size


async def test_sglang_info_is_forgotten_while_down_and_relearnt() -> None:
    async with serving(sglang_kit.build_app(CONFIG)) as url:
        engine = SglangEngine(HttpEngineConfig(url))
        await engine.start()
        try:
            assert await engine.healthy()
            assert engine.describe()["engine_info"]["max_total_num_tokens"] == 8192
            await set_health(url, False)
            assert not await engine.healthy()
            assert engine.describe()["engine_info"] is None
            await set_health(url, True)
            assert await engine.healthy()
            assert engine.describe()["engine_info"]["context_length"] == 4096
        finally:
            await engine.close()


# ------------------------------------------------------------------------------ vLLM


@pytest.mark.parametrize("profile", ["new", "old"])
async def test_vllm_adapter_advertises_models_version_and_cache_config(profile: str) -> None:
    app = vllm_kit.build_app(CONFIG, profile=profile)  # type: ignore[arg-type]
    async with serving(app) as url:
        info = await learnt(VllmEngine(HttpEngineConfig(url)))
    # No vLLM route states the generation-config defaults it applies: none advertised.
    assert info == EngineInfo(
        model="served-model",
        context_length=4096,
        max_total_num_tokens=8192,
        block_size=32,
        engine_version=f"vllm-{VLLM_VERSION}",
    )


async def test_vllm_without_metrics_or_version_is_still_healthy() -> None:
    """`--disable-log-stats` (no metrics) or a build without `/version`: the limits stay
    unknown, the worker still serves."""
    app = vllm_kit.build_app(CONFIG)
    app.middlewares.append(without("/metrics", "/version"))
    async with serving(app) as url:
        info = await learnt(VllmEngine(HttpEngineConfig(url)))
    assert info == EngineInfo(model="served-model", context_length=4096)


def test_cache_config_labels_prefer_the_token_count_newer_builds_give() -> None:
    page = (
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="16",engine="0",kv_cache_size_tokens="10576",'
        'num_gpu_blocks="661",sliding_window="None"} 1.0\n'
        'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="9"} 1.0\n'
    )
    labels = cache_config_labels(page)
    assert labels["engine"] == "0"
    assert labels["kv_cache_size_tokens"] == "10576"
    assert labels["sliding_window"] == "None"
    assert cache_config_labels("vllm:num_requests_running 0.0\n") == {}
    assert cache_config_labels(None) == {}


async def test_vllm_kv_capacity_from_a_token_labelled_page() -> None:
    app = vllm_kit.build_app(CONFIG)

    async def newer_metrics(request: web.Request) -> web.Response:
        return web.Response(
            text='vllm:cache_config_info{block_size="16",kv_cache_size_tokens="10576",'
            'num_gpu_blocks="661"} 1.0\n'
        )

    @web.middleware
    async def swap(request: web.Request, handler: Handler) -> web.StreamResponse:
        return await (newer_metrics(request) if request.path == "/metrics" else handler(request))

    app.middlewares.append(swap)
    async with serving(app) as url:
        info = await learnt(VllmEngine(HttpEngineConfig(url)))
    assert info is not None
    assert (info.max_total_num_tokens, info.block_size) == (10576, 16)


def dev_server_info(max_logprobs: Any) -> Any:
    """Middleware: the dev-mode `GET /server_info` (VLLM_SERVER_DEV_MODE=1), whose JSON
    form dumps the VllmConfig; only `model_config.max_logprobs` matters here."""

    @web.middleware
    async def route(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path == "/server_info" and request.query.get("config_format") == "json":
            config = {"model_config": {"model": "served-model", "max_logprobs": max_logprobs}}
            return web.json_response({"vllm_config": config, "vllm_env": {}, "system_env": {}})
        return await handler(request)

    return route


async def test_vllm_dev_mode_server_states_max_logprobs() -> None:
    app = vllm_kit.build_app(CONFIG)
    app.middlewares.append(dev_server_info(50))
    async with serving(app) as url:
        info = await learnt(VllmEngine(HttpEngineConfig(url)))
    assert info is not None
    assert (info.max_logprobs, info.vocab_size) == (50, None)


def test_dev_max_logprobs_reads_only_a_stated_positive_limit() -> None:
    def info(value: Any) -> Any:
        return {"vllm_config": {"model_config": {"max_logprobs": value}}}

    assert dev_max_logprobs(info(20)) == 20
    # -1 is "the vocabulary size", which no route states.
    for unknown in (info(-1), info(0), info("20"), info(True), {"vllm_config": "text"}, None):
        assert dev_max_logprobs(unknown) is None


async def test_vllm_abort_route_probe_names_an_id_so_it_aborts_nothing() -> None:
    """The adapter learns whether `/abort_requests` exists by calling it. On a current
    vLLM that route is the cancel router's, where an empty `request_ids` aborts every
    request on the server: the probe must name an ID."""
    bodies: list[Any] = []

    @web.middleware
    async def record(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path == "/abort_requests":
            bodies.append(await request.json())
        return await handler(request)

    app = vllm_kit.build_app(CONFIG)
    app.middlewares.append(record)
    async with serving(app) as url:
        engine = VllmEngine(HttpEngineConfig(url))
        await learnt(engine)
    assert engine.describe()["abort_requests"] is True  # the probe did learn the route
    assert bodies == [{"request_ids": [ABORT_PROBE_ID]}]

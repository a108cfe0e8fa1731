"""The mock vLLM server's `/metrics`: the one series that tells a client the KV cache's
shape, `vllm:cache_config_info`.

vLLM's Prometheus logger publishes its CacheConfig as an info gauge (value 1, the config
in labels, one series per engine) once the engine has profiled its KV cache, so the labels
carry the real `num_gpu_blocks`. It is the only place vLLM's HTTP server states its block
size and KV capacity (`/server_info` exists only under `VLLM_SERVER_DEV_MODE`). The mock
serves no other metric: genmesh reads none.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from genmesh.testkit.config import MockServerConfig

# vLLM's CacheConfig.block_size when not given (CUDA).
DEFAULT_BLOCK_SIZE = 16
_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def cache_config_labels(config: MockServerConfig) -> dict[str, str]:
    """CacheConfig.metrics_info(): every field as text, as vLLM labels it."""
    block = config.block_size or DEFAULT_BLOCK_SIZE
    return {
        "block_size": str(block),
        "cache_dtype": "auto",
        "calculate_kv_scales": "False",
        "cpu_offload_gb": "0",
        "enable_prefix_caching": "True",
        "engine": "0",
        "gpu_memory_utilization": "0.9",
        "is_attention_free": "False",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(config.max_total_num_tokens // block),
        "num_gpu_blocks_override": "None",
        "prefix_caching_hash_algo": "sha256",
        "sliding_window": "None",
        "swap_space": "4",
    }


def metrics_text(config: MockServerConfig) -> str:
    labels = ",".join(f'{k}="{v}"' for k, v in cache_config_labels(config).items())
    return (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        f"vllm:cache_config_info{{{labels}}} 1.0\n"
    )


def metrics_handler(config: MockServerConfig) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(
            body=metrics_text(config).encode(), headers={"Content-Type": _CONTENT_TYPE}
        )

    return metrics

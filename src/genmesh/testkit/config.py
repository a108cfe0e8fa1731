"""`genmesh testkit`: a mock engine server's options, declared once (`shared/settings.py`),
in a module that imports nothing heavy so --help stays quick."""

from __future__ import annotations

from dataclasses import dataclass

from genmesh.shared.connection import LOG_LEVELS
from genmesh.shared.settings import group, non_negative_float, option, positive_int


@dataclass(frozen=True, slots=True)
class MockServerConfig:
    """Settings of a mock engine server (`genmesh testkit sglang|vllm --help`)."""

    # Own variables: a mock engine beside a frontend must not take the frontend's model.
    model: str = option("genmesh-mock", env="GENMESH_TESTKIT_MODEL", help="served model name")
    vocab_size: int = option(151_936, parse=positive_int, help="vocabulary")
    eos_token_id: int = option(151_645, help="EOS token id")
    max_model_len: int = option(32_768, parse=positive_int, help="context length")
    token_delay_ms: float = option(0.0, parse=non_negative_float, help="per token")
    # What the server reports of itself (SGLang /server_info, vLLM /metrics
    # `vllm:cache_config_info`): the KV pool's size and block (page) size.
    max_total_num_tokens: int = option(
        1_048_576, parse=positive_int, help="tokens the KV cache holds"
    )
    block_size: int = option(
        0, help="KV block (page) size; 0 = the engine's default (SGLang 1, vLLM 16)"
    )
    # SGLang: --preferred-sampling-params, the JSON text the server merges under every
    # request's sampling_params and reports in /server_info and /model_info.
    preferred_sampling_params: str | None = option(
        None, help="SGLang: default sampling params, as JSON"
    )
    # SGLang's and vLLM's --kv-events-config (validated as each engine validates it): the
    # server keeps a prefix cache and publishes its events over ZMQ (testkit/kv_cache.py).
    kv_events_config: str | None = option(
        None,
        flag="--kv-events-config",
        env="GENMESH_TESTKIT_KV_EVENTS_CONFIG",
        help="publish KV cache events over ZMQ as the engine does, and keep a prefix cache "
        '(the engine\'s JSON: SGLang \'{"publisher": "zmq", "endpoint": '
        '"tcp://*:5557"}\', vLLM \'{"enable_kv_cache_events": true, ...}\')',
    )
    # SGLang's --disaggregation-mode (vLLM's NIXL kv_role, under the same flag here): two
    # mock servers pair up as prefill and decode (testkit/pd.py; engine-apis.md §C).
    disaggregation_mode: str = option(
        "null",
        env="GENMESH_TESTKIT_DISAGGREGATION_MODE",
        choices=("null", "prefill", "decode"),
        help="P/D role: prefill holds each request's KV handle (by bootstrap_room, or "
        "NIXL kv_transfer_params) until its decode server takes it; null = aggregated",
    )
    disaggregation_timeout_s: float = option(
        30.0,
        env="GENMESH_TESTKIT_DISAGGREGATION_TIMEOUT_S",
        parse=non_negative_float,
        help="P/D: how long a decode waits for its prefill's KV handle, and how long a "
        "prefill keeps one nobody takes",
    )
    # SGLang: --incremental-streaming-output (deltas) instead of cumulative chunks.
    incremental: bool = option(False, help="SGLang: incremental (delta) streaming output")
    # vLLM: --enable-prompt-tokens-details; without it vLLM's usage never says what was
    # cached (and with it, only when something was: `if enable... and num_cached_tokens`).
    enable_prompt_tokens_details: bool = option(
        False, help="vLLM: usage reports prompt_tokens_details.cached_tokens"
    )
    # vLLM: --tokens-only, which also registers POST /abort_requests.
    tokens_only: bool = option(
        True, flag="--no-tokens-only", help="vLLM: without --tokens-only (no /abort_requests)"
    )


@dataclass(frozen=True, slots=True)
class TestkitConfig:
    """`genmesh testkit`: which engine to mock, where, and how it behaves."""

    __test__ = False  # not a pytest test class, whatever its name

    engine: str = option(
        positional=True, env=None, choices=("sglang", "vllm"), help="which engine to mock"
    )
    # Own variables: a mock engine beside a frontend must not take the frontend's address.
    host: str = option("127.0.0.1", env="GENMESH_TESTKIT_HOST", help="listen address")
    port: int = option(30000, env="GENMESH_TESTKIT_PORT", help="HTTP port")
    server: MockServerConfig = group(MockServerConfig())
    log_level: str = option("warning", choices=LOG_LEVELS, help="log level")

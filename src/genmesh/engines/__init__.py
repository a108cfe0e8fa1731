"""Engine adapters, by name: `mock` (in-process), `sglang` and `vllm` (HTTP clients).

Adapters are imported when one is created: a config that names an engine (a worker's
`--engine`) must not pull in an HTTP client just to show its --help.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from genmesh.engines.base import Engine
    from genmesh.engines.mock import MockConfig
    from genmesh.engines.sglang_pd import BootstrapConfig
    from genmesh.engines.zmq_events import ZmqEventsConfig

ENGINES = ("mock", "sglang", "vllm")


def create_engine(
    name: str,
    *,
    url: str | None = None,
    mock: MockConfig | None = None,
    kv_events: ZmqEventsConfig | None = None,
    sglang_bootstrap: BootstrapConfig | None = None,
) -> Engine:
    if name == "mock":
        if kv_events is not None and kv_events.endpoint:
            raise ValueError(
                "--engine-kv-events is for an SGLang/vLLM server; the mock engine reports "
                "its own cache"
            )
        from genmesh.engines.mock import MockEngine

        return MockEngine(mock)
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; available: {', '.join(ENGINES)}")
    if not url:
        raise ValueError(f"the {name} engine needs --engine-url (its HTTP address)")
    from genmesh.engines.http import HttpEngineConfig

    config = HttpEngineConfig(url=url)
    if kv_events is not None:
        config = HttpEngineConfig(url=url, kv_events=kv_events)
    if name == "sglang":
        from genmesh.engines.sglang import SglangEngine

        return SglangEngine(config, sglang_bootstrap)
    from genmesh.engines.vllm import VllmEngine

    return VllmEngine(config)

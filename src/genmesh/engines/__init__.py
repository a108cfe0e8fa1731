"""Engine adapters, by name: `mock` (in-process), `sglang` and `vllm` (HTTP clients)."""

from __future__ import annotations

from genmesh.engines.base import Engine
from genmesh.engines.http import HttpEngineConfig
from genmesh.engines.mock import MockConfig, MockEngine

ENGINES = ("mock", "sglang", "vllm")


def create_engine(name: str, *, url: str | None = None, mock: MockConfig | None = None) -> Engine:
    if name == "mock":
        return MockEngine(mock)
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; available: {', '.join(ENGINES)}")
    if not url:
        raise ValueError(f"the {name} engine needs --engine-url (its HTTP address)")
    config = HttpEngineConfig(url=url)
    if name == "sglang":
        from genmesh.engines.sglang import SglangEngine

        return SglangEngine(config)
    from genmesh.engines.vllm import VllmEngine

    return VllmEngine(config)

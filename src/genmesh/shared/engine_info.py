"""What a worker's engine tells the mesh about itself, and what frontends read at bind time.

A worker's card carries its engine's facts under `engine_info` (`docs/protocol.md`,
"Discovery"), as Dynamo's `Worker.engine_info` does: the model, its context length, the
KV cache's capacity and block size, and the sampling defaults the engine applies to a
request that leaves a parameter unset (its generation config, SGLang's
`preferred_sampling_params`). Formats read them through `EngineCatalog` when they bind a
request: for defaults and for the checks a real server makes against its context length.

`EngineInfo.from_wire` is tolerant: a card from another version, or a field of the wrong
type, yields None for that field rather than losing the worker.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# Sampling-default names are Hugging Face generation-config names (`max_new_tokens`, not
# vLLM's `max_tokens`); these are the ones engines take from a model's generation config.
SAMPLING_DEFAULT_KEYS = frozenset(
    ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _number(value: Any) -> float | int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    # JSON text may say NaN or Infinity (Python's json reads both): no default to apply.
    return value if math.isfinite(value) else None


@dataclass(frozen=True, slots=True)
class EngineInfo:
    model: str
    # The longest prompt + output a request may have (vLLM `max_model_len`, SGLang
    # `context_length`).
    context_length: int | None = None
    # How many tokens the KV cache holds in all (SGLang's `max_total_num_tokens`).
    max_total_num_tokens: int | None = None
    # Tokens per KV cache block (page).
    block_size: int | None = None
    # Defaults for unset sampling parameters, by generation-config name.
    sampling_defaults: Mapping[str, float | int] = field(default_factory=dict)
    # The engine's own name and version, for `/get_server_info`.
    engine_version: str | None = None
    # The model's vocabulary size (token ids are below it; vLLM's `logprobs: -1` means it).
    vocab_size: int | None = None
    # The most logprobs per position a request may ask for (vLLM `--max-logprobs`, whose
    # -1, "the vocabulary", is sent as the vocabulary size or not at all).
    max_logprobs: int | None = None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model}
        for key in _OPTIONAL_KEYS:
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.sampling_defaults:
            out["sampling_defaults"] = dict(self.sampling_defaults)
        return out

    @classmethod
    def from_wire(cls, obj: Any) -> EngineInfo | None:
        """The info of a card's `engine_info` map; None if it has no model."""
        if not isinstance(obj, Mapping) or not isinstance(obj.get("model"), str):
            return None
        version = obj.get("engine_version")
        return cls(
            model=obj["model"],
            context_length=_positive(obj.get("context_length")),
            max_total_num_tokens=_positive(obj.get("max_total_num_tokens")),
            block_size=_positive(obj.get("block_size")),
            sampling_defaults=sampling_defaults(obj.get("sampling_defaults")),
            engine_version=version if isinstance(version, str) else None,
            vocab_size=_positive(obj.get("vocab_size")),
            max_logprobs=_positive(obj.get("max_logprobs")),
        )


_OPTIONAL_KEYS = (
    "context_length",
    "max_total_num_tokens",
    "block_size",
    "engine_version",
    "vocab_size",
    "max_logprobs",
)


def sampling_defaults(obj: Any) -> dict[str, float | int]:
    """The sampling defaults in `obj`: a map, or its JSON text (as SGLang's
    `--preferred-sampling-params` is given and reported). Keys that are not
    generation-config sampling names, and values that are not numbers, are dropped: what
    is left is only what a format can apply; anything unreadable is no defaults at all."""
    if isinstance(obj, str):
        try:
            obj = json.loads(obj)
        except ValueError:
            return {}
    if not isinstance(obj, Mapping):
        return {}
    return {
        key: number
        for key, value in obj.items()
        if key in SAMPLING_DEFAULT_KEYS and (number := _number(value)) is not None
    }


def _positive(value: Any) -> int | None:
    number = _int(value)
    return number if number is not None and number > 0 else None


def _least(values: Iterable[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return min(known) if known else None


def _first(values: Iterable[Any]) -> Any:
    return next((v for v in values if v), None)


def combine(infos: list[EngineInfo]) -> EngineInfo:
    """One model's info over the workers that serve it: the tightest limits, since the
    router may pick any of them; the first block size, defaults and version a worker
    states (one model, one config), so a worker that states none takes nothing away."""
    return EngineInfo(
        model=infos[0].model,
        context_length=_least(i.context_length for i in infos),
        max_total_num_tokens=_least(i.max_total_num_tokens for i in infos),
        block_size=_first(i.block_size for i in infos),
        sampling_defaults=_first(i.sampling_defaults for i in infos) or {},
        engine_version=_first(i.engine_version for i in infos),
        vocab_size=_least(i.vocab_size for i in infos),
        max_logprobs=_least(i.max_logprobs for i in infos),
    )


class EngineCatalog:
    """The engines a frontend knows of, by model, as of one moment."""

    def __init__(self, infos: Iterable[EngineInfo] = ()) -> None:
        by_model: dict[str, list[EngineInfo]] = {}
        for info in infos:
            by_model.setdefault(info.model, []).append(info)
        self._models = {model: combine(found) for model, found in sorted(by_model.items())}

    def __bool__(self) -> bool:
        return bool(self._models)

    @property
    def models(self) -> list[str]:
        return list(self._models)

    def get(self, model: str | None = None) -> EngineInfo | None:
        """The info of `model`; with no model named, of the only (else the first) model.
        None when nothing is known of it: formats then check nothing against the engine."""
        if model is None:
            return next(iter(self._models.values()), None)
        return self._models.get(model)


NO_ENGINES = EngineCatalog()

"""vLLM's `/inference/v1/generate` request body as pydantic v2 models, validated the way
vLLM validates it, so that what it accepts, coerces and refuses, and the words it refuses
with, come out the same.

The spec is vLLM's own code (newest token-in/token-out protocol,
`vllm/entrypoints/scale_out/token_in_token_out/protocol.py`, and `vllm/sampling_params.py`):

- `GenerateRequest` is a plain pydantic `BaseModel`: unknown top-level fields are dropped
  silently, values are coerced in pydantic's lax mode ("3" -> 3, 2.0 -> 2).
- `SamplingParams` is a msgspec struct that vLLM exposes to pydantic through
  `PydanticMsgspecMixin`: a union of "is an instance" and "a typed dict, then
  `_validate_msgspec()` builds the struct". So unknown keys are dropped silently, each key
  is coerced by its type hint, and `__post_init__`'s checks (`_verify_args`) raise inside
  the validator: pydantic reports them as `value_error`s under
  `sampling_params.function-after[_validate_msgspec(), typed-dict]`, next to the failed
  `is-instance[SamplingParams]` branch. This module builds the same core schema, with the
  same names, so the error list is the same.
- `StreamOptions` is an `OpenAIBaseModel`: unknown keys are accepted and logged.

What genmesh cannot deliver (stop strings without a tokenizer, multimodal inputs, ...) is
not refused here but in `request.py`, after vLLM's own validation, as the server would.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import field
from enum import Enum
from typing import Annotated, Any, ClassVar, Literal, get_type_hints

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetPydanticSchema,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic.dataclasses import dataclass
from pydantic_core import core_schema

from genmesh.shared.envelope import TokenIds, pack_token_ids
from genmesh.shared.multimodal import FeaturesError, MmItem, check_bounds, check_layout

_SAMPLING_EPS = 1e-5
_MAX_TEMP = 1e-2
# vLLM's `VLLM_MAX_N_SEQUENCES` default.
MAX_N_SEQUENCES = 16384


class VLLMValidationError(ValueError):
    """vLLM's `VLLMValidationError`: a `ValueError` that names the offending parameter,
    which the error handler reports as the envelope's `param`."""

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None):
        super().__init__(message)
        self.parameter = parameter
        self.value = value


class RequestOutputKind(Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    _backend: str | None = field(default=None, init=False)
    _backend_was_auto: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        count = sum(
            getattr(self, name) is not None
            for name in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
        )
        if count > 1:
            raise VLLMValidationError(
                "You can only use one kind of structured outputs constraint "
                f"but multiple are specified: {self.__dict__}"
            )
        if count < 1:
            raise VLLMValidationError(
                "You must use one kind of structured outputs constraint "
                f"but none are specified: {self.__dict__}"
            )


@dataclass
class RepetitionDetectionParams:
    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        if (
            self.max_pattern_size < 0
            or self.min_pattern_size < 0
            or self.min_pattern_size > self.max_pattern_size
        ):
            raise VLLMValidationError(
                "max_pattern_size, min_pattern_size must be >=0, "
                "with min_pattern_size <= max_pattern_size. "
                "Set both to 0 to disable repetitive pattern detection."
            )
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise VLLMValidationError(
                "min_count must be >= 2 to detect repetitive patterns "
                "in engine output. If you do not wish to detect repetitive "
                "patterns, set max_pattern_size to 0."
            )


class SamplingParams:
    """vLLM's `SamplingParams`: its public fields, defaults and `__post_init__` checks.
    Instances are built by pydantic (see the module docstring), never by hand."""

    # Field -> default, in vLLM's declaration order; the type hints are below.
    DEFAULTS: ClassVar[dict[str, Any]] = {
        "n": 1,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "seed": None,
        "stop": None,
        "stop_token_ids": None,
        "ignore_eos": False,
        "max_tokens": 16,
        "min_tokens": 0,
        "logprobs": None,
        "prompt_logprobs": None,
        "prompt_logprob_token_ids": None,
        "prompt_logprob_start": None,
        "logprob_token_ids": None,
        "flat_logprobs": False,
        "detokenize": True,
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "include_stop_str_in_output": False,
        "output_kind": RequestOutputKind.CUMULATIVE,
        "stream_interval": None,
        "skip_clone": False,
        "output_text_buffer_length": 0,
        "structured_outputs": None,
        "logit_bias": None,
        "allowed_token_ids": None,
        "extra_args": None,
        "bad_words": None,
        "skip_reading_prefix_cache": None,
        "thinking_token_budget": None,
        "repetition_detection": None,
        "routed_experts_prompt_start": 0,
        "trace_decode_token_ids": None,
    }

    n: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop: str | list[str] | None
    stop_token_ids: list[int] | None
    ignore_eos: bool
    max_tokens: int | None
    min_tokens: int
    logprobs: int | None
    prompt_logprobs: int | None
    prompt_logprob_token_ids: list[int] | None
    prompt_logprob_start: int | None
    logprob_token_ids: list[int] | None
    flat_logprobs: bool
    detokenize: bool
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    include_stop_str_in_output: bool
    output_kind: RequestOutputKind
    stream_interval: int | None
    skip_clone: bool
    output_text_buffer_length: int
    structured_outputs: StructuredOutputsParams | None
    logit_bias: dict[int, float] | None
    allowed_token_ids: list[int] | None
    extra_args: dict[str, Any] | None
    bad_words: list[str] | None
    skip_reading_prefix_cache: bool | None
    thinking_token_budget: int | None
    repetition_detection: RepetitionDetectionParams | None
    routed_experts_prompt_start: int
    trace_decode_token_ids: list[int] | None

    def __init__(self, **values: Any) -> None:
        for name, default in self.DEFAULTS.items():
            setattr(self, name, values.get(name, default))
        self._post_init()

    @classmethod
    def _validate_msgspec(cls, value: dict[str, Any]) -> SamplingParams:
        # The name shows in pydantic's error locations, as vLLM's does.
        return cls(**value)

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source_type: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        hints = get_type_hints(cls)
        fields = {
            name: core_schema.typed_dict_field(
                core_schema.with_default_schema(handler(hints[name]), default=default),
                required=False,
            )
            for name, default in cls.DEFAULTS.items()
        }
        typed = core_schema.no_info_after_validator_function(
            cls._validate_msgspec, core_schema.typed_dict_schema(fields)
        )
        return core_schema.union_schema([core_schema.is_instance_schema(source_type), typed])

    def _post_init(self) -> None:
        """vLLM's `SamplingParams.__post_init__`."""
        if 0 < self.temperature < _MAX_TEMP:
            self.temperature = _MAX_TEMP
        if self.seed == -1:
            self.seed = None
        if self.thinking_token_budget is not None and (
            self.thinking_token_budget < -1 or isinstance(self.thinking_token_budget, bool)
        ):
            raise VLLMValidationError(
                "`thinking_token_budget` must be a non-negative integer or -1 for unlimited.",
                parameter="thinking_token_budget",
                value=self.thinking_token_budget,
            )
        if self.thinking_token_budget == -1:
            self.thinking_token_budget = None
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop_token_ids = (
            [] if self.stop_token_ids is None else list(dict.fromkeys(self.stop_token_ids))
        )
        self.bad_words = [] if self.bad_words is None else list(dict.fromkeys(self.bad_words))
        self._verify_args()
        if self.temperature < _SAMPLING_EPS:
            # Zero temperature means greedy sampling.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
            if self.n > 1:
                raise VLLMValidationError(f"n must be 1 when using greedy sampling, got {self.n}.")

    def _verify_args(self) -> None:
        """vLLM's `SamplingParams._verify_args`, with its messages and parameters."""
        if self.n < 1:
            raise VLLMValidationError(f"n must be at least 1, got {self.n}.")
        if self.n > MAX_N_SEQUENCES:
            raise VLLMValidationError(
                f"n must be at most {MAX_N_SEQUENCES}, got {self.n}. To increase this "
                "limit, set the VLLM_MAX_N_SEQUENCES environment variable."
            )
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise VLLMValidationError(
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}."
            )
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise VLLMValidationError(
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}."
            )
        if not math.isfinite(self.repetition_penalty):
            raise VLLMValidationError(
                f"repetition_penalty must be a finite number, got {self.repetition_penalty}."
            )
        if self.repetition_penalty <= 0.0:
            raise VLLMValidationError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}."
            )
        t = self.temperature
        if not math.isfinite(t):
            raise VLLMValidationError(
                f"temperature must be a finite number, got {t}.", parameter="temperature", value=t
            )
        if t < 0.0:
            raise VLLMValidationError(
                f"temperature must be non-negative, got {t}.", parameter="temperature", value=t
            )
        if t > 2.0:
            raise VLLMValidationError(
                f"temperature must be in [0, 2], got {t}.", parameter="temperature", value=t
            )
        if not 0.0 < self.top_p <= 1.0:
            raise VLLMValidationError(
                f"top_p must be in (0, 1], got {self.top_p}.", parameter="top_p", value=self.top_p
            )
        if self.top_k < -1:
            raise VLLMValidationError(
                f"top_k must be 0 (disable), or at least 1, got {self.top_k}."
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise VLLMValidationError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise VLLMValidationError(
                f"max_tokens must be at least 1, got {self.max_tokens}.",
                parameter="max_tokens",
                value=self.max_tokens,
            )
        if self.min_tokens < 0:
            raise VLLMValidationError(
                f"min_tokens must be greater than or equal to 0, got {self.min_tokens}."
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise VLLMValidationError(
                f"min_tokens must be less than or equal to "
                f"max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        if self.stream_interval is not None and self.stream_interval < 1:
            raise VLLMValidationError(
                f"stream_interval must be at least 1, got {self.stream_interval}.",
                parameter="stream_interval",
                value=self.stream_interval,
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value != -1 and value < 0:
                raise VLLMValidationError(
                    f"{name} must be non-negative or -1, got {value}.",
                    parameter=name,
                    value=value,
                )
        if any(not s for s in self.stop):  # type: ignore[union-attr]
            raise VLLMValidationError("stop cannot contain an empty string.")
        if self.stop and not self.detokenize:
            raise VLLMValidationError(
                "stop strings are only supported when detokenize is True. "
                "Set detokenize=True to use stop."
            )
        if any(not word for word in self.bad_words or []):
            raise VLLMValidationError(
                f"bad_words cannot contain an empty string. Got bad_words={self.bad_words}"
            )


class StreamOptions(BaseModel):
    # An `OpenAIBaseModel`: unknown keys are kept (and logged by `request.py`).
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class PlaceholderRangeInfo(BaseModel):
    # vLLM ignores unknown keys; they are kept here so that the engine still gets what a
    # newer client sends (e.g. newest vLLM's `is_embed`): features are forwarded as validated.
    model_config = ConfigDict(extra="allow")

    offset: int = Field(ge=0)
    length: int = Field(gt=0)


class MultiModalFeatures(BaseModel):
    model_config = ConfigDict(extra="allow")  # as PlaceholderRangeInfo's

    mm_hashes: dict[str, list[str]]
    mm_placeholders: dict[str, list[PlaceholderRangeInfo]]
    kwargs_data: dict[str, list[str | None]] | None = None
    mm_metadata: dict[str, list[str | None]] | None = None

    @model_validator(mode="after")
    def _validate_parallel_fields(self) -> MultiModalFeatures:
        # vLLM's validator; the rules live in `shared/multimodal`, which routing and the
        # mock engine read them from too. vLLM raises a plain ValueError (its repr shows
        # in the error list).
        placeholders = self.mm_placeholders
        try:
            check_layout(
                self.mm_hashes,
                {m: [(p.offset, p.length) for p in ranges] for m, ranges in placeholders.items()},
                self.kwargs_data,
                self.mm_metadata,
            )
        except FeaturesError as exc:
            raise ValueError(str(exc)) from None
        return self


def _has_serialized_mm_items(payload: dict[str, list[str | None]] | None) -> bool:
    return bool(payload) and any(
        item is not None for items in (payload or {}).values() for item in items
    )


class ReasoningParserKwargs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)


def _packed_prompt(value: Any, checked: ValidatorFunctionWrapHandler) -> TokenIds | list[int]:
    """`token_ids`: a list of plain token ids (every prompt the mesh can carry) is packed
    into TokenIds in one C pass, which also refuses what is not one; anything else, or an
    empty list, is `checked` by pydantic's `list[int]` with vLLM's `min_length=1` (lax:
    booleans, integral floats, numeric strings, big or negative ints), so what is accepted
    and every refusal stay vLLM's. Where both accept they agree: a boolean packs as 0 or 1,
    as pydantic makes it."""
    if isinstance(value, list) and value:
        with contextlib.suppress(TypeError):  # an entry that is no int: pydantic's to judge
            packed = pack_token_ids(value)
            if packed is not None:
                return packed
    result: list[int] = checked(value)
    return result


def _prompt_schema(_source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
    checked = handler.generate_schema(Annotated[list[int], Field(min_length=1)])
    return core_schema.no_info_wrap_validator_function(_packed_prompt, checked)


# vLLM's `token_ids: list[int] = Field(min_length=1)`, packed on the way (`_packed_prompt`).
Prompt = Annotated[TokenIds | list[int], GetPydanticSchema(_prompt_schema)]


class GenerateRequest(BaseModel):
    """vLLM's token-in/token-out `GenerateRequest` (unknown fields are ignored).
    `request_id` has no default here: the format mints the public ID itself."""

    request_id: str | None = None
    token_ids: Prompt
    token_offsets: list[tuple[int, int]] | None = None
    features: MultiModalFeatures | None = None
    content_parts: list[dict[str, Any]] | None = None
    sampling_params: SamplingParams
    model: str | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: ReasoningParserKwargs | None = None
    return_token_ids: bool | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    # Only in the `vllm/frontend/...` build of the protocol (a render-step output).
    assistant_tokens_mask: list[int] | None = None

    model_config = ConfigDict(arbitrary_types_allowed=True)

    @field_validator("token_ids")
    @classmethod
    def validate_token_ids(cls, v: TokenIds | list[int]) -> TokenIds | list[int]:
        # vLLM's check, `any(t < 0 for t in v)`; min() is the same test, done in C. Packed
        # ids are never negative: only the slow path's list needs it.
        if isinstance(v, list) and min(v) < 0:
            raise ValueError("token_ids must not contain negative values")
        return v

    @model_validator(mode="after")
    def _check_mm_fields_exclusive(self) -> GenerateRequest:
        if self.content_parts and self.features:
            raise ValueError("content_parts and features are mutually exclusive")
        return self

    @model_validator(mode="after")
    def _require_ec_for_metadata_only(self) -> GenerateRequest:
        features = self.features
        if features is None or not _has_serialized_mm_items(features.mm_metadata):
            return self
        if self.ec_transfer_params:
            return self
        kwargs_data = features.kwargs_data or {}
        for modality, metadata_items in (features.mm_metadata or {}).items():
            kwargs_items = kwargs_data.get(modality, [None] * len(metadata_items))
            if any(
                metadata is not None and kwargs is None
                for metadata, kwargs in zip(metadata_items, kwargs_items, strict=True)
            ):
                raise ValueError("metadata-only multimodal items require ec_transfer_params")
        return self

    @model_validator(mode="after")
    def _check_output_mode_detokenizes(self) -> GenerateRequest:
        if self.output_mode != "tokens" and not self.sampling_params.detokenize:
            raise ValueError(
                f"output_mode={self.output_mode!r} requires sampling_params.detokenize to be true"
            )
        return self

    @model_validator(mode="after")
    def _validate_multimodal_feature_bounds(self) -> GenerateRequest:
        if self.features is None:
            return self
        ranges = self.features.mm_placeholders.values()
        try:
            check_bounds([MmItem("", p.offset, p.length) for r in ranges for p in r],
                         len(self.token_ids))  # fmt: skip
        except FeaturesError as exc:
            raise ValueError(str(exc)) from None
        return self


# The names each model knows; anything else in a body is ignored (and logged once).
TOP_LEVEL_FIELDS = frozenset(GenerateRequest.model_fields)
SAMPLING_FIELDS = frozenset(SamplingParams.DEFAULTS)
STREAM_OPTION_FIELDS = frozenset(StreamOptions.model_fields)

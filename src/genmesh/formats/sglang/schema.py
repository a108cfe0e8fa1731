"""SGLang's native `/generate` body as pydantic models: the JSON types the real server takes.

`GenerateReqInput` declares every field of SGLang's `GenerateReqInput` (newest
`python/sglang/srt/managers/io_struct.py`) with SGLang's own types, as a standard dataclass
validated the way FastAPI validates SGLang's body: pydantic's lax mode (so `"yes"` is a
boolean and `"3"` an integer, as there), fields SGLang does not know ignored. What fails
here is what FastAPI refuses before any SGLang code runs, and `validation_message` words it
as SGLang's `RequestValidationError` handler does.

`SamplingParams` declares the keys SGLang's `SamplingParams` takes. SGLang itself checks no
JSON types there (a wrong type fails later, with a 500); genmesh checks them strictly, so a
wrong type is a clear 400 in the same legacy shape, and a key SGLang would not take is
refused with the message SGLang's `SamplingParams(**params)` raises.
"""

from __future__ import annotations

import contextlib
from array import array
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, PlainValidator, TypeAdapter, ValidationError

from genmesh.formats.fastapi import body_errors
from genmesh.shared.envelope import IntArray, TokenIds, pack_token_ids

Json = dict[str, Any]


def _i64_row(value: Any, where: str = "") -> IntArray:
    """One prompt: a list of int64 token ids (SGLang checks the first entry, then packs the
    list into a C int64 array, which is what refuses any other entry). Packed here once, in
    C: as TokenIds when every entry is a token id, which is every prompt the mesh can
    carry; else as the int64 array, which `request._prompts` refuses in SGLang's words.
    TokenIds are taken as they are: a client codec's prompt, decoded straight into one
    (codecs/b64zstd), holds token ids only."""
    if isinstance(value, TokenIds):
        return value
    if not isinstance(value, list):
        raise ValueError(f"{where}must be list; got {type(value).__name__}")
    if value and not isinstance(value[0], int):
        raise ValueError(f"{where}elements must be int; got {type(value[0]).__name__}")
    with contextlib.suppress(TypeError):  # a non-int: refused below, as SGLang does
        packed = pack_token_ids(value)
        if packed is not None:
            return packed
    try:
        return array("q", value)
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"{where}contains non-int64 element: {exc}") from None


def input_ids_type(value: Any) -> IntArray | list[IntArray] | None:
    """`input_ids`: null, one prompt, or a batch of prompts (SGLang's C-loop validator)."""
    if value is None or isinstance(value, TokenIds):
        return value
    if not isinstance(value, list):
        raise ValueError(f"must be list or null; got {type(value).__name__}")
    if not value or isinstance(value[0], int):
        return _i64_row(value)
    if isinstance(value[0], list | TokenIds):
        return [_i64_row(row, f"row {i}: ") for i, row in enumerate(value)]
    raise ValueError(f"elements must be int or list; got {type(value[0]).__name__}")


# The multimodal inputs: URLs, paths, Base64, or image objects (Any, as far as JSON goes).
_Multimodal = list[list[Any]] | list[Any] | Any


@dataclass(kw_only=True)
class GenerateReqInput:
    """Every field of SGLang's GenerateReqInput, with its JSON type and default."""

    rid: str | list[str] | None = None
    session_id: str | None = None
    text: list[str] | str | None = None
    input_ids: Annotated[list[IntArray] | IntArray | None, PlainValidator(input_ids_type)] = None
    input_embeds: list[list[list[float]]] | list[list[float]] | None = None
    image_data: _Multimodal | None = None
    video_data: _Multimodal | None = None
    audio_data: _Multimodal | None = None
    mm_hashes: list[str] | list[list[str]] | None = None
    mm_content_hashes: list[str | None] | list[list[str | None]] | None = None
    use_audio_in_video: bool = False
    video_config: dict[str, Any] | None = None
    sampling_params: list[dict[str, Any]] | dict[str, Any] | None = None
    return_logprob: list[bool] | bool | None = None
    logprob_start_len: list[int] | int | None = None
    top_logprobs_num: list[int] | int | None = None
    token_ids_logprob: list[list[int]] | list[int] | None = None
    return_sampling_mask: list[bool] | bool | None = None
    return_text_in_logprobs: bool = False
    return_flat_raw_top_logprobs: bool = False
    return_flat_raw_top_logprobs_b64: bool = False
    stream: bool = False
    log_metrics: bool = True
    # SGLang: a ReturnHiddenStatesMode (a boolean or a mode name), or one per prompt.
    return_hidden_states: Any = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    return_indexer_topk: bool = False
    modalities: list[str] | None = None
    session_params: dict[str, Any] | None = None
    lora_path: list[str | None] | str | None = None
    lora_id: list[str | None] | str | None = None
    custom_logit_processor: list[str | None] | str | None = None
    positional_embed_overrides: Any = None
    bootstrap_host: list[str | None] | str | None = None
    bootstrap_port: list[int | None] | int | None = None
    bootstrap_room: list[int | None] | int | None = None
    bootstrap_pair_key: list[str | None] | str | None = None
    decode_tp_size: list[int | None] | int | None = None
    routed_dp_rank: int | None = None
    data_parallel_rank: int | None = None
    disagg_prefill_dp_rank: int | None = None
    kv_router_hint: dict[str, Any] | None = None
    routing_key: str | None = None
    conversation_id: str | None = None
    http_worker_ipc: str | None = None
    background: bool = False
    require_reasoning: bool = False
    max_thinking_tokens: int | None = None
    priority: int | None = None
    extra_key: list[str] | str | None = None
    no_logs: bool = False
    custom_labels: dict[str, str] | None = None
    return_bytes: bool = False
    return_entropy: bool = False
    return_prompt_token_ids: bool = False
    external_trace_header: dict[str, Any] | None = None
    received_time: float | None = None
    need_wait_for_mm_inputs: bool | None = None
    num_items_assigned: dict[str, list[int]] | None = None
    encoder_urls: list[str] | None = None
    max_dynamic_patch: int | None = None
    min_dynamic_patch: int | None = None
    image_max_dynamic_patch: int | None = None
    video_max_dynamic_patch: int | None = None
    images_config: dict[str, Any] | None = None
    multi_item_delimiter_indices: list[list[int]] | list[int] | None = None
    cache_salt: list[str] | str | None = None


GENERATE_FIELDS = frozenset(GenerateReqInput.__dataclass_fields__)
_BODY = TypeAdapter(GenerateReqInput)


class SamplingParams(BaseModel):
    """The keys SGLang's SamplingParams takes, strictly typed (null = SGLang's default)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    max_new_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int | None] | None = None
    stop_regex: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_new_tokens: int | None = None
    n: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    custom_params: dict[str, Any] | None = None
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    # Read by GenerateReqInput before SamplingParams sees the rest (beam search).
    beam_width: int | None = None
    # SamplingParams' internal fields: its constructor takes them too; nothing reads them
    # from a request here.
    stop_strs: Any = None
    stop_regex_strs: Any = None
    stop_str_max_len: Any = None
    stop_regex_max_len: Any = None
    is_normalized: Any = None


SAMPLING_KEYS = frozenset(SamplingParams.model_fields)


class SchemaError(ValueError):
    """A body of the wrong JSON types: the message is SGLang's, the shape the legacy one."""


def validation_message(errors: list[Json]) -> str:
    """What SGLang's RequestValidationError handler says: FastAPI's summary of the errors,
    then their list. (FastAPI appends the endpoint's source file and line to the summary;
    genmesh cannot know where a server's SGLang is installed and leaves that line out.)"""
    count = len(errors)
    lines = "".join(f"\n  {err}" for err in errors)
    return f"{count} validation error{'s' if count != 1 else ''}:{lines} {errors}"


def validate_body(body: Any) -> GenerateReqInput:
    try:
        return _BODY.validate_python(body)
    except ValidationError as exc:
        raise SchemaError(validation_message(body_errors(exc.errors(include_url=False)))) from None


def validate_sampling(params: Json, where: tuple[Any, ...]) -> SamplingParams:
    """One `sampling_params` map (`where`: its location in the body, for messages)."""
    for key in params:
        if key not in SAMPLING_KEYS:
            # SamplingParams(**params) refuses it so (a TypeError in SGLang).
            raise TypeError(f"Unexpected keyword argument '{key}'")
    try:
        return SamplingParams.model_validate(params)
    except ValidationError as exc:
        errors = body_errors(exc.errors(include_url=False), ("body", *where))
        raise SchemaError(validation_message(errors)) from None

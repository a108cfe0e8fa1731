"""What the mock vLLM server checks before a generate request runs, and its token budget.

Where validation happens, as in vLLM:

- request validation (pydantic, `SamplingParams._verify_args` in `sampling`, the route
  itself) answers HTTP 400 `BadRequestError` (404 `NotFoundError` for an unknown `model`),
  also for a streaming request (`parse_generate`);
- engine-side input checks (token id outside the vocabulary, prompt not shorter than
  `max_model_len`, more than 20 sample or prompt logprobs) surface when the engine takes
  the request: HTTP 400 for a unary request, but `200` + an in-band
  `data: {"error": {...}}` event + `data: [DONE]` for a streaming one (vLLM has already sent
  its stream headers by then) (`engine_check`).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from genmesh.engines.mock import MAX_TOP_LOGPROBS
from genmesh.shared.multimodal import FeaturesError, MmItem, features_items
from genmesh.testkit.config import MockServerConfig
from genmesh.testkit.vllm.errors import ApiError, type_error
from genmesh.testkit.vllm.sampling import (
    DEFAULT_MAX_TOKENS,
    INT64_MAX,
    INT64_MIN,
    Sampling,
    is_int,
    parse_sampling,
)

GENERATE_PATH = "/inference/v1/generate"
ENGINE_ID_PREFIX = "generate-tokens-"

# vLLM's `--max-logprobs` default.
MAX_LOGPROBS = MAX_TOP_LOGPROBS

# Sampling parameters whose effect on token choice the deterministic mock cannot honour.
_UNSUPPORTED_SAMPLING = (
    "structured_outputs",
    "guided_decoding",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "logits_processors",
    "truncate_prompt_tokens",
)


@dataclass(frozen=True, slots=True)
class GenerateOptions:
    """A validated `GenerateRequest`."""

    engine_id: str
    prompt: list[int]
    sampling: Sampling
    stream: bool
    include_usage: bool
    continuous_usage: bool
    model: str | None
    kv_transfer_params: dict[str, Any] | None
    dp_rank: int | None
    # Enters the first block's hash (vLLM's prefix cache isolation).
    cache_salt: str | None = None
    # Rendered multimodal items (`features`), in prompt order: they enter the hashes of
    # the blocks their placeholders touch.
    mm_items: tuple[MmItem, ...] = ()


@dataclass(frozen=True, slots=True)
class _Fields:
    """The request's own optional fields (besides prompt and sampling_params), checked."""

    model: str | None
    stream: bool | None
    include_usage: bool
    continuous_usage: bool
    kv_transfer_params: dict[str, Any] | None
    cache_salt: str | None


def parse_generate(
    raw: bytes, headers: Any, config: MockServerConfig, profile: str
) -> tuple[GenerateOptions, dict[str, Any]]:
    """Validate a generate request as vLLM's route does before the engine sees it; the
    options and the body as sent."""
    body = _json_body(raw, headers)
    request_id = _request_id(body, headers)
    token_ids = _token_ids(body)
    sp = _sampling_params(body)
    fields = _fields(body)
    mm_items = _refuse_unsupported(body, profile)
    sampling = parse_sampling(sp)
    _route_refusals(sp, sampling, config, profile)
    extra = sp.get("extra_args")
    kv_extra = extra.get("kv_transfer_params") if isinstance(extra, dict) else None
    # Newer builds copy the top-level field into extra_args themselves; v0.11-v0.18 do not.
    kv_top = fields.kv_transfer_params
    kv = kv_top if profile == "new" and kv_top is not None else kv_extra
    options = GenerateOptions(
        engine_id=ENGINE_ID_PREFIX + request_id,
        prompt=token_ids,
        sampling=sampling,
        stream=bool(fields.stream) and profile == "new",
        include_usage=fields.include_usage,
        continuous_usage=fields.continuous_usage,
        model=fields.model,
        kv_transfer_params=kv if isinstance(kv, dict) else None,
        dp_rank=_dp_rank(headers.get("X-data-parallel-rank")),
        cache_salt=fields.cache_salt,
        mm_items=mm_items,
    )
    return options, body


def _json_body(raw: bytes, headers: Any) -> dict[str, Any]:
    media_type = headers.get("Content-Type", "").lower().split(";", 1)[0]
    if media_type != "application/json":
        raise ApiError("Unsupported Media Type: Only 'application/json' is allowed")
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise ApiError(f"JSON decode error: {exc}") from None
    if not isinstance(body, dict):
        raise type_error("body", "dictionary or object to extract fields from", body)
    return body


def _request_id(body: dict[str, Any], headers: Any) -> str:
    """The body's `request_id` (a fresh one if none), which `X-Request-Id` overrides."""
    request_id = body.get("request_id", uuid.uuid4().hex)
    if not isinstance(request_id, str):
        raise type_error("request_id", "string", request_id)
    header_id = headers.get("X-Request-Id")
    return request_id if header_id is None else str(header_id)


def _token_ids(body: dict[str, Any]) -> list[int]:
    if "token_ids" not in body:
        raise ApiError("1 validation error for GenerateRequest\ntoken_ids\n  Field required")
    token_ids = body["token_ids"]
    if not isinstance(token_ids, list):
        raise type_error("token_ids", "list", token_ids)
    if not token_ids:
        raise ApiError("1 validation error for GenerateRequest\ntoken_ids\n  List should have at "
                       "least 1 item after validation, not 0")  # fmt: skip
    for i, tid in enumerate(token_ids):
        if not is_int(tid):
            raise type_error(f"token_ids.{i}", "integer", tid)
    if any(tid < 0 for tid in token_ids):
        raise ApiError("1 validation error for GenerateRequest\ntoken_ids\n  Value error, "
                       "token_ids must not contain negative values")  # fmt: skip
    return token_ids


def _sampling_params(body: dict[str, Any]) -> dict[str, Any]:
    if "sampling_params" not in body:
        raise ApiError("1 validation error for GenerateRequest\nsampling_params\n  Field required")
    sp = body["sampling_params"]
    if not isinstance(sp, dict):
        raise type_error("sampling_params", "dictionary", sp)
    return sp


def _fields(body: dict[str, Any]) -> _Fields:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise type_error("model", "string", model)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise type_error("stream", "boolean", stream)
    include_usage, continuous = _stream_options(body.get("stream_options"))
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise type_error("cache_salt", "string", salt)
    if salt is not None and not 1 <= len(salt) <= 1024:
        raise ApiError("Parameter 'cache_salt' must be a non-empty string of at most 1024 "
                       "characters.", 400, "cache_salt")  # fmt: skip
    priority = body.get("priority", 0)
    if not is_int(priority) or not INT64_MIN <= priority <= INT64_MAX:
        raise type_error("priority", "integer", priority)
    kv_top = body.get("kv_transfer_params")
    if kv_top is not None and not isinstance(kv_top, dict):
        raise type_error("kv_transfer_params", "dictionary", kv_top)
    return _Fields(model, stream, include_usage, continuous, kv_top, salt)


def _stream_options(value: Any) -> tuple[bool, bool]:
    """vLLM's `should_include_usage`: (include_usage, continuous_usage_stats)."""
    if value is None:
        return False, False
    if not isinstance(value, dict):
        raise type_error("stream_options", "dictionary", value)
    include = value.get("include_usage", True)
    continuous = value.get("continuous_usage_stats", False)
    for key, flag in (("include_usage", include), ("continuous_usage_stats", continuous)):
        if flag is not None and not isinstance(flag, bool):
            raise type_error(f"stream_options.{key}", "boolean", flag)
    return bool(include), bool(include) and bool(continuous)


def _refuse_unsupported(body: dict[str, Any], profile: str) -> tuple[MmItem, ...]:
    """Text output, multimodal media and encoder caches: what this mock has no model for.
    The rendered multimodal items it serves, in prompt order."""
    if profile == "new":
        output_mode = body.get("output_mode", "tokens")
        if output_mode == "text":
            raise ApiError("output_mode='text' needs a tokenizer; this tokens-only mock server "
                           "answers in output_mode 'tokens' only", 400, "output_mode")  # fmt: skip
        if output_mode != "tokens":
            raise ApiError("1 validation error for GenerateRequest\n  Input tag "
                           f"{output_mode!r:.40} does not match any of the expected tags: "
                           "'tokens', 'text'")  # fmt: skip
    features = body.get("features")
    if profile == "new" and features is not None and not body.get("content_parts"):
        # Rendered multimodal items are served (the model is text-only: they change no
        # token), their layout checked as vLLM checks it.
        try:
            items = tuple(features_items(features, len(body["token_ids"])))
        except FeaturesError as exc:
            raise ApiError(f"1 validation error for GenerateRequest\nfeatures\n  Value error, "
                           f"{exc}", 400, "features") from None  # fmt: skip
        features = None
    else:
        items = ()
    for key, value in (
        ("features", features),
        ("content_parts", body.get("content_parts")),
        ("ec_transfer_params", body.get("ec_transfer_params")),
    ):
        if value:
            raise ApiError(f"{key}: this mock serves a text-only model without multimodal or "
                           "encoder-cache support", 400, key)  # fmt: skip
    return items


def _route_refusals(
    sp: dict[str, Any], sampling: Sampling, config: MockServerConfig, profile: str
) -> None:
    """The route's own refusals of valid sampling parameters."""
    if profile == "new" and sampling.n > 1:
        raise ApiError(
            f"n > 1 is not supported by {GENERATE_PATH}, got n={sampling.n}; "
            "send one request per sample",
            400,
            "n",
        )
    if sp.get("stop") and (profile == "new" or not config.tokens_only):
        if config.tokens_only:
            message = "stop strings are not supported in tokens-only mode; use stop_token_ids"
        else:
            message = "stop strings need a tokenizer and this mock server has none"
        raise ApiError(message, 400, "stop")
    for key in _UNSUPPORTED_SAMPLING:
        if sp.get(key):
            raise ApiError(f"the mock vLLM server cannot honour sampling_params.{key}", 400, key)


def _dp_rank(value: str | None) -> int | None:
    """`X-data-parallel-rank` as vLLM reads it: an int, else ignored."""
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


def engine_check(options: GenerateOptions, config: MockServerConfig) -> ApiError | None:
    """The checks vLLM's engine makes when it takes the request (`add_request`)."""
    prompt_len = len(options.prompt)
    if prompt_len >= config.max_model_len:
        return ApiError(
            f"The decoder prompt (length {prompt_len}) is longer than the maximum model length "
            f"of {config.max_model_len}. Make sure that `max_model_len` is no smaller than the "
            "number of text tokens plus the tokens to generate.",
            400,
            "token_ids",
        )
    highest = max(options.prompt)
    if highest >= config.vocab_size:
        return ApiError(f"Token id {highest} is out of vocabulary", 400, "token_ids")
    for kind, key, value in (
        ("sample", "logprobs", options.sampling.logprobs),
        ("prompt", "prompt_logprobs", options.sampling.prompt_logprobs),
    ):
        if value is None:
            continue
        wanted = config.vocab_size if value == -1 else value
        if wanted > MAX_LOGPROBS:
            return ApiError(  # str(VLLMValidationError) appends parameter and value
                f"Requested {kind} logprobs of {wanted}, which is greater than max allowed: "
                f"{MAX_LOGPROBS} (parameter={key}, value={wanted})",
                400,
                key,
            )
    return None


def budget(options: GenerateOptions, config: MockServerConfig, profile: str) -> int:
    """How many tokens the request may generate: `max_tokens`, capped by the context."""
    room = config.max_model_len - len(options.prompt)
    sampling = options.sampling
    if sampling.max_tokens_sent:
        wanted = room if sampling.max_tokens is None else sampling.max_tokens
    else:
        wanted = room if profile == "new" else DEFAULT_MAX_TOKENS
    return min(wanted, room)

"""What the mock vLLM server checks before a generate request runs, and its token budget.

Where validation happens, as in vLLM:

- request validation (pydantic, `SamplingParams._verify_args`, the route itself) answers
  HTTP 400 `BadRequestError` (404 `NotFoundError` for an unknown `model`), also for a
  streaming request (`parse_generate`);
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
from genmesh.testkit.common import MockServerConfig
from genmesh.testkit.vllm.response import ApiError

GENERATE_PATH = "/inference/v1/generate"

ENGINE_ID_PREFIX = "generate-tokens-"

# vLLM's `--max-logprobs` default.
MAX_LOGPROBS = MAX_TOP_LOGPROBS

# `SamplingParams.max_tokens`' dataclass default: what old builds use when it is omitted.
DEFAULT_MAX_TOKENS = 16

_INT64_MIN, _INT64_MAX, _UINT64_MAX = -(2**63), 2**63 - 1, 2**64 - 1

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


@dataclass(slots=True)
class GenerateOptions:
    """A validated `GenerateRequest`."""

    engine_id: str
    prompt: list[int]
    n: int
    seed: int | None
    # As sent: None = omitted or null (see `budget`).
    max_tokens: int | None
    max_tokens_sent: bool
    min_tokens: int
    stop_token_ids: list[int]
    ignore_eos: bool
    logprobs: int | None
    prompt_logprobs: int | None
    stream: bool
    include_usage: bool
    continuous_usage: bool
    model: str | None
    kv_transfer_params: dict[str, Any] | None
    dp_rank: int | None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _type_error(loc: str, expected: str, value: Any) -> ApiError:
    # pydantic's wording, roughly: "<loc>: Input should be a valid <type>".
    return ApiError(f"1 validation error for GenerateRequest\n{loc}\n  Input should be a valid "
                    f"{expected} [input_value={value!r:.60}]")  # fmt: skip


def _opt_int(sp: dict[str, Any], key: str) -> int | None:
    value = sp.get(key)
    if value is not None and not _is_int(value):
        raise _type_error(f"sampling_params.{key}", "integer", value)
    return value


def _opt_number(sp: dict[str, Any], key: str) -> float | None:
    value = sp.get(key)
    if value is None:
        return None
    if not _is_number(value):
        raise _type_error(f"sampling_params.{key}", "number", value)
    return float(value)


def _opt_bool(sp: dict[str, Any], key: str) -> bool | None:
    value = sp.get(key)
    if value is not None and not isinstance(value, bool):
        raise _type_error(f"sampling_params.{key}", "boolean", value)
    return value


def _invalid(message: str, param: str) -> ApiError:
    """`SamplingParams._verify_args` failures: VLLMValidationError with its parameter."""
    return ApiError(message, 400, param)


def parse_generate(
    raw: bytes, headers: Any, config: MockServerConfig, profile: str
) -> tuple[GenerateOptions, dict[str, Any]]:
    """Validate a generate request as vLLM's route does before the engine sees it."""
    media_type = headers.get("Content-Type", "").lower().split(";", 1)[0]
    if media_type != "application/json":
        raise ApiError("Unsupported Media Type: Only 'application/json' is allowed")
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise ApiError(f"JSON decode error: {exc}") from None
    if not isinstance(body, dict):
        raise _type_error("body", "dictionary or object to extract fields from", body)

    request_id = body.get("request_id", uuid.uuid4().hex)
    if not isinstance(request_id, str):
        raise _type_error("request_id", "string", request_id)
    header_id = headers.get("X-Request-Id")
    if header_id is not None:
        request_id = header_id

    if "token_ids" not in body:
        raise ApiError("1 validation error for GenerateRequest\ntoken_ids\n  Field required")
    token_ids = body["token_ids"]
    if not isinstance(token_ids, list):
        raise _type_error("token_ids", "list", token_ids)
    if not token_ids:
        raise ApiError("1 validation error for GenerateRequest\ntoken_ids\n  List should have at "
                       "least 1 item after validation, not 0")  # fmt: skip
    for i, tid in enumerate(token_ids):
        if not _is_int(tid):
            raise _type_error(f"token_ids.{i}", "integer", tid)
    if any(tid < 0 for tid in token_ids):
        raise ApiError("1 validation error for GenerateRequest\ntoken_ids\n  Value error, "
                       "token_ids must not contain negative values")  # fmt: skip

    if "sampling_params" not in body:
        raise ApiError("1 validation error for GenerateRequest\nsampling_params\n  Field required")
    sp = body["sampling_params"]
    if not isinstance(sp, dict):
        raise _type_error("sampling_params", "dictionary", sp)

    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _type_error("model", "string", model)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _type_error("stream", "boolean", stream)
    include_usage, continuous = _stream_options(body.get("stream_options"))
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise _type_error("cache_salt", "string", salt)
    if salt is not None and not 1 <= len(salt) <= 1024:
        raise ApiError("Parameter 'cache_salt' must be a non-empty string of at most 1024 "
                       "characters.", 400, "cache_salt")  # fmt: skip
    priority = body.get("priority", 0)
    if not _is_int(priority) or not _INT64_MIN <= priority <= _INT64_MAX:
        raise _type_error("priority", "integer", priority)
    kv_top = body.get("kv_transfer_params")
    if kv_top is not None and not isinstance(kv_top, dict):
        raise _type_error("kv_transfer_params", "dictionary", kv_top)
    if profile == "new":
        output_mode = body.get("output_mode", "tokens")
        if output_mode == "text":
            raise ApiError("output_mode='text' needs a tokenizer; this tokens-only mock server "
                           "answers in output_mode 'tokens' only", 400, "output_mode")  # fmt: skip
        if output_mode != "tokens":
            raise ApiError("1 validation error for GenerateRequest\n  Input tag "
                           f"{output_mode!r:.40} does not match any of the expected tags: "
                           "'tokens', 'text'")  # fmt: skip
    for key in ("features", "content_parts", "ec_transfer_params"):
        if body.get(key):
            raise ApiError(f"{key}: this mock serves a text-only model without multimodal or "
                           "encoder-cache support", 400, key)  # fmt: skip

    options = _sampling(sp, token_ids, config, profile)
    options.engine_id = ENGINE_ID_PREFIX + request_id
    options.stream = bool(stream) and profile == "new"
    options.include_usage = include_usage
    options.continuous_usage = continuous
    options.model = model
    extra = sp.get("extra_args")
    kv_extra = extra.get("kv_transfer_params") if isinstance(extra, dict) else None
    # Newer builds copy the top-level field into extra_args themselves; v0.11-v0.18 do not.
    kv = kv_top if profile == "new" and kv_top is not None else kv_extra
    options.kv_transfer_params = kv if isinstance(kv, dict) else None
    options.dp_rank = _dp_rank(headers.get("X-data-parallel-rank"))
    return options, body


def _stream_options(value: Any) -> tuple[bool, bool]:
    """vLLM's `should_include_usage`: (include_usage, continuous_usage_stats)."""
    if value is None:
        return False, False
    if not isinstance(value, dict):
        raise _type_error("stream_options", "dictionary", value)
    include = value.get("include_usage", True)
    continuous = value.get("continuous_usage_stats", False)
    for key, flag in (("include_usage", include), ("continuous_usage_stats", continuous)):
        if flag is not None and not isinstance(flag, bool):
            raise _type_error(f"stream_options.{key}", "boolean", flag)
    return bool(include), bool(include) and bool(continuous)


def _dp_rank(value: str | None) -> int | None:
    """`X-data-parallel-rank` as vLLM reads it: an int, else ignored."""
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


def _sampling(
    sp: dict[str, Any], prompt: list[int], config: MockServerConfig, profile: str
) -> GenerateOptions:
    """`SamplingParams` as vLLM builds and verifies them (unknown keys are ignored, as
    pydantic ignores extra keys of the struct)."""
    n = _opt_int(sp, "n")
    n = 1 if n is None else n
    numbers = {
        key: _opt_number(sp, key)
        for key in (
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "temperature",
            "top_p",
            "min_p",
        )
    }
    top_k = _opt_int(sp, "top_k")
    seed = _opt_int(sp, "seed")
    max_tokens = _opt_int(sp, "max_tokens")
    min_tokens = _opt_int(sp, "min_tokens")
    min_tokens = 0 if min_tokens is None else min_tokens
    logprobs = _opt_int(sp, "logprobs")
    prompt_logprobs = _opt_int(sp, "prompt_logprobs")
    ignore_eos = _opt_bool(sp, "ignore_eos")
    for key in (
        "detokenize",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
    ):
        _opt_bool(sp, key)
    stop = sp.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise _type_error("sampling_params.stop", "string or list of strings", stop)
    stop_ids = sp.get("stop_token_ids")
    if stop_ids is None:
        stop_ids = []
    if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
        raise _type_error("sampling_params.stop_token_ids", "list of integers", stop_ids)
    extra = sp.get("extra_args")
    if extra is not None and not isinstance(extra, dict):
        raise _type_error("sampling_params.extra_args", "dictionary", extra)

    # SamplingParams._verify_args, in vLLM's order and wording.
    if n < 1:
        raise _invalid(f"n must be at least 1, got {n}.", "n")
    for key in ("presence_penalty", "frequency_penalty"):
        value = numbers[key]
        if value is not None and not -2.0 <= value <= 2.0:
            raise _invalid(f"{key} must be in [-2, 2], got {value}.", key)
    repetition = numbers["repetition_penalty"]
    if repetition is not None and repetition <= 0.0:
        raise _invalid(
            f"repetition_penalty must be greater than zero, got {repetition}.",
            "repetition_penalty",
        )
    temperature = numbers["temperature"]
    if temperature is not None and temperature < 0.0:
        raise _invalid(f"temperature must be non-negative, got {temperature}.", "temperature")
    top_p = numbers["top_p"]
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise _invalid(f"top_p must be in (0, 1], got {top_p}.", "top_p")
    if top_k is not None and top_k < -1:
        raise _invalid(f"top_k must be 0 (disable), or at least 1, got {top_k}.", "top_k")
    min_p = numbers["min_p"]
    if min_p is not None and not 0.0 <= min_p <= 1.0:
        raise _invalid(f"min_p must be in [0, 1], got {min_p}.", "min_p")
    max_tokens_sent = "max_tokens" in sp
    # The struct is built (and verified) with the dataclass default when max_tokens is
    # omitted; the newest route replaces it only afterwards. So `min_tokens > 16` without
    # `max_tokens` is refused, as in vLLM.
    verified_max = max_tokens if max_tokens_sent else DEFAULT_MAX_TOKENS
    if verified_max is not None and verified_max < 1:
        raise _invalid(f"max_tokens must be at least 1, got {verified_max}.", "max_tokens")
    if min_tokens < 0:
        raise _invalid(
            f"min_tokens must be greater than or equal to 0, got {min_tokens}.", "min_tokens"
        )
    if verified_max is not None and min_tokens > verified_max:
        raise _invalid(
            f"min_tokens must be less than or equal to max_tokens={verified_max}, "
            f"got {min_tokens}.",
            "min_tokens",
        )
    for key, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value is not None and value < -1:
            raise _invalid(f"{key} must be non-negative or -1, got {value}.", key)
    if seed is not None and not _INT64_MIN <= seed <= _UINT64_MAX:
        raise ApiError(f"int too big to convert: seed {seed}", 400, "seed")
    if any(not 0 <= t <= _UINT64_MAX for t in stop_ids):
        raise _type_error("sampling_params.stop_token_ids", "list of non-negative integers",
                          stop_ids)  # fmt: skip

    # The route's own refusals.
    if profile == "new" and n > 1:
        raise ApiError(
            f"n > 1 is not supported by {GENERATE_PATH}, got n={n}; send one request per sample",
            400,
            "n",
        )
    has_stop_strings = bool(stop)
    if has_stop_strings and (profile == "new" or not config.tokens_only):
        if config.tokens_only:
            message = "stop strings are not supported in tokens-only mode; use stop_token_ids"
        else:
            message = "stop strings need a tokenizer and this mock server has none"
        raise ApiError(message, 400, "stop")
    for key in _UNSUPPORTED_SAMPLING:
        if sp.get(key):
            raise ApiError(f"the mock vLLM server cannot honour sampling_params.{key}", 400, key)

    return GenerateOptions(
        engine_id="",
        prompt=prompt,
        n=n,
        seed=seed,
        max_tokens=max_tokens,
        max_tokens_sent=max_tokens_sent,
        min_tokens=min_tokens,
        stop_token_ids=list(stop_ids),
        ignore_eos=bool(ignore_eos),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        stream=False,
        include_usage=False,
        continuous_usage=False,
        model=None,
        kv_transfer_params=None,
        dp_rank=None,
    )


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
        ("sample", "logprobs", options.logprobs),
        ("prompt", "prompt_logprobs", options.prompt_logprobs),
    ):
        if value is None:
            continue
        wanted = config.vocab_size if value == -1 else value
        if wanted > MAX_LOGPROBS:
            return ApiError(
                f"Requested {kind} logprobs of {wanted}, which is greater than max allowed: "
                f"{MAX_LOGPROBS}",
                400,
                key,
            )
    return None


def budget(options: GenerateOptions, config: MockServerConfig, profile: str) -> int:
    """How many tokens the request may generate: `max_tokens`, capped by the context."""
    room = config.max_model_len - len(options.prompt)
    if options.max_tokens_sent:
        wanted = room if options.max_tokens is None else options.max_tokens
    else:
        wanted = room if profile == "new" else DEFAULT_MAX_TOKENS
    return min(wanted, room)

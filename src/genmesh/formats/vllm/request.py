"""vLLM `/inference/v1/generate` requests: parse, validate as vLLM does, project onto envelopes.

The server behaves like vLLM started with `--tokens-only` (reference `engine-apis.md` §B):
token ids in, token ids out, no tokenizer, so stop strings, `bad_words` and multimodal
`features` are refused with 400.

IDs. The client's ID is the trimmed, non-empty `X-Request-Id` header, else the body's
`request_id` (the header wins, as in vLLM and Dynamo); it travels only as `client_id` and
the handler mints the private ID. The response's `request_id` is `"generate-tokens-" +
<client ID>` (or + a fresh public ID when the client sent none): the prefix is what the
newest vLLM builds return, in unary bodies and in every SSE chunk (§B.4, §B.5); only the
earliest v0.11 builds returned a bare random uuid. The `X-Request-Id` response header
carries the bare ID.

Defaults are vLLM's `SamplingParams` defaults, except `max_tokens`: an omitted
`max_tokens` is sent as None, so the engine uses the room left in its context, as newer
vLLM does (older builds silently used 16).

`n > 1` fans out into one envelope per sample with `n = 1` each; with a `seed`, sample `i`
gets `seed + i`, which is what vLLM V1's parallel sampling gives its child requests.
Prompt logprobs are asked of sample 0 only (every sample has the same prompt).

The envelope's `engine` map is the body as the client sent it (for engines that speak
vLLM), minus `request_id`, `token_ids`, `stream` and `stream_options`, which the mesh
handles; a fanned-out sample's `sampling_params` say `n = 1` and carry its own seed.
`kv_transfer_params` stays at the top level: an adapter for vLLM v0.11-v0.18, which reads
it only from `sampling_params.extra_args`, copies it there.

Errors use vLLM's envelope `{"error": {"message", "type", "param", "code"}}`; messages
reuse `SamplingParams`' wording where vLLM has one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from genmesh.formats.base import Bound, RequestRejected
from genmesh.formats.checks import oversized_int
from genmesh.shared.engine_info import NO_ENGINES, EngineCatalog
from genmesh.shared.envelope import (
    MAX_TOKEN_ID,
    Envelope,
    OutputOptions,
    Routing,
    Sampling,
    finite_float,
)

FORMAT = "vllm"
RESPONSE_ID_PREFIX = "generate-tokens-"
# vLLM's default `max_num_seqs`; also a bound on how many envelopes one request fans into.
MAX_N = 256
MAX_CACHE_SALT = 1024
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_UINT64_MAX = 2**64 - 1
_UINT32_MAX = 2**32 - 1

# Fields of `GenerateRequest` this server understands.
_CORE = (
    "request_id",
    "token_ids",
    "sampling_params",
    "model",
    "stream",
    "stream_options",
    "cache_salt",
    "priority",
    "kv_transfer_params",
    "output_mode",
)
# Fields a tokens-only, text-only-model server cannot honour, with the reason it gives.
_UNSUPPORTED = {
    "features": "multimodal inputs (features) are not supported by this server",
    "ec_transfer_params": "encoder-cache transfer (ec_transfer_params) is not supported "
    "by this server",
}
KNOWN_FIELDS = frozenset((*_CORE, *_UNSUPPORTED))
# Fields the mesh handles itself: they never reach an engine's native payload.
_NOT_FORWARDED = frozenset(("request_id", "token_ids", "stream", "stream_options"))

_INT_PARAMS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs")
_NUMBER_PARAMS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_BOOL_PARAMS = (
    "ignore_eos",
    "detokenize",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "flat_logprobs",
    "skip_reading_prefix_cache",
    "return_sampling_mask",
    "return_sampling_mask_logprobs",
)
_DICT_PARAMS = ("structured_outputs", "extra_args", "logit_bias")
# Accepted; the engine adapter sets it (vLLM's server does too: DELTA for streams).
_SERVER_OWNED = ("output_kind",)
_UNSUPPORTED_PARAMS = {
    "logits_processors": "custom logits processors are not enabled on this server",
    "truncate_prompt_tokens": "truncate_prompt_tokens is not supported by this server; "
    "truncate token_ids yourself",
}
KNOWN_SAMPLING_PARAMS = frozenset(
    (
        *_INT_PARAMS,
        *_NUMBER_PARAMS,
        *_BOOL_PARAMS,
        *_DICT_PARAMS,
        *_SERVER_OWNED,
        *_UNSUPPORTED_PARAMS,
        "stop",
        "stop_token_ids",
        "bad_words",
        "allowed_token_ids",
    )
)


def error_type(status: int) -> str:
    """vLLM's `type` for an HTTP status: `BadRequestError`, `NotFoundError`,
    `InternalServerError`, `NotImplementedError`, `ServiceUnavailableError`, ..."""
    if status == 499:
        return "RequestCancelledError"
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        return "InternalServerError" if status >= 500 else "BadRequestError"
    name = "".join(word[:1].upper() + word[1:] for word in re.split(r"[\s-]+", phrase))
    return name if name.endswith("Error") else name + "Error"


def error(message: str, status: int = 400, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": error_type(status),
            "param": param,
            "code": status,
        }
    }


def _reject(message: str, param: str | None = None, status: int = 400) -> RequestRejected:
    return RequestRejected(status, error(message, status, param), message)


@dataclass(frozen=True, slots=True)
class VllmOptions:
    """What the renderer needs to know about the request."""

    prompt_tokens: int
    # Sample logprobs top-k (`sampling_params.logprobs`); None = no logprobs.
    logprobs: int | None
    # Prompt logprobs top-k (`sampling_params.prompt_logprobs`); None = none.
    prompt_logprobs: int | None
    # The model the client named, for vLLM's not-found message.
    model: str | None
    # `stream_options.include_usage` (True once stream_options is sent) and
    # `continuous_usage_stats` (only together with include_usage, as in vLLM).
    include_usage: bool
    continuous_usage: bool


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def parse(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise _reject(f"JSON decode error: {exc}") from None


def _check_content_type(headers: Mapping[str, str]) -> None:
    """vLLM's `validate_json_request`: only `application/json` bodies."""
    content_type = _header(headers, "content-type") or ""
    if content_type.split(";", 1)[0].strip().lower() != "application/json":
        raise _reject("Unsupported Media Type: Only 'application/json' is allowed")


def _token_ids(body: Mapping[str, Any]) -> list[int]:
    if "token_ids" not in body or body["token_ids"] is None:
        raise _reject("token_ids: Field required", "token_ids")
    ids = body["token_ids"]
    if not isinstance(ids, list):
        raise _reject(
            f"token_ids: Input should be a valid list, got {_type_name(ids)}", "token_ids"
        )
    if not ids:
        raise _reject("token_ids: List should have at least 1 item after validation, not 0",
                      "token_ids")  # fmt: skip
    for i, tid in enumerate(ids):
        if not _is_int(tid):
            raise _reject(
                f"token_ids.{i}: Input should be a valid integer, got {tid!r:.40}", "token_ids"
            )
        if tid < 0:
            raise _reject(f"token_ids.{i}: token ids must be non-negative, got {tid}", "token_ids")
        if tid > MAX_TOKEN_ID:
            raise _reject(f"token_ids.{i}: token id {tid} is out of range", "token_ids")
    return ids


def _int_param(sp: Mapping[str, Any], key: str) -> int | None:
    value = sp.get(key)
    if value is not None and not _is_int(value):
        raise _reject(
            f"sampling_params.{key}: Input should be a valid integer, got {value!r:.40}",
            f"sampling_params.{key}",
        )
    return value


def _number_param(sp: Mapping[str, Any], key: str) -> float | None:
    value = sp.get(key)
    if value is None:
        return None
    param = f"sampling_params.{key}"
    if not _is_number(value):
        raise _reject(
            f"sampling_params.{key}: Input should be a valid number, got {value!r:.40}", param
        )
    number = finite_float(value)
    if number is None:
        raise _reject(f"{key} must be a finite number, got {value!r:.40}.", param)
    return number


def _bool_param(sp: Mapping[str, Any], key: str) -> bool | None:
    value = sp.get(key)
    if value is not None and not isinstance(value, bool):
        raise _reject(
            f"sampling_params.{key}: Input should be a valid boolean, got {value!r:.40}",
            f"sampling_params.{key}",
        )
    return value


def _token_list_param(sp: Mapping[str, Any], key: str) -> list[int]:
    value = sp.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in value):
        raise _reject(
            f"sampling_params.{key}: Input should be a list of non-negative token ids",
            f"sampling_params.{key}",
        )
    return value


@dataclass(slots=True)
class _Sampling:
    """The validated sampling parameters of one request (before fan-out)."""

    canonical: Sampling
    n: int
    logprobs: int | None
    prompt_logprobs: int | None


def _sampling(sp: Mapping[str, Any]) -> _Sampling:
    unknown = sorted(set(sp) - KNOWN_SAMPLING_PARAMS)
    if unknown:
        raise _reject(
            f"unsupported sampling_params field(s): {', '.join(unknown)} "
            "(sampling_params take vLLM SamplingParams names)",
            "sampling_params",
        )
    for key, reason in _UNSUPPORTED_PARAMS.items():
        if sp.get(key) is not None:
            raise _reject(reason, f"sampling_params.{key}")
    ints = {key: _int_param(sp, key) for key in _INT_PARAMS}
    numbers = {key: _number_param(sp, key) for key in _NUMBER_PARAMS}
    bools = {key: _bool_param(sp, key) for key in _BOOL_PARAMS}
    for key in _DICT_PARAMS:
        value = sp.get(key)
        if value is not None and not isinstance(value, dict):
            raise _reject(
                f"sampling_params.{key}: Input should be a valid dictionary",
                f"sampling_params.{key}",
            )

    n = 1 if ints["n"] is None else ints["n"]
    if n < 1:
        raise _reject(f"n must be at least 1, got {n}.", "sampling_params.n")
    if n > MAX_N:
        raise _reject(f"n must be at most {MAX_N}, got {n}.", "sampling_params.n")
    for key in ("presence_penalty", "frequency_penalty"):
        value = numbers[key]
        if value is not None and not -2.0 <= value <= 2.0:
            raise _reject(f"{key} must be in [-2, 2], got {value}.", f"sampling_params.{key}")
    repetition = numbers["repetition_penalty"]
    if repetition is not None and repetition <= 0.0:
        raise _reject(
            f"repetition_penalty must be greater than zero, got {repetition}.",
            "sampling_params.repetition_penalty",
        )
    temperature = numbers["temperature"]
    if temperature is not None and temperature < 0.0:
        raise _reject(
            f"temperature must be non-negative, got {temperature}.",
            "sampling_params.temperature",
        )
    top_p = numbers["top_p"]
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise _reject(f"top_p must be in (0, 1], got {top_p}.", "sampling_params.top_p")
    top_k = ints["top_k"]
    if top_k is not None and top_k < -1:
        raise _reject(
            f"top_k must be 0 (disable), or at least 1, got {top_k}.", "sampling_params.top_k"
        )
    min_p = numbers["min_p"]
    if min_p is not None and not 0.0 <= min_p <= 1.0:
        raise _reject(f"min_p must be in [0, 1], got {min_p}.", "sampling_params.min_p")
    max_tokens = ints["max_tokens"]
    if max_tokens is not None and max_tokens < 1:
        raise _reject(
            f"max_tokens must be at least 1, got {max_tokens}.", "sampling_params.max_tokens"
        )
    min_tokens = ints["min_tokens"] or 0
    if min_tokens < 0:
        raise _reject(
            f"min_tokens must be greater than or equal to 0, got {min_tokens}.",
            "sampling_params.min_tokens",
        )
    if max_tokens is not None and min_tokens > max_tokens:
        raise _reject(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.",
            "sampling_params.min_tokens",
        )
    for key in ("logprobs", "prompt_logprobs"):
        value = ints[key]
        if value is not None and value < -1:
            raise _reject(
                f"{key} must be non-negative or -1, got {value}.", f"sampling_params.{key}"
            )
        if value == -1:
            raise _reject(
                f"{key}=-1 (the whole vocabulary) is not supported by this server; ask for a top-k",
                f"sampling_params.{key}",
            )
    seed = ints["seed"]
    if seed is not None and not _INT64_MIN <= seed <= _UINT64_MAX - (n - 1):
        raise _reject(f"seed must be in [-2**63, 2**64 - n], got {seed}.", "sampling_params.seed")
    stop = sp.get("stop")
    if not (stop is None or isinstance(stop, str) or (
        isinstance(stop, list) and all(isinstance(s, str) for s in stop)
    )):  # fmt: skip
        raise _reject(
            "sampling_params.stop: Input should be a string or a list of strings",
            "sampling_params.stop",
        )
    if stop:
        raise _reject(
            "stop strings need a tokenizer and this tokens-only server has none; "
            "use stop_token_ids",
            "sampling_params.stop",
        )
    bad_words = sp.get("bad_words")
    if bad_words:
        raise _reject(
            "bad_words need a tokenizer and this tokens-only server has none",
            "sampling_params.bad_words",
        )
    stop_ids = _token_list_param(sp, "stop_token_ids")
    _token_list_param(sp, "allowed_token_ids")
    _check_logit_bias(sp.get("logit_bias"))
    canonical = Sampling(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        # vLLM's SamplingParams defaults, so every engine samples as vLLM would.
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=None if top_k in (None, 0, -1) else top_k,
        min_p=0.0 if min_p is None else min_p,
        seed=seed,
        stop_token_ids=list(stop_ids),
        ignore_eos=bool(bools["ignore_eos"]),
    )
    return _Sampling(canonical, n, ints["logprobs"], ints["prompt_logprobs"])


def _check_logit_bias(bias: Any) -> None:
    if bias is None:
        return
    assert isinstance(bias, dict)
    for key, value in bias.items():
        if not re.fullmatch(r"[0-9]+", str(key)) or int(key) > MAX_TOKEN_ID:
            raise _reject(
                f"sampling_params.logit_bias: keys must be token ids, got {key!r:.40}",
                "sampling_params.logit_bias",
            )
        if not _is_number(value) or finite_float(value) is None:
            raise _reject(
                f"sampling_params.logit_bias: values must be finite numbers, got {value!r:.40}",
                "sampling_params.logit_bias",
            )


def _stream_options(body: Mapping[str, Any]) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) for a stream."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not isinstance(options, dict):
        raise _reject(
            "stream_options: Input should be a valid dictionary or null", "stream_options"
        )
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise _reject(f"unsupported stream_options field(s): {', '.join(unknown)}",
                      "stream_options")  # fmt: skip
    for key in ("include_usage", "continuous_usage_stats"):
        value = options.get(key)
        if value is not None and not isinstance(value, bool):
            raise _reject(
                f"stream_options.{key}: Input should be a valid boolean, got {value!r:.40}",
                f"stream_options.{key}",
            )
    include = options.get("include_usage")
    include = True if include is None else include
    return include, include and bool(options.get("continuous_usage_stats"))


def _optional_str(body: Mapping[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise _reject(f"{key}: Input should be a valid string, got {_type_name(value)}", key)
    return value


def _client_id(body: Mapping[str, Any], headers: Mapping[str, str]) -> str | None:
    """The trimmed, non-empty `X-Request-Id` header, else the body's `request_id`."""
    body_id = _optional_str(body, "request_id")
    return _header(headers, "x-request-id") or body_id or None


def _dp_rank(headers: Mapping[str, str]) -> int | None:
    """`X-data-parallel-rank` as a u32; malformed values are ignored, as Dynamo does."""
    value = _header(headers, "x-data-parallel-rank")
    if value is None or not re.fullmatch(r"\+?[0-9]+", value):
        return None
    rank = int(value)
    return rank if rank <= _UINT32_MAX else None


def _priority(body: Mapping[str, Any]) -> int | None:
    """vLLM's priority (lower = more urgent) as a routing priority (higher = more
    urgent): negated, saturating at the bounds of a signed 64-bit integer."""
    value = body.get("priority")
    if value is None:
        return None
    if not _is_int(value):
        raise _reject(f"priority: Input should be a valid integer, got {value!r:.40}", "priority")
    negated: int = -value
    return max(_INT64_MIN, min(_INT64_MAX, negated))


def _cache_salt(body: Mapping[str, Any]) -> str | None:
    salt = _optional_str(body, "cache_salt")
    if salt is not None and not 1 <= len(salt) <= MAX_CACHE_SALT:
        raise _reject(
            f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} characters",
            "cache_salt",
        )
    return salt


def bind(body: Any, headers: Mapping[str, str], engines: EngineCatalog = NO_ENGINES) -> Bound:
    _check_content_type(headers)
    if not isinstance(body, dict):
        raise _reject(f"request body must be a JSON object, got {_type_name(body)}")
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        raise _reject(f"unsupported top-level vLLM generate field(s): {', '.join(unknown)}")
    for key, reason in _UNSUPPORTED.items():
        if body.get(key) not in (None, {}, ""):
            raise _reject(reason, key)
    output_mode = body.get("output_mode")
    if output_mode not in (None, "tokens"):
        raise _reject(
            f"output_mode {output_mode!r:.40} is not supported: this tokens-only server "
            "answers in output_mode 'tokens'",
            "output_mode",
        )

    prompt = _token_ids(body)
    sp = body.get("sampling_params")
    if sp is None:
        raise _reject("sampling_params: Field required", "sampling_params")
    if not isinstance(sp, dict):
        raise _reject(
            f"sampling_params: Input should be a valid dictionary, got {_type_name(sp)}",
            "sampling_params",
        )
    sampling = _sampling(sp)
    model = _optional_str(body, "model")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _reject(f"stream: Input should be a valid boolean, got {stream!r:.40}", "stream")
    include_usage, continuous = _stream_options(body)
    kv_transfer = body.get("kv_transfer_params")
    if kv_transfer is not None and not isinstance(kv_transfer, dict):
        raise _reject("kv_transfer_params: Input should be a valid dictionary or null",
                      "kv_transfer_params")  # fmt: skip
    routing = Routing(
        dp_rank=_dp_rank(headers), priority=_priority(body), cache_salt=_cache_salt(body)
    )
    client_id = _client_id(body, headers)

    k_out, k_prompt = sampling.logprobs, sampling.prompt_logprobs
    # The native payload as the client sent it, minus what the mesh handles itself.
    native = {k: v for k, v in body.items() if k not in _NOT_FORWARDED}
    _check_wire_ints(native)
    items: list[Envelope] = []
    for index in range(sampling.n):
        canonical = sampling.canonical.copy()
        item_native = dict(native)
        if sampling.n > 1:
            # Each sample asks its engine for one generation (the fan-out is the mesh's).
            item_native["sampling_params"] = {**sp, "n": 1}
            if canonical.seed is not None:
                canonical.seed += index
                item_native["sampling_params"]["seed"] = canonical.seed
        wants_prompt = k_prompt is not None and index == 0
        top = max(k_out or 0, k_prompt or 0) if wants_prompt else k_out or 0
        output = OutputOptions(
            logprobs=k_out is not None,
            top_logprobs=top,
            prompt_logprobs_start=0 if wants_prompt else None,
        )
        items.append(
            Envelope(
                id="",
                token_ids=prompt,
                format=FORMAT,
                model=model,
                client_id=client_id,
                sampling=canonical,
                output=output,
                routing=routing.copy(),
                engine=item_native,
            )
        )
    options = VllmOptions(
        prompt_tokens=len(prompt),
        logprobs=k_out,
        prompt_logprobs=k_prompt,
        model=model,
        include_usage=include_usage,
        continuous_usage=continuous,
    )
    return Bound(
        items=items,
        stream=bool(stream),
        client_id=client_id,
        options=options,
        migration=migration_refusal(sp),
    )


def migration_refusal(sp: Mapping[str, Any]) -> str | None:
    """Why replaying the delivered tokens as prompt would change what comes next."""
    for key in (
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
    ):
        if sp.get(key) is not None:
            return f"guided decoding ({key}) would restart its grammar from the start"
    for key in ("presence_penalty", "frequency_penalty"):
        if sp.get(key):
            return f"{key} counts generated tokens, which a continuation sees as prompt"
    temperature = sp.get("temperature")
    if sp.get("seed") is not None and (temperature is None or temperature > 0):
        # vLLM's per-request generator would start over on the new worker.
        return "seeded sampling (seed with temperature > 0) restarts its random generator"
    return None


def _check_wire_ints(value: Any) -> None:
    found = oversized_int(value)
    if found is not None:
        path, number = found
        raise _reject(f"{path}: integer {number} does not fit in 64 bits", path)


def _header(headers: Mapping[str, str], name: str) -> str | None:
    """A trimmed, non-empty header value; `name` is lower case. aiohttp's headers are
    case-insensitive already; plain mappings (tests, other hosts) are searched."""
    value = headers.get(name)
    if value is None:
        value = next((v for k, v in headers.items() if k.lower() == name), None)
    if value is None:
        return None
    value = value.strip()
    return value or None

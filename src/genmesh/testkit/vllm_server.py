"""A mock vLLM server: token-in/token-out `POST /inference/v1/generate` without a GPU.

    genmesh testkit vllm --port 8100 [--no-tokens-only]

It speaks vLLM's wire format as the reference describes it (`engine-apis.md` §B, §E "vLLM
mock"), written from that reference and vLLM's sources, not from genmesh's vLLM format, so
that tests of genmesh's vLLM engine adapter catch rendering and parsing bugs on either side.

Profiles (`build_app(config, profile=...)`):

- `"new"` (default, the CLI's): vLLM's scale-out token-in/token-out route. SSE deltas with
  one choice per event, the terminal chunk always sent (also an abort without new tokens),
  a usage chunk `{"request_id", "choices": [], "usage"}` when `stream_options` asks for it
  (`include_usage` defaults to true once `stream_options` is sent), `usage` on every chunk
  with `continuous_usage_stats`, then `data: [DONE]`. Engine id and response `request_id`
  are `"generate-tokens-" + id`. Omitted `max_tokens` = `max_model_len - len(token_ids)`.
  Tokens-mode logprobs with integer ids and ranks. `n > 1` is refused (400), as the newest
  route does.
- `"old"` (vLLM ≈ v0.11-v0.18): `stream` is ignored (one JSON body), logprobs use the
  placeholder strings `"token_id:N"` (with each alternative's own id), omitted `max_tokens`
  is 16, `n > 1` gives `n` choices, top-level `kv_transfer_params` is not forwarded to the
  engine (only `sampling_params.extra_args.kv_transfer_params` is).

Generation is genmesh's deterministic token model (`genmesh.engines.mock`):
greedy over a rolling hash of (seed or 0, every token so far), min-tokens masking of EOS and
stop ids, so the mock returns exactly the tokens and logprobs the mock worker engine does.

Where validation happens, as in vLLM:

- request validation (pydantic, `SamplingParams._verify_args`, the route itself) answers
  HTTP 400 `BadRequestError` (404 `NotFoundError` for an unknown `model`), also for a
  streaming request;
- engine-side input checks (token id outside the vocabulary, prompt not shorter than
  `max_model_len`, more than 20 sample or prompt logprobs) surface when the engine takes
  the request: HTTP 400 for a unary request, but `200` + an in-band
  `data: {"error": {...}}` event + `data: [DONE]` for a streaming one (vLLM has already sent
  its stream headers by then).

Faults (`genmesh.testkit.common`), consulted once per generate request that passed
validation, fire after `after_tokens` decode steps (if the generation lasts that long):
`http_error` answers `status` with vLLM's error envelope (with `after_tokens > 0`: a stream
gets an in-band error event + `[DONE]`, a unary request the error status after generating);
`abort` finishes with `finish_reason: "abort"` (vLLM's abort carries no status or message,
so `status`/`message` are unused); `drop` aborts the TCP connection; `no_terminal` ends a
stream without terminal chunk and `[DONE]`; `done_early` sends `[DONE]` without terminal
chunk; `hang` stops sending until the client goes away or the request is aborted (then it
finishes with "abort"). For a unary request `no_terminal` and `done_early` both answer 200
with a JSON body cut short.

Extra admin route (besides `/testkit/...` from `common`): `GET /testkit/vllm/requests`
lists the generate requests the mock accepted (`{"request_id", "headers", "body"}`, the
last 1000), `DELETE` clears it; adapter tests assert on what was sent.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Literal

from aiohttp import web

from genmesh.engines.faults import Fault, Running, ServerState
from genmesh.engines.mock import (
    MAX_TOP_LOGPROBS,
    TokenModel,
    advance,
    initial_state,
)
from genmesh.shared.tasks import wait_event
from genmesh.testkit.common import STATE as STATE_KEY
from genmesh.testkit.common import MockServerConfig, add_admin_routes

Profile = Literal["new", "old"]
PROFILES: tuple[str, ...] = ("new", "old")

GENERATE_PATH = "/inference/v1/generate"
ENGINE_ID_PREFIX = "generate-tokens-"
MIN_LOGPROB = -9999.0
# vLLM's `--max-logprobs` default.
MAX_LOGPROBS = MAX_TOP_LOGPROBS
# `SamplingParams.max_tokens`' dataclass default: what old builds use when it is omitted.
DEFAULT_MAX_TOKENS = 16
VLLM_VERSION = "0.20.0+genmesh.mock"
KV_BLOCK_SIZE = 16
NIXL_SIDE_CHANNEL_PORT = 5600
_INT64_MIN, _INT64_MAX, _UINT64_MAX = -(2**63), 2**63 - 1, 2**64 - 1
_REQUEST_LOG_LIMIT = 1000
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

CONFIG = web.AppKey("vllm_config", MockServerConfig)
PROFILE = web.AppKey("vllm_profile", str)
ENGINE_IDS = web.AppKey("vllm_engine_ids", dict[str, str])
REQUEST_LOG = web.AppKey("vllm_request_log", deque[dict[str, Any]])
ENGINE_UUID = web.AppKey("vllm_engine_uuid", str)
BLOCKS = web.AppKey("vllm_kv_blocks", list[int])


# ---------------------------------------------------------------------------- errors


def error_type(status: int) -> str:
    """vLLM's error `type` for a status: `BadRequestError`, `NotFoundError`, ..."""
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        return "InternalServerError" if status >= 500 else "BadRequestError"
    name = "".join(word[:1].upper() + word[1:] for word in phrase.replace("-", " ").split())
    return name if name.endswith("Error") else name + "Error"


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """vLLM's `ErrorResponse`: `{"error": {"message", "type", "param", "code"}}`."""
    return {
        "error": {"message": message, "type": error_type(status), "param": param, "code": status}
    }


class ApiError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.param)

    def response(self) -> web.Response:
        return _json_response(self.body(), self.status)


def _dumps(obj: Any) -> str:
    # Starlette's JSONResponse rendering (and pydantic's model_dump_json): compact.
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(text=_dumps(obj), status=status, content_type="application/json")


def _http_exception(status: int, detail: str) -> web.Response:
    """What vLLM's HTTPException handler answers: the envelope, `type` = reason phrase."""
    body = error_body(detail, status)
    body["error"]["type"] = HTTPStatus(status).phrase
    return _json_response(body, status)


# --------------------------------------------------------------------------- request


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


# ------------------------------------------------------------------------ generation


def clamp(logprob: float) -> float:
    return max(float(logprob), MIN_LOGPROB)


@dataclass(slots=True)
class Step:
    token: int
    logprob: float
    rank: int
    # The k best candidates at this position, best first (k = requested logprobs).
    top: list[tuple[int, float]]
    finish_reason: str | None = None
    stop_reason: int | None = None


@dataclass(slots=True)
class Sample:
    """One sequence: the deterministic model continued greedily from the prompt."""

    model: TokenModel
    state: int
    budget: int
    min_tokens: int
    stops: frozenset[int]
    eos: int
    ignore_eos: bool
    top_k: int
    index: int = 0
    tokens: list[int] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | None = None

    def step(self) -> Step:
        n = len(self.tokens)
        model = self.model
        masked = n < self.min_tokens
        candidates = model.top(self.state, MAX_TOP_LOGPROBS if masked else 1)
        token, logprob = candidates[0]
        banned = self.stops if self.ignore_eos else self.stops | {self.eos}
        if masked and token in banned:
            # vLLM's min-tokens processor masks EOS and stop ids: the best allowed one wins.
            token, logprob = next(
                ((t, lp) for t, lp in candidates if t not in banned), candidates[0]
            )
        rank = model.score(self.state, token)[1]
        top = model.top(self.state, self.top_k) if self.top_k > 0 else []
        self.state = advance(self.state, token)
        self.tokens.append(token)
        out = Step(token, logprob, rank, top)
        if not masked and token == self.eos and not self.ignore_eos:
            out.finish_reason = "stop"
        elif not masked and token in self.stops:
            out.finish_reason, out.stop_reason = "stop", token
        elif n + 1 >= self.budget:
            out.finish_reason = "length"
        self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        self.steps.append(out)
        return out


def prompt_state(model: TokenModel, seed: int | None, prompt: list[int]) -> int:
    state = initial_state(seed or 0)
    for tid in prompt:
        state = advance(state, tid)
    return state


def prompt_logprobs(
    model: TokenModel, seed: int | None, prompt: list[int], k: int
) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: entry 0 null, then per position a map from the prompt
    token (first) and the top-k candidates to `{logprob, rank, decoded_token}`; tokens-only
    servers do not detokenize, so `decoded_token` is null."""
    out: list[dict[str, Any] | None] = []
    state = initial_state(seed or 0)
    for pos, tid in enumerate(prompt):
        if pos == 0:
            out.append(None)
        else:
            logprob, rank = model.score(state, tid)
            entry = {str(tid): {"logprob": clamp(logprob), "rank": rank, "decoded_token": None}}
            for place, (alt, alt_lp) in enumerate(model.top(state, k) if k > 0 else [], 1):
                entry.setdefault(
                    str(alt), {"logprob": clamp(alt_lp), "rank": place, "decoded_token": None}
                )
            out.append(entry)
        state = advance(state, tid)
    return out


def _step_entries(step: Step, k: int) -> list[tuple[int, float, int]]:
    """The first max(k, 1) items of vLLM's per-position logprob dict: the sampled token
    (its engine rank), then the top-k candidates (rank = place) without repeating it."""
    entries = [(step.token, step.logprob, step.rank)]
    for place, (tid, logprob) in enumerate(step.top, 1):
        if len(entries) >= max(k, 1):
            break
        if tid != step.token:
            entries.append((tid, logprob, place))
    return entries[: max(k, 1)]


def logprob_content(step: Step, k: int, profile: str) -> dict[str, Any]:
    entries = _step_entries(step, k)
    if profile == "new":
        return {
            "token_id": step.token,
            "logprob": clamp(step.logprob),
            "rank": step.rank,
            "top_logprobs": [
                {"token_id": tid, "logprob": clamp(lp), "rank": rank} for tid, lp, rank in entries
            ],
        }
    return {
        "token": f"token_id:{step.token}",
        "logprob": clamp(step.logprob),
        "bytes": None,
        "top_logprobs": [
            {"token": f"token_id:{tid}", "logprob": clamp(lp), "bytes": None}
            for tid, lp, _ in entries
        ],
    }


# -------------------------------------------------------------------------- handlers


class _ClientGone(Exception):
    """The client closed the connection."""


@dataclass
class _Run:
    """One accepted generate request, from its first decode step to its last byte."""

    request: web.Request
    options: GenerateOptions
    config: MockServerConfig
    profile: str
    state: ServerState
    running: Running
    fault: Fault | None
    key: str
    samples: list[Sample] = field(default_factory=list)
    response: web.StreamResponse | None = None
    fault_abort: bool = False
    dropped: bool = False
    completed: bool = False

    @property
    def k(self) -> int:
        return self.options.logprobs or 0

    def aborted(self) -> bool:
        return self.fault_abort or self.running.aborted.is_set()

    def completion_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.samples)

    def usage(self, completion: int | None = None) -> dict[str, Any]:
        prompt = len(self.options.prompt)
        done = self.completion_tokens() if completion is None else completion
        return {"prompt_tokens": prompt, "total_tokens": prompt + done, "completion_tokens": done}

    def check_connection(self) -> None:
        transport = self.request.transport
        if transport is None or transport.is_closing():
            raise _ClientGone

    async def pause(self) -> None:
        """One decode step's time (`state.token_delay_s`, re-read while waiting, so
        `/testkit/config` changes running requests at once); wakes early on abort."""
        started = time.monotonic()
        await asyncio.sleep(0)
        while not self.running.aborted.is_set():
            remaining = started + self.state.token_delay_s - time.monotonic()
            if remaining <= 0:
                break
            if not await wait_event(self.running.aborted, min(remaining, 0.05)):
                self.check_connection()
        self.check_connection()

    async def write(self, payload: Any) -> None:
        assert self.response is not None
        data = payload if isinstance(payload, str) else _dumps(payload)
        try:
            await self.response.write(f"data: {data}\n\n".encode())
        except ConnectionResetError:
            raise _ClientGone from None

    async def execute(self) -> web.StreamResponse:
        opts = self.options
        model = TokenModel(self.config.vocab_size)
        limit = budget(opts, self.config, self.profile)
        for index in range(opts.n):
            seed = opts.seed if opts.seed is None else opts.seed + index
            self.samples.append(
                Sample(
                    model=model,
                    state=prompt_state(model, seed, opts.prompt),
                    budget=limit,
                    min_tokens=opts.min_tokens,
                    stops=frozenset(opts.stop_token_ids),
                    eos=self.config.eos_token_id,
                    ignore_eos=opts.ignore_eos,
                    top_k=self.k,
                    index=index,
                )
            )
        self.running.waiting = False
        if opts.stream:
            self.response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream; charset=utf-8"}
            )
            await self.response.prepare(self.request)

        steps = 0
        while True:
            live = [s for s in self.samples if s.finish_reason is None]
            if not live:
                break
            if self.fault is not None and steps >= self.fault.after_tokens:
                fault, self.fault = self.fault, None
                done = await self.apply_fault(fault)
                if done is not None:
                    return done
            if not self.aborted():
                await self.pause()
            if self.aborted():
                for sample in live:
                    sample.finish_reason = "abort"
                    if opts.stream:
                        await self.write(self.chunk(sample, None))
                break
            for sample in live:
                step = sample.step()
                if opts.stream:
                    await self.write(self.chunk(sample, step))
            steps += 1
        self.completed = all(s.finish_reason in ("stop", "length") for s in self.samples)
        if self.response is not None:
            if opts.include_usage:
                await self.write(
                    {
                        "request_id": opts.engine_id,
                        "usage": self.usage(),
                        "output_mode": "tokens",
                        "choices": [],
                    }
                )
            await self.write("[DONE]")
            await self.response.write_eof()
            return self.response
        return _json_response(self.body())

    def chunk(self, sample: Sample, step: Step | None) -> dict[str, Any]:
        """One SSE event: a delta of one choice (`step` None = the abort terminal)."""
        logprobs = None
        if self.options.logprobs is not None:
            content = [] if step is None else [logprob_content(step, self.k, self.profile)]
            logprobs = {"content": content}
        usage = None
        if self.options.continuous_usage:
            usage = {**self.usage(len(sample.tokens)), "prompt_tokens_details": None}
        return {
            "request_id": self.options.engine_id,
            "usage": usage,
            "prompt_token_ids": None,
            "mm_placeholders": None,
            "metrics": None,
            "output_mode": "tokens",
            "choices": [
                {
                    "index": sample.index,
                    "finish_reason": sample.finish_reason,
                    "token_ids": [] if step is None else [step.token],
                    "routed_experts": None,
                    "sampling_mask": None,
                    "weight_versions": None,
                    "logprobs": logprobs,
                    "stop_reason": sample.stop_reason,
                }
            ],
        }

    def body(self) -> dict[str, Any]:
        opts = self.options
        model = TokenModel(self.config.vocab_size)
        choices = []
        for sample in self.samples:
            logprobs = None
            if opts.logprobs is not None:
                logprobs = {
                    "content": [logprob_content(s, self.k, self.profile) for s in sample.steps]
                }
            if self.profile == "new":
                choices.append(
                    {
                        "index": sample.index,
                        # A null finish is reported as "stop".
                        "finish_reason": sample.finish_reason or "stop",
                        "token_ids": list(sample.tokens),
                        "routed_experts": None,
                        "sampling_mask": None,
                        "weight_versions": None,
                        "logprobs": logprobs,
                        "stop_reason": sample.stop_reason,
                    }
                )
            else:
                choices.append(
                    {
                        "index": sample.index,
                        "logprobs": logprobs,
                        "finish_reason": sample.finish_reason or "stop",
                        "token_ids": list(sample.tokens),
                        "stop_reason": sample.stop_reason,
                    }
                )
        plp = None
        if opts.prompt_logprobs is not None:
            plp = prompt_logprobs(model, opts.seed, opts.prompt, opts.prompt_logprobs)
        out: dict[str, Any] = {
            "request_id": opts.engine_id,
            "model": self.config.model,
            "created": int(time.time()),
            "usage": {**self.usage(), "prompt_tokens_details": None},
            "prompt_logprobs": plp,
        }
        if self.profile == "new":
            out.update(prompt_token_id_logprobs=None, prompt_token_ids=None,
                       mm_placeholders=None, metrics=None)  # fmt: skip
        out["kv_transfer_params"] = self.kv_transfer_out()
        if self.profile == "new":
            out.update(ec_transfer_params=None, output_mode="tokens")
        out["choices"] = choices
        return out

    def kv_transfer_out(self) -> dict[str, Any] | None:
        """A P/D prefill's reply (NIXL connector `request_finished`): only for a request
        sent with `do_remote_decode` that finished length-capped."""
        params = self.options.kv_transfer_params
        if not params or not params.get("do_remote_decode"):
            return None
        if any(s.finish_reason != "length" for s in self.samples):
            return None
        app = self.request.app
        # Full blocks only: the decode side recomputes a partial last block.
        count = len(self.options.prompt) // KV_BLOCK_SIZE
        start = app[BLOCKS][0]
        app[BLOCKS][0] = start + count
        transport = self.request.transport
        sockname = transport.get_extra_info("sockname") if transport is not None else None
        host = sockname[0] if isinstance(sockname, tuple) else "127.0.0.1"
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(range(start, start + count))],
            "remote_engine_id": app[ENGINE_UUID],
            "remote_request_id": self.options.engine_id,
            "remote_host": host,
            "remote_port": NIXL_SIDE_CHANNEL_PORT,
            "tp_size": 1,
        }

    async def apply_fault(self, fault: Fault) -> web.StreamResponse | None:
        """Act out an injected fault; a response ends the request, None carries on."""
        stream = self.response is not None
        if fault.kind == "abort":
            self.fault_abort = True
            return None
        if fault.kind == "hang":
            while not self.running.aborted.is_set():
                if not await wait_event(self.running.aborted, 0.05):
                    self.check_connection()
            return None
        if fault.kind == "http_error":
            if not stream:
                return _json_response(error_body(fault.message, fault.status), fault.status)
            await self.write(error_body(fault.message, fault.status))
            await self.write("[DONE]")
            assert self.response is not None
            await self.response.write_eof()
            return self.response
        if fault.kind == "drop":
            transport = self.request.transport
            if transport is not None:
                transport.abort()
            self.dropped = True
            return self.response if self.response is not None else web.Response()
        # no_terminal, done_early
        if not stream:
            text = _dumps(self.body())
            return web.Response(
                text=text[: len(text) // 2], status=200, content_type="application/json"
            )
        assert self.response is not None
        if fault.kind == "done_early":
            await self.write("[DONE]")
        await self.response.write_eof()
        return self.response


async def _generate(request: web.Request) -> web.StreamResponse:
    app = request.app
    config = app[CONFIG]
    profile = app[PROFILE]
    state = app[STATE_KEY]
    if "traceparent" in request.headers:
        state.traceparents.append(request.headers["traceparent"])
    raw = await request.read()
    try:
        options, body = parse_generate(raw, request.headers, config, profile)
        if options.model is not None and options.model != config.model:
            raise ApiError(f"The model `{options.model}` does not exist.", 404, "model")
    except ApiError as exc:
        return exc.response()
    log = app[REQUEST_LOG]
    log.append(
        {
            "request_id": options.engine_id,
            "headers": {
                name: request.headers[name]
                for name in ("X-Request-Id", "X-data-parallel-rank")
                if name in request.headers
            },
            "body": body,
        }
    )
    problem = engine_check(options, config)
    if problem is not None:
        if not options.stream:
            return problem.response()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        await response.write(f"data: {_dumps(problem.body())}\n\ndata: [DONE]\n\n".encode())
        await response.write_eof()
        return response

    fault = state.next_fault()
    key = options.engine_id
    suffix = 0
    while key in state.running:  # a duplicate id: vLLM tells them apart internally
        suffix += 1
        key = f"{options.engine_id}#{suffix}"
    running = state.start(key)
    engine_ids = app[ENGINE_IDS]
    engine_ids[key] = options.engine_id
    run = _Run(request, options, config, profile, state, running, fault, key)
    try:
        if fault is not None and fault.kind == "http_error" and fault.after_tokens <= 0:
            return _json_response(error_body(fault.message, fault.status), fault.status)
        return await run.execute()
    except asyncio.CancelledError:
        if not run.dropped:
            state.disconnected.append(key)
        raise
    except _ClientGone:
        state.disconnected.append(key)
        return run.response if run.response is not None else web.Response(status=499)
    finally:
        engine_ids.pop(key, None)
        state.finish(running, completed=run.completed)


async def _abort_requests(request: web.Request) -> web.Response:
    """`POST /abort_requests` (tokens-only servers): fire and forget, 200 with no body.
    vLLM knows requests by their engine id; the bare id is accepted too."""
    arrived = time.time()
    try:
        body = json.loads(await request.read())
    except ValueError as exc:
        return _http_exception(400, f"JSON decode error: {exc}")
    if not isinstance(body, dict):
        return _http_exception(400, "request body must be a JSON object")
    ids = body.get("request_ids")
    if ids is None:
        return _http_exception(400, "Missing 'request_ids' in request body")
    if isinstance(ids, str):
        ids = [ids]
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        return _http_exception(400, "'request_ids' must be a list of strings")
    wanted = set(ids)
    state = request.app[STATE_KEY]
    state.abort_calls.append({"ids": list(ids), "at": arrived})
    engine_ids = request.app[ENGINE_IDS]

    def matches(key: str) -> bool:
        engine_id = engine_ids.get(key)
        if engine_id is None or state.running[key].aborted.is_set():
            return False
        return engine_id in wanted or engine_id.removeprefix(ENGINE_ID_PREFIX) in wanted

    state.abort_matching(matches)
    return web.Response(status=200)


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200 if request.app[STATE_KEY].healthy else 503)


async def _models(request: web.Request) -> web.Response:
    config = request.app[CONFIG]
    created = int(time.time())
    return _json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": config.model,
                    "object": "model",
                    "created": created,
                    "owned_by": "vllm",
                    "root": config.model,
                    "parent": None,
                    "max_model_len": config.max_model_len,
                    "permission": [
                        {
                            "id": f"modelperm-{uuid.uuid4().hex}",
                            "object": "model_permission",
                            "created": created,
                            "allow_create_engine": False,
                            "allow_sampling": True,
                            "allow_logprobs": True,
                            "allow_search_indices": False,
                            "allow_view": True,
                            "allow_fine_tuning": False,
                            "organization": "*",
                            "group": None,
                            "is_blocking": False,
                        }
                    ],
                }
            ],
        }
    )


async def _version(request: web.Request) -> web.Response:
    return _json_response({"version": VLLM_VERSION})


async def _requests_log(request: web.Request) -> web.Response:
    log = request.app[REQUEST_LOG]
    return _json_response({"requests": list(log)})


async def _clear_requests_log(request: web.Request) -> web.Response:
    request.app[REQUEST_LOG].clear()
    return web.Response()


@web.middleware
async def _fastapi_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Unknown routes and methods answer as FastAPI does: `{"detail": ...}`."""
    try:
        response: web.StreamResponse = await handler(request)
    except web.HTTPNotFound:
        return _json_response({"detail": "Not Found"}, 404)
    except web.HTTPMethodNotAllowed:
        return _json_response({"detail": "Method Not Allowed"}, 405)
    return response


def build_app(config: MockServerConfig, *, profile: Profile = "new") -> web.Application:
    """The mock vLLM server as an aiohttp application (run it with
    `genmesh.testkit.serving`)."""
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {', '.join(PROFILES)}, got {profile!r}")
    if config.vocab_size < 2 or not 0 <= config.eos_token_id < config.vocab_size:
        raise ValueError("the vocabulary must hold at least 2 tokens, EOS among them")
    app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=[_fastapi_errors])
    state = ServerState(token_delay_s=config.token_delay_ms / 1000)
    add_admin_routes(app, state)
    app[CONFIG] = config
    app[PROFILE] = profile
    app[ENGINE_IDS] = {}
    app[REQUEST_LOG] = deque(maxlen=_REQUEST_LOG_LIMIT)
    app[ENGINE_UUID] = str(uuid.uuid4())
    app[BLOCKS] = [0]
    app.router.add_post(GENERATE_PATH, _generate)
    if config.tokens_only:
        app.router.add_post("/abort_requests", _abort_requests)
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/version", _version)
    app.router.add_get("/testkit/vllm/requests", _requests_log)
    app.router.add_delete("/testkit/vllm/requests", _clear_requests_log)
    return app


def state_of(app: web.Application) -> ServerState:
    """The app's generation state (what `/testkit/state` reports)."""
    return app[STATE_KEY]

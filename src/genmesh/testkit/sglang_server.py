"""A mock SGLang server: the native HTTP API of `sglang.launch_server --skip-tokenizer-init`.

    genmesh testkit sglang --port 30000 [--incremental] [--token-delay-ms 5]

It speaks SGLang's wire format as the engine itself does (reference `engine-apis.md` §A),
written independently of genmesh's own SGLang format code so that it can catch bugs in
genmesh's rendering and parsing:

- `POST`/`PUT /generate`: `input_ids` (one prompt or a batch), `rid`, `sampling_params`,
  `stream`, logprobs (`return_logprob`, `logprob_start_len`, `top_logprobs_num`,
  `token_ids_logprob`) and routed experts (`return_routed_experts`,
  `routed_experts_start_len`). Errors take SGLang's three shapes: 400 `{"error": ...}`
  for a rejected request (or an in-band `data: {"error": ...}` event once a stream has
  started), 400 `{"object": "error", ...}` for a malformed body, and the scheduler's
  abort finish reasons.
- Streaming is cumulative (SGLang's default) or incremental (`--incremental`), reported
  by `/get_server_info` as `incremental_streaming_output` and the legacy `stream_output`.
- `POST /abort_request` aborts by rid *prefix* (after an exact-match check), like SGLang.
- `/health`, `/health_generate`, `/get_model_info` (`/model_info`), `/get_server_info`
  (`/server_info`), `/v1/models`, `/flush_cache`.

Tokens come from genmesh's deterministic token model (`genmesh.engines.
mock`): the same tokens, logprobs and routed experts the mock worker engine produces.
Tests inject faults and read state through the `/testkit/` routes of
`genmesh.testkit.common`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import struct
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, TypeGuard

import orjson
from aiohttp import web

from genmesh.engines.faults import Fault, Running, ServerState
from genmesh.engines.mock import (
    MAX_TOP_LOGPROBS,
    ExpertModel,
    MockConfig,
    TokenModel,
    advance,
    initial_state,
)
from genmesh.shared.tasks import wait_event
from genmesh.testkit.common import MockServerConfig, add_admin_routes

# The SGLang release this mock imitates: `--incremental-streaming-output` era (sglang#20614).
SGLANG_VERSION = "0.5.10"
WEIGHT_VERSION = "default"
# What the KV pool would hold; only reported by /get_server_info.
MAX_TOTAL_NUM_TOKENS = 1_048_576
# The MoE shape of the routed-expert rows, the mock worker engine's defaults.
_MOE = MockConfig()

SKIP_TOKENIZER_TEXT = (
    "The engine initialized with skip_tokenizer_init=True cannot accept text prompts. "
    "Please provide input_ids or re-initialize the engine with skip_tokenizer_init=False."
)
WAITING_ABORT = "Abort in waiting queue"
_DONE = b"data: [DONE]\n\n"
# How often a handler waiting for tokens checks that its client is still there.
_DISCONNECT_POLL_S = 0.5

JSON = dict[str, Any]
LogprobEntry = list[Any]  # [logprob | None, token_id, None]


class _Malformed(Exception):
    """A body FastAPI/pydantic would refuse before the handler runs: 400 `object: error`."""

    def __init__(self, errors: list[JSON]) -> None:
        super().__init__(errors)
        self.errors = errors

    @property
    def message(self) -> str:
        # FastAPI's RequestValidationError: f"{exc} {exc.errors()}".
        count = len(self.errors)
        lines = "\n".join(f"  {e!r}" for e in self.errors)
        return f"{count} validation error{'s' if count > 1 else ''}:\n{lines} {self.errors!r}"


class _Rejected(ValueError):
    """A ValueError in SGLang's normalize/tokenize/validate steps: 400 `{"error": ...}`."""


# ---------------------------------------------------------------- responses


def _dumps(obj: Any) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)


def _json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=_dumps(obj), status=status, content_type="application/json")


def _error_response(message: str, status: int = 400) -> web.Response:
    """`_create_error_response`: what a ValueError becomes on a non-streaming request."""
    return _json_response({"error": {"message": message}}, status)


def _http_exception(status: int, message: str) -> web.Response:
    """FastAPI's HTTPException handler in SGLang's http_server (`ErrorResponse`)."""
    body = {"object": "error", "message": message, "type": str(status), "param": None}
    return _json_response({**body, "code": status}, status)


def _malformed_response(exc: _Malformed) -> web.Response:
    body = {"object": "error", "message": exc.message, "type": "Bad Request", "param": None}
    return _json_response({**body, "code": 400}, 400)


def _sse(obj: Any) -> bytes:
    return b"data: " + _dumps(obj) + b"\n\n"


def _abort_reason(message: str, status: int | None) -> JSON:
    """`FINISH_ABORT(message, status_code, err_type).to_json()`."""
    err_type = "BadRequestError" if status == 400 else None
    return {"type": "abort", "message": message, "status_code": status, "err_type": err_type}


# ---------------------------------------------------------------- body type checks
#
# SGLang parses the body into `GenerateReqInput` with pydantic; a wrong JSON type fails
# there, before any SGLang code runs, with a 400 `object: error` reply.


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_int_list(v: Any) -> bool:
    return isinstance(v, list) and all(_is_int(x) for x in v)


def _as_bool(v: Any) -> bool | None:
    """pydantic's lax bool: true/false, 0/1 and the usual strings; None if not a bool."""
    if isinstance(v, bool):
        return v
    if _is_int(v) and v in (0, 1):
        return bool(v)
    if isinstance(v, str):
        low = v.strip().lower()
        if low in ("true", "1", "yes", "on", "t", "y"):
            return True
        if low in ("false", "0", "no", "off", "f", "n"):
            return False
    return None


def _check_body(raw: bytes) -> JSON:
    if not raw.strip():
        raise _Malformed([{"type": "missing", "loc": ("body",), "msg": "Field required"}])
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        err = {"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error"}
        raise _Malformed([{**err, "input": {}, "ctx": {"error": str(exc)}}]) from exc
    if not isinstance(body, dict):
        raise _Malformed(
            [
                {
                    "type": "dataclass_type",
                    "loc": ("body",),
                    "msg": "Input should be a dictionary or an instance of GenerateReqInput",
                    "input": body,
                }
            ]
        )
    errors: list[JSON] = []

    def bad(name: str, kind: str, msg: str) -> None:
        errors.append({"type": kind, "loc": ("body", name), "msg": msg, "input": body[name]})

    def present(name: str) -> bool:
        return body.get(name) is not None

    for name in ("stream", "return_text_in_logprobs", "return_routed_experts"):
        if name in body:
            value = _as_bool(body[name])
            if value is None:
                bad(name, "bool_parsing", "Input should be a valid boolean")
            else:
                body[name] = value
    if present("return_logprob"):
        value = body["return_logprob"]
        if isinstance(value, list):
            coerced = [_as_bool(v) for v in value]
            if any(v is None for v in coerced):
                bad("return_logprob", "bool_parsing", "Input should be a valid boolean")
            else:
                body["return_logprob"] = coerced
        elif _as_bool(value) is None:
            bad("return_logprob", "bool_parsing", "Input should be a valid boolean")
        else:
            body["return_logprob"] = _as_bool(value)
    for name in ("logprob_start_len", "top_logprobs_num"):
        if present(name) and not (_is_int(body[name]) or _is_int_list(body[name])):
            bad(name, "int_type", "Input should be a valid integer")
    if "routed_experts_start_len" in body and not _is_int(body["routed_experts_start_len"]):
        bad("routed_experts_start_len", "int_type", "Input should be a valid integer")
    if present("priority") and not _is_int(body["priority"]):
        bad("priority", "int_type", "Input should be a valid integer")
    if present("text"):
        text = body["text"]
        if not (
            isinstance(text, str)
            or (isinstance(text, list) and all(isinstance(t, str) for t in text))
        ):
            bad("text", "string_type", "Input should be a valid string")
    if present("input_ids"):
        ids = body["input_ids"]
        if not (
            _is_int_list(ids)
            or (isinstance(ids, list) and all(_is_int_list(p) for p in ids) and len(ids) > 0)
        ):
            bad(
                "input_ids",
                "value_error",
                "Value error, input_ids must be a list of int64 or a list of lists of int64",
            )
    if present("token_ids_logprob"):
        tids = body["token_ids_logprob"]
        if not (
            _is_int(tids)
            or _is_int_list(tids)
            or (isinstance(tids, list) and all(_is_int_list(t) for t in tids))
        ):
            bad("token_ids_logprob", "list_type", "Input should be a valid list")
    if present("sampling_params"):
        sp = body["sampling_params"]
        if not (
            isinstance(sp, dict) or (isinstance(sp, list) and all(isinstance(s, dict) for s in sp))
        ):
            bad("sampling_params", "dict_type", "Input should be a valid dictionary")
    if present("rid"):
        rid = body["rid"]
        if not (
            isinstance(rid, str) or (isinstance(rid, list) and all(isinstance(r, str) for r in rid))
        ):
            bad("rid", "string_type", "Input should be a valid string")
    if present("session_params") and not isinstance(body["session_params"], dict):
        bad("session_params", "dict_type", "Input should be a valid dictionary")
    if errors:
        raise _Malformed(errors)
    return body


# ---------------------------------------------------------------- request normalization


@dataclass(slots=True)
class _Item:
    """One generation of a (possibly batched, possibly n>1) request, fully validated."""

    index: int
    rid: str
    prompt: list[int]
    max_new_tokens: int  # after the scheduler's clamp
    min_new_tokens: int
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    seed: int
    stream_interval: int
    return_logprob: bool
    logprob_start: int  # absolute prompt position of the first input logprob entry
    top_logprobs_num: int
    token_ids_logprob: list[int] | None
    return_routed_experts: bool
    routed_experts_start: int
    # A 400 abort the scheduler raises for this request (`set_finish_with_abort`).
    scheduler_abort: str | None = None


def _per_item(
    body: JSON, name: str, default: Any, *, single: bool, batch: int, n: int
) -> list[Any]:
    """`_normalize_logprob_params`: one value per prompt of the batch."""
    value = body.get(name)
    if value is None:
        return [default] * batch
    if not isinstance(value, list):
        return [value] * batch
    if single:
        raise _Rejected(f"{name} should be a scalar for a single request.")
    if n > 1:
        raise _Rejected(f"Cannot use list {name} with parallel_sample_num > 1")
    if len(value) != batch:
        raise _Rejected(f"The length of {name} should be equal to the batch size.")
    return value


def _number(sp: JSON, name: str, default: float) -> float:
    value = sp.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _Rejected(f"{name} must be a number, got {value!r}.")
    return float(value)


def _integer(sp: JSON, name: str, default: int | None) -> int | None:
    value = sp.get(name, default)
    if value is None:
        return None
    if not _is_int(value):
        raise _Rejected(f"{name} must be an integer, got {value!r}.")
    return int(value)


@dataclass(frozen=True, slots=True)
class _Sampling:
    max_new_tokens: int | None
    min_new_tokens: int
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    seed: int
    stream_interval: int
    grammar: str | None


def _sampling(sp: JSON, vocab_size: int) -> _Sampling:
    """`SamplingParams(**sp)`, `.normalize(None)` and `.verify(vocab)`, with SGLang's messages.

    Unknown keys are tolerated (SGLang itself would raise a TypeError). Wrong value types
    get this mock's own messages (SGLang would fail with a 500)."""
    # normalize(tokenizer=None): string stops need a tokenizer.
    for key in ("stop", "stop_regex"):
        value = sp.get(key)
        if value is None:
            continue
        if isinstance(value, str):
            value = [value]
        if value:
            raise _Rejected(
                f"{key}={value!r} is unavailable when skip_tokenizer_init=True "
                "(requires tokenizer to decode tokens to text for matching)."
            )
    temperature = _number(sp, "temperature", 1.0)
    top_p = _number(sp, "top_p", 1.0)
    top_k = _integer(sp, "top_k", -1)
    top_k = -1 if top_k is None else top_k
    min_p = _number(sp, "min_p", 0.0)
    frequency_penalty = _number(sp, "frequency_penalty", 0.0)
    presence_penalty = _number(sp, "presence_penalty", 0.0)
    repetition_penalty = _number(sp, "repetition_penalty", 1.0)
    min_new_tokens = _integer(sp, "min_new_tokens", 0) or 0
    max_new_tokens = _integer(sp, "max_new_tokens", 128)
    # __post_init__: a zero temperature means greedy, i.e. top_k = 1.
    if 0 <= temperature < 1e-6:
        top_k = 1
    # verify(vocab_size)
    if not math.isfinite(temperature) or temperature < 0.0:
        raise _Rejected(f"temperature must be a non-negative finite number, got {temperature}.")
    if not 0.0 < top_p <= 1.0:
        raise _Rejected(f"top_p must be in (0, 1], got {top_p}.")
    if not 0.0 <= min_p <= 1.0:
        raise _Rejected(f"min_p must be in [0, 1], got {min_p}.")
    if top_k < 1 and top_k != -1:
        raise _Rejected(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    if not -2.0 <= frequency_penalty <= 2.0:
        raise _Rejected(f"frequency_penalty must be in [-2, 2], got {frequency_penalty}.")
    if not -2.0 <= presence_penalty <= 2.0:
        raise _Rejected(f"presence_penalty must be in [-2, 2], got {presence_penalty}.")
    if not 0.0 < repetition_penalty <= 2.0:
        raise _Rejected(
            f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {repetition_penalty}."
        )
    if min_new_tokens < 0:
        raise _Rejected(f"min_new_tokens must be in [0, max_new_tokens], got {min_new_tokens}.")
    if max_new_tokens is not None:
        if max_new_tokens < 0:
            raise _Rejected(f"max_new_tokens must be at least 0, got {max_new_tokens}.")
        if not min_new_tokens <= max_new_tokens:
            raise _Rejected(
                f"min_new_tokens must be in [0, max_new_tokens({max_new_tokens})], "
                f"got {min_new_tokens}."
            )
    logit_bias = sp.get("logit_bias")
    if logit_bias is not None:
        if not isinstance(logit_bias, dict):
            raise _Rejected(f"logit_bias must be an object, got {logit_bias!r}.")
        for token_id in logit_bias:
            try:
                bias_id = int(token_id)
            except ValueError as exc:  # SGLang's int(token_id) fails the same way
                raise _Rejected(str(exc)) from exc
            if not 0 <= bias_id < vocab_size:
                raise _Rejected(
                    f"logit_bias must has keys in [0, {vocab_size - 1}], got {token_id}."
                )
    grammars = [k for k in ("json_schema", "regex", "ebnf") if sp.get(k) is not None]
    if len(grammars) > 1:
        raise _Rejected("Only one of regex, json_schema, or ebnf can be set.")
    if sp.get("structural_tag") is not None:
        grammars.append("structural_tag")
    stop_ids = sp.get("stop_token_ids")
    if stop_ids is not None and not (
        isinstance(stop_ids, list) and all(t is None or _is_int(t) for t in stop_ids)
    ):
        raise _Rejected(f"stop_token_ids must be a list of integers, got {stop_ids!r}.")
    ignore_eos = sp.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise _Rejected(f"ignore_eos must be a boolean, got {ignore_eos!r}.")
    seed = _integer(sp, "sampling_seed", None)
    interval = _integer(sp, "stream_interval", None)
    if interval is not None and interval < 1:
        raise _Rejected(f"stream_interval must be at least 1, got {interval}.")
    return _Sampling(
        max_new_tokens=max_new_tokens,
        min_new_tokens=min_new_tokens,
        stop_token_ids=frozenset(t for t in stop_ids or [] if t is not None),
        ignore_eos=bool(ignore_eos),
        seed=seed or 0,
        stream_interval=interval or 1,
        grammar=grammars[0] if grammars else None,
    )


def _normalize(body: JSON, config: MockServerConfig) -> tuple[list[_Item], bool]:
    """`GenerateReqInput.normalize_batch_and_arguments` plus the tokenizer manager's and
    the scheduler's per-request checks. Returns the items and whether it is one request."""
    text = body.get("text")
    input_ids = body.get("input_ids")
    if text is None and input_ids is None and body.get("input_embeds") is None:
        raise _Rejected("Either text, input_ids or input_embeds should be provided.")
    prompts: list[list[int] | None]
    if text is not None:  # batch detection looks at text first
        single = isinstance(text, str)
        batch = 1 if single else len(text)
        if input_ids is not None:
            if len(input_ids) == 0:
                raise _Rejected("input_ids cannot be empty.")
            prompts = [input_ids] if _is_int(input_ids[0]) else list(input_ids)
            if len(prompts) != batch:
                raise _Rejected("The length of input_ids should be equal to the batch size.")
        else:
            prompts = [None] * batch
    elif input_ids is not None:
        if len(input_ids) == 0:
            raise _Rejected("input_ids cannot be empty.")
        single = _is_int(input_ids[0])
        prompts = [input_ids] if single else list(input_ids)
        batch = len(prompts)
    else:
        raise _Rejected(
            "input_embeds is provided while disable_radix_cache is False. "
            "Please add `--disable-radix-cache` when you launch the server "
            "if you want to use input_embeds as inputs."
        )

    # _handle_parallel_sampling
    sp_raw = body.get("sampling_params")
    if sp_raw is None or isinstance(sp_raw, dict):
        n = (sp_raw or {}).get("n", 1)
    else:
        n = sp_raw[0].get("n", 1) if sp_raw else 1
        for sp in sp_raw:
            if sp.get("n", 1) != n:
                raise _Rejected(
                    "The parallel_sample_num should be the same for all samples in sample params."
                )
    n = 1 if n is None else n
    if not _is_int(n) or n < 1:
        raise _Rejected(f"n must be a positive integer, got {n!r}.")
    if n > 1:
        single = False
    if isinstance(sp_raw, list) and len(sp_raw) != batch:
        raise _Rejected("The length of sampling_params should be equal to the batch size.")
    sps: list[JSON] = list(sp_raw) if isinstance(sp_raw, list) else [sp_raw or {}] * batch

    # rids: a string on a batch gets "_{i}" suffixes; n > 1 regenerates all of them.
    num = batch * n
    rid = body.get("rid")
    rids: list[str]
    if single:
        if isinstance(rid, list):
            raise _Rejected("The rid should be a string for a single request.")
        rids = [rid if rid is not None else uuid.uuid4().hex]
    elif rid is None or n > 1:
        if isinstance(rid, list) and len(rid) != batch:
            raise _Rejected(
                "The specified rids length mismatch with the batch_size for batch processing."
            )
        rids = [uuid.uuid4().hex for _ in range(num)]
    elif isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(num)]
    else:
        if len(rid) != batch:
            raise _Rejected(
                "The specified rids length mismatch with the batch_size for batch processing."
            )
        rids = list(rid)
        duplicates = sorted({r for r in rids if rids.count(r) > 1})
        if duplicates:
            raise _Rejected(f"Duplicate request IDs detected within the request: {duplicates}")

    def per_item(name: str, default: Any) -> list[Any]:
        return _per_item(body, name, default, single=single, batch=batch, n=n)

    return_logprob = per_item("return_logprob", False)
    logprob_start_len = per_item("logprob_start_len", -1)
    top_logprobs_num = per_item("top_logprobs_num", 0)
    tids = body.get("token_ids_logprob")
    token_ids: list[list[int] | None]
    if not tids:
        token_ids = [None] * batch
    elif _is_int(tids):
        token_ids = [[tids]] * batch
    elif _is_int(tids[0]):
        token_ids = [list(tids)] * batch
    elif single or n > 1:
        raise _Rejected("Cannot use list token_ids_logprob with parallel_sample_num > 1")
    elif len(tids) != batch:
        raise _Rejected("The length of token_ids_logprob should be equal to the batch size.")
    else:
        token_ids = list(tids)

    routed = bool(body.get("return_routed_experts", False))
    routed_start = body.get("routed_experts_start_len", 0)
    if routed_start < 0:
        raise _Rejected(
            f"routed_experts_start_len must be in [0, prompt_tokens], got {routed_start}."
        )
    if body.get("return_hidden_states"):
        raise _Rejected(
            "The server is not configured to return the hidden states. "
            "Please set `--enable-return-hidden-states` to enable this feature."
        )
    if body.get("custom_logit_processor"):
        raise _Rejected(
            "The server is not configured to enable custom logit processor. "
            "Please set `--enable-custom-logit-processor` to enable this feature."
        )
    if body.get("lora_path"):
        raise _Rejected(
            "LoRA is not enabled on this server; launch it with `--enable-lora` to use "
            f"lora_path={body['lora_path']!r}."
        )
    session = body.get("session_params")
    session_abort = None
    if session and session.get("id") is not None:
        session_abort = f"Invalid request: session id {session['id']} does not exist"

    ctx = config.max_model_len
    items: list[_Item] = []
    for i in range(batch):
        prompt = prompts[i]
        if prompt is None:
            raise _Rejected(SKIP_TOKENIZER_TEXT)
        length = len(prompt)
        if length == 0:
            raise _Rejected("input_ids cannot be empty.")
        # _validate_one_request
        if length >= ctx:
            raise _Rejected(
                f"The input ({length} tokens) is longer than the model's context length "
                f"({ctx} tokens)."
            )
        sp = sps[i]
        explicit_max = sp.get("max_new_tokens")
        if _is_int(explicit_max) and explicit_max + length >= ctx:
            raise _Rejected(
                "Requested token count exceeds the model's maximum context length "
                f"of {ctx} tokens. You requested a total of {explicit_max + length} "
                f"tokens: {length} tokens from the input messages and "
                f"{explicit_max} tokens for the completion. Please reduce the number "
                "of tokens in the input messages or the completion to fit within the limit."
            )
        if any(t >= config.vocab_size for t in prompt):
            raise _Rejected(
                f"The input_ids {prompt} contains values greater than the vocab size "
                f"({config.vocab_size})."
            )
        if any(t < 0 for t in prompt):
            raise _Rejected(f"The input_ids {prompt} contains negative values.")
        sampling = _sampling(sp, config.vocab_size)
        want_lp = bool(return_logprob[i])
        start = logprob_start_len[i]
        k = top_logprobs_num[i]
        if not _is_int(start) or start < -1:
            raise _Rejected(f"logprob_start_len must be -1 or at least 0, got {start!r}.")
        if not _is_int(k) or k < 0:
            raise _Rejected(f"top_logprobs_num must be at least 0, got {k!r}.")
        ids = token_ids[i]
        if ids is not None and any(not 0 <= t < config.vocab_size for t in ids):
            raise _Rejected(
                f"token_ids_logprob must lie in [0, {config.vocab_size - 1}], got {ids}."
            )
        # The scheduler's checks: failures abort the request with status 400.
        abort = session_abort
        if abort is None and want_lp and start != -1 and start >= length:
            abort = (
                f"req.logprob_start_len={start} is higher than the number of input tokens "
                f"len(req.origin_input_ids)={length}. Please use a smaller logprob_start_len."
            )
        if abort is None and routed and routed_start > length:
            abort = (
                f"routed_experts_start_len={routed_start} is higher than the number of "
                f"input tokens {length}. Please use a smaller routed_experts_start_len."
            )
        if abort is None and sampling.grammar is not None:
            abort = f"The mock SGLang server cannot do guided decoding ({sampling.grammar})."
        room = ctx - length - 1  # the scheduler clamps an uncapped max_new_tokens
        budget = sampling.max_new_tokens
        for s in range(n):
            j = i * n + s
            items.append(
                _Item(
                    index=j,
                    rid=rids[j],
                    prompt=list(prompt),
                    max_new_tokens=room if budget is None else min(budget, room),
                    min_new_tokens=sampling.min_new_tokens,
                    stop_token_ids=sampling.stop_token_ids,
                    ignore_eos=sampling.ignore_eos,
                    seed=sampling.seed,
                    stream_interval=sampling.stream_interval,
                    return_logprob=want_lp,
                    logprob_start=length - 1 if start == -1 else start,
                    top_logprobs_num=k,
                    token_ids_logprob=ids,
                    return_routed_experts=routed,
                    routed_experts_start=routed_start,
                    scheduler_abort=abort,
                )
            )
    return items, single


# ---------------------------------------------------------------- generation


@dataclass(slots=True)
class _Event:
    index: int
    kind: Literal["chunk", "final", "fault", "crash"]
    payload: JSON | None = None
    fault: str | None = None


def _triple(logprob: float | None, token: int) -> LogprobEntry:
    return [logprob, token, None]


class _Generation:
    """One item's run through the "scheduler": waiting queue, prefill, decode steps.

    It pushes events to the HTTP handler's queue: stream chunks, the final output, or a
    transport fault for the handler to act on."""

    def __init__(
        self,
        server: _SglangServer,
        item: _Item,
        fault: Fault | None,
        *,
        stream: bool,
        created: float,
        queue: asyncio.Queue[_Event],
    ) -> None:
        self.server = server
        self.item = item
        self.fault = fault
        self.stream = stream
        self.incremental = stream and server.config.incremental
        self.created = created
        self.queue = queue
        self.running: Running = server.state.start(item.rid)
        self.output_ids: list[int] = []
        self.out_lps: list[LogprobEntry] = []
        self.out_tops: list[list[LogprobEntry] | None] = []
        self.out_tids: list[list[LogprobEntry] | None] = []
        self.in_lps: list[LogprobEntry] = []
        self.in_tops: list[list[LogprobEntry] | None] = []
        self.in_tids: list[list[LogprobEntry] | None] = []
        self.rows: list[list[int]] = []
        self.sent = 0  # output tokens already delivered (incremental streaming)

    async def run(self) -> None:
        completed = False
        try:
            completed = await self._run()
        except asyncio.CancelledError:
            raise
        except Exception:
            self.queue.put_nowait(_Event(self.item.index, "crash"))
            raise
        finally:
            # "completed" means a natural end (stop or length), as the vLLM mock counts it.
            natural = completed and not self.running.aborted.is_set()
            self.server.state.finish(self.running, completed=natural)

    def _emit(self, kind: Literal["chunk", "final"], payload: JSON) -> None:
        self.queue.put_nowait(_Event(self.item.index, kind, payload))

    async def _waiting(self) -> bool:
        """The prefill delay, spent in the waiting queue; True if aborted meanwhile."""
        delay = self.server.state.token_delay_s
        if delay <= 0:
            await asyncio.sleep(0)
            return self.running.aborted.is_set()
        return await wait_event(self.running.aborted, delay)

    async def _run(self) -> bool:
        """Generate; True when a final output was produced."""
        it = self.item
        model = self.server.model
        if await self._waiting():
            self._emit("final", self._waiting_abort())
            return True
        self.running.waiting = False
        if it.scheduler_abort is not None:
            # set_finish_with_abort: the prompt became [0] and logprobs were switched off;
            # one forward pass later the request finishes with the abort.
            self.output_ids = [advance(initial_state(it.seed), 0) % model.vocab_size]
            self._emit("final", self._scheduler_abort(it.scheduler_abort))
            return True

        state = self._prompt_pass()
        banned = it.stop_token_ids if it.ignore_eos else it.stop_token_ids | {self.eos}
        fault = self.fault
        k = 0
        while True:
            if fault is not None and k == fault.after_tokens and k < it.max_new_tokens:
                # The fault fires only while the generation is still running.
                if fault.kind == "abort":
                    reason = _abort_reason(fault.message, fault.status or None)
                    self._emit("final", self._out(reason))
                    return True
                if fault.kind == "hang":
                    # Nothing more until an abort (or the client leaving cancels us).
                    await self.running.aborted.wait()
                else:  # drop, no_terminal, done_early: the handler ends the response
                    payload = None if self.stream else self._out(None)
                    self.queue.put_nowait(_Event(it.index, "fault", payload, fault=fault.kind))
                    return False
                fault = None
            if k >= it.max_new_tokens:  # max_new_tokens == 0: prefill only
                self._emit("final", self._out({"type": "length", "length": it.max_new_tokens}))
                return True
            if k:
                await asyncio.sleep(self.server.state.token_delay_s)
            if k < it.min_new_tokens:
                # Masked like a real engine masks stop logits: the best allowed candidate.
                candidates = model.top(state, MAX_TOP_LOGPROBS)
                token, logprob = next(
                    ((t, lp) for t, lp in candidates if t not in banned), candidates[0]
                )
            else:
                token, logprob = state % model.vocab_size, model.greedy_logprob(state)
            self._record(state, token, logprob)
            state = advance(state, token)
            k += 1
            finish: JSON | None = None
            # Req.check_finished: a pending abort, then the length cap, then stop tokens.
            if self.running.aborted.is_set():
                finish = _abort_reason("Aborted", None)
            elif k >= it.max_new_tokens:
                finish = {"type": "length", "length": it.max_new_tokens}
            elif (
                not it.ignore_eos
                and k > it.min_new_tokens
                and (token == self.eos or token in it.stop_token_ids)
            ):
                finish = {"type": "stop", "matched": token}
            if it.return_routed_experts:
                self.rows.append(self.server.experts.row(state))
            if finish is not None:
                self._emit("final", self._out(finish))
                return True
            if self.stream and (k - 1) % it.stream_interval == 0:
                self._emit("chunk", self._out(None))

    @property
    def eos(self) -> int:
        return self.server.config.eos_token_id

    def _prompt_pass(self) -> int:
        """Run the prompt: input logprobs and routed-expert rows; the state after it."""
        it = self.item
        model = self.server.model
        state = initial_state(it.seed)
        for i, tid in enumerate(it.prompt):
            if it.return_logprob and i >= it.logprob_start:
                # SGLang's shift: the first requested position has no logprob.
                first = i == it.logprob_start
                self.in_lps.append(_triple(None if first else model.logprob(state, tid), tid))
                if it.top_logprobs_num:
                    self.in_tops.append(None if first else self._top(state, it.top_logprobs_num))
                if it.token_ids_logprob is not None:
                    self.in_tids.append(None if first else self._tids(state))
            state = advance(state, tid)
            if it.return_routed_experts and i >= it.routed_experts_start:
                self.rows.append(self.server.experts.row(state))
        return state

    def _top(self, state: int, k: int) -> list[LogprobEntry]:
        return [_triple(lp, t) for t, lp in self.server.model.top(state, k)]

    def _tids(self, state: int) -> list[LogprobEntry]:
        model = self.server.model
        return [_triple(model.logprob(state, t), t) for t in self.item.token_ids_logprob or []]

    def _record(self, state: int, token: int, logprob: float) -> None:
        it = self.item
        self.output_ids.append(token)
        if it.return_logprob:
            self.out_lps.append(_triple(logprob, token))
            if it.top_logprobs_num:
                self.out_tops.append(self._top(state, it.top_logprobs_num))
            if it.token_ids_logprob is not None:
                self.out_tids.append(self._tids(state))

    def _latency(self) -> float:
        return round(time.monotonic() - self.created, 6)

    def _routed_experts(self) -> str:
        """Rows for positions [start, seqlen - 1): the last token has had no forward pass."""
        it = self.item
        want = max(0, len(it.prompt) + len(self.output_ids) - 1 - it.routed_experts_start)
        flat = [e for row in self.rows[:want] for e in row]
        return base64.b64encode(struct.pack(f"<{len(flat)}i", *flat)).decode("ascii")

    def _out(self, finish: JSON | None) -> JSON:
        """An output object as the tokenizer manager builds it (BatchTokenIDOutput)."""
        it = self.item
        offset = self.sent if self.incremental else 0
        meta: JSON = {
            "id": it.rid,
            "finish_reason": finish,
            "prompt_tokens": len(it.prompt),
            "weight_version": WEIGHT_VERSION,
            "num_retractions": 0,
        }
        if it.return_logprob:
            meta["input_token_logprobs"] = list(self.in_lps)
            meta["output_token_logprobs"] = self.out_lps[offset:]
            meta["output_token_logprobs_length"] = len(self.out_lps)
            if it.top_logprobs_num:
                meta["input_top_logprobs"] = list(self.in_tops)
                meta["output_top_logprobs"] = self.out_tops[offset:]
            if it.token_ids_logprob is not None:
                meta["input_token_ids_logprobs"] = list(self.in_tids)
                meta["output_token_ids_logprobs"] = self.out_tids[offset:]
        meta["reasoning_tokens"] = 0
        meta["completion_tokens"] = len(self.output_ids)
        meta["cached_tokens"] = 0
        if finish is not None:
            if it.return_routed_experts:
                meta["routed_experts"] = self._routed_experts()
            meta["e2e_latency"] = self._latency()
        output_ids = self.output_ids[offset:]
        self.sent = len(self.output_ids)
        return {"output_ids": output_ids, "meta_info": meta}

    def _waiting_abort(self) -> JSON:
        """The tokenizer manager's `_handle_abort_req`: a request aborted while waiting.

        Its output carries an empty `text` even under --skip-tokenizer-init."""
        it = self.item
        meta: JSON = {"id": it.rid, "finish_reason": {"type": "abort", "message": WAITING_ABORT}}
        if it.return_logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = []
            meta["output_token_logprobs_length"] = 0
            if it.top_logprobs_num:
                meta["input_top_logprobs"] = []
                meta["output_top_logprobs"] = []
            if it.token_ids_logprob is not None:
                meta["input_token_ids_logprobs"] = []
                meta["output_token_ids_logprobs"] = []
        meta["completion_tokens"] = 0
        return {"text": "", "output_ids": [], "meta_info": meta}

    def _scheduler_abort(self, message: str) -> JSON:
        return {
            "output_ids": list(self.output_ids),
            "meta_info": {
                "id": self.item.rid,
                "finish_reason": _abort_reason(message, 400),
                "prompt_tokens": 1,
                "weight_version": WEIGHT_VERSION,
                "num_retractions": 0,
                "reasoning_tokens": 0,
                "completion_tokens": len(self.output_ids),
                "cached_tokens": 0,
                "e2e_latency": self._latency(),
            },
        }


# ---------------------------------------------------------------- HTTP server


@dataclass(slots=True)
class _Exchange:
    """One /generate HTTP request in flight."""

    request: web.Request
    rids: list[str]
    single: bool
    queue: asyncio.Queue[_Event] = field(default_factory=asyncio.Queue)
    dropped: bool = False


class _SglangServer:
    def __init__(self, config: MockServerConfig, state: ServerState) -> None:
        self.config = config
        self.state = state
        self.model = TokenModel(config.vocab_size)
        self.experts = ExpertModel(_MOE.moe_layers, _MOE.moe_top_k, _MOE.moe_experts)
        self.started = time.time()

    # ------------------------------------------------------------ abort

    def abort(self, rid: str = "", *, abort_all: bool = False) -> list[str]:
        """TokenizerManager.abort_request + Scheduler.abort_request.

        The tokenizer manager forwards only a rid it knows exactly; the scheduler then
        aborts every waiting or running request whose rid *starts with* it."""
        if abort_all:
            return self.state.abort_matching(lambda _: True)
        if rid not in self.state.running:
            return []
        return self.state.abort_matching(lambda other: other.startswith(rid))

    async def abort_request(self, request: web.Request) -> web.Response:
        arrived = time.time()
        raw = await request.read()
        try:
            body = json.loads(raw) if raw.strip() else None
        except ValueError:
            body = None
        rid = body.get("rid", "") if isinstance(body, dict) else None
        abort_all = _as_bool(body.get("abort_all", False)) if isinstance(body, dict) else None
        if not isinstance(rid, str) or abort_all is None:
            err = {"type": "model_type", "loc": ("body",), "msg": "Input should be an AbortReq"}
            return _malformed_response(_Malformed([{**err, "input": body}]))
        self.state.abort_calls.append({"ids": ["*"] if abort_all else [rid], "at": arrived})
        self.abort(rid, abort_all=abort_all)
        return web.Response(status=200)

    # ------------------------------------------------------------ generate

    async def generate(self, request: web.Request) -> web.StreamResponse:
        created = time.monotonic()
        if "traceparent" in request.headers:
            self.state.traceparents.append(request.headers["traceparent"])
        fault = self.state.next_fault()
        if fault is not None and fault.kind == "http_error":
            return _fault_response(fault)
        try:
            body = _check_body(await request.read())
        except _Malformed as exc:
            return _malformed_response(exc)
        if not body.get("stream", False):
            try:
                items, single = self._admit(body)
            except _Rejected as exc:
                return _error_response(str(exc))
            exchange = _Exchange(request, [it.rid for it in items], single)
            return await self._serve(exchange, items, fault, created, None)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        try:
            items, single = self._admit(body)
        except _Rejected as exc:
            # The stream has started: the error travels in-band.
            await resp.write(_sse({"error": {"message": str(exc)}}))
            await resp.write(_DONE)
            await resp.write_eof()
            return resp
        exchange = _Exchange(request, [it.rid for it in items], single)
        return await self._serve(exchange, items, fault, created, resp)

    def _admit(self, body: JSON) -> tuple[list[_Item], bool]:
        items, single = _normalize(body, self.config)
        for it in items:
            if it.rid in self.state.running:
                raise _Rejected(f"Duplicate request ID: {it.rid} is already running.")
        return items, single

    async def _serve(
        self,
        ex: _Exchange,
        items: list[_Item],
        fault: Fault | None,
        created: float,
        resp: web.StreamResponse | None,
    ) -> web.StreamResponse:
        generations = [
            _Generation(self, item, fault, stream=resp is not None, created=created, queue=ex.queue)
            for item in items
        ]
        tasks = [asyncio.create_task(g.run()) for g in generations]
        try:
            if resp is None:
                return await self._unary(ex, len(items))
            return await self._stream(ex, resp, len(items))
        except ConnectionResetError:  # a write to a client that has gone
            self._client_gone(ex)
            return resp if resp is not None else web.Response()
        except asyncio.CancelledError:  # aiohttp cancels the handler on disconnect
            self._client_gone(ex)
            raise
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _client_gone(self, ex: _Exchange) -> None:
        """The client went away: SGLang aborts every rid of the request (prefix match)."""
        if ex.dropped:
            return
        self.state.disconnected.extend(ex.rids)
        for rid in ex.rids:
            self.abort(rid)

    async def _next(self, ex: _Exchange) -> _Event:
        """The next event; notices a client that has gone even if aiohttp does not cancel
        the handler (SGLang polls `request.is_disconnected()` the same way)."""
        getter = asyncio.ensure_future(ex.queue.get())
        try:
            while True:
                done, _ = await asyncio.wait({getter}, timeout=_DISCONNECT_POLL_S)
                if done:
                    return getter.result()
                transport = ex.request.transport
                if transport is None or transport.is_closing():
                    raise ConnectionResetError("the client went away")
        finally:
            getter.cancel()

    async def _unary(self, ex: _Exchange, count: int) -> web.StreamResponse:
        finals: dict[int, JSON] = {}
        while len(finals) < count:
            ev = await self._next(ex)
            if ev.kind == "crash":
                raise web.HTTPInternalServerError(text="mock generation failed")
            if ev.kind == "fault" and ev.fault == "drop":
                self._drop(ex)
                return web.Response()
            if ev.kind in ("final", "fault") and ev.payload is not None:
                finals[ev.index] = ev.payload  # a fault's payload: no finish reason
        outs = [finals[i] for i in range(count)]
        for out in outs:
            # _handle_abort_finish_reason: scheduler aborts with a status become errors.
            reason = out["meta_info"].get("finish_reason")
            if isinstance(reason, dict) and reason.get("type") == "abort":
                status = reason.get("status_code")
                if status == 400:
                    return _error_response(reason["message"])
                if status in (500, 503):
                    return _http_exception(status, reason["message"])
        return _json_response(outs[0] if ex.single else outs)

    async def _stream(
        self, ex: _Exchange, resp: web.StreamResponse, count: int
    ) -> web.StreamResponse:
        pending = count
        while pending:
            ev = await self._next(ex)
            if ev.kind == "crash":
                raise RuntimeError("mock generation failed")
            if ev.kind == "fault":
                if ev.fault == "drop":
                    await self._flush(ex)
                    self._drop(ex)
                    return resp
                if ev.fault == "done_early":
                    await resp.write(_DONE)
                await resp.write_eof()  # no_terminal: a clean end, without a terminal chunk
                return resp
            assert ev.payload is not None
            out = ev.payload
            if not ex.single:
                out["index"] = ev.index
            await resp.write(_sse(out))
            if ev.kind == "final":
                pending -= 1
        await resp.write(_DONE)
        await resp.write_eof()
        return resp

    async def _flush(self, ex: _Exchange) -> None:
        transport = ex.request.transport
        for _ in range(200):
            if transport is None or transport.get_write_buffer_size() == 0:
                return
            await asyncio.sleep(0.005)

    def _drop(self, ex: _Exchange) -> None:
        ex.dropped = True
        transport = ex.request.transport
        if transport is not None:
            transport.abort()

    # ------------------------------------------------------------ health and info

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.state.healthy else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        """Generates one token from `input_ids=[0]`; 200 once the "scheduler" answers."""
        if not self.state.healthy:
            return web.Response(status=503)
        await asyncio.sleep(self.state.token_delay_s)
        self.model.top(advance(initial_state(0), 0), 1)
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        return _json_response(
            {
                "model_path": self.config.model,
                "tokenizer_path": self.config.model,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": WEIGHT_VERSION,
                "has_image_understanding": False,
                "has_audio_understanding": False,
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        host, port = "127.0.0.1", 0
        transport = request.transport
        sockname = transport.get_extra_info("sockname") if transport is not None else None
        if isinstance(sockname, tuple) and len(sockname) >= 2:
            host, port = str(sockname[0]), int(sockname[1])
        c = self.config
        running = list(self.state.running.values())
        return _json_response(
            {
                # ServerArgs, flattened (the fields clients read, and some context)
                "model_path": c.model,
                "tokenizer_path": c.model,
                "tokenizer_mode": "auto",
                "skip_tokenizer_init": True,
                "load_format": "dummy",
                "trust_remote_code": False,
                "context_length": c.max_model_len,
                "is_embedding": False,
                "host": host,
                "port": port,
                "served_model_name": c.model,
                "weight_version": WEIGHT_VERSION,
                "dtype": "auto",
                "tp_size": 1,
                "pp_size": 1,
                "dp_size": 1,
                "ep_size": 1,
                "stream_interval": 1,
                "incremental_streaming_output": c.incremental,
                "stream_output": c.incremental,
                "max_running_requests": None,
                "max_queued_requests": None,
                "chunked_prefill_size": 8192,
                "schedule_policy": "fcfs",
                "random_seed": 0,
                "disable_radix_cache": False,
                "allow_auto_truncate": False,
                "enable_lora": False,
                "enable_return_hidden_states": False,
                "enable_return_routed_experts": True,
                "enable_custom_logit_processor": False,
                "enable_priority_scheduling": False,
                "enable_metrics": False,
                "api_key": None,
                "admin_api_key": None,
                "disaggregation_mode": "null",
                "disaggregation_bootstrap_port": 8998,
                "disaggregation_transfer_backend": "mooncake",
                # scheduler info
                "max_total_num_tokens": max(MAX_TOTAL_NUM_TOKENS, c.max_model_len),
                "max_req_input_len": c.max_model_len - 1,
                "internal_states": [
                    {
                        "last_gen_throughput": 0.0,
                        "num_running_reqs": sum(1 for r in running if not r.waiting),
                        "num_waiting_reqs": sum(1 for r in running if r.waiting),
                    }
                ],
                "version": SGLANG_VERSION,
            }
        )

    def _model_card(self) -> JSON:
        name = self.config.model
        return {
            "id": name,
            "object": "model",
            "created": int(self.started),
            "owned_by": "sglang",
            "root": name,
            "max_model_len": self.config.max_model_len,
        }

    async def models(self, request: web.Request) -> web.Response:
        return _json_response({"object": "list", "data": [self._model_card()]})

    async def model_card(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.config.model:
            error = {
                "message": f"The model '{name}' does not exist",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
            return _json_response({"error": error}, 404)
        return _json_response(self._model_card())

    async def flush_cache(self, request: web.Request) -> web.Response:
        return web.Response(
            text="Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be "
            "performed.)\n"
        )


def _fault_response(fault: Fault) -> web.Response:
    """An injected HTTP error with the body SGLang sends for that status."""
    if 400 <= fault.status < 500:
        return _error_response(fault.message, fault.status)
    return _http_exception(fault.status, fault.message)


SERVER = web.AppKey("sglang_server", _SglangServer)


def build_app(config: MockServerConfig) -> web.Application:
    """The mock SGLang server for `config`, with the `/testkit/` admin routes."""
    state = ServerState(token_delay_s=config.token_delay_ms / 1000)
    server = _SglangServer(config, state)
    app = web.Application(client_max_size=1 << 30)
    app[SERVER] = server
    add_admin_routes(app, state)
    app.router.add_route("POST", "/generate", server.generate)
    app.router.add_route("PUT", "/generate", server.generate)
    app.router.add_post("/abort_request", server.abort_request)
    app.router.add_get("/health", server.health)
    app.router.add_get("/health_generate", server.health_generate)
    for path in ("/get_model_info", "/model_info"):
        app.router.add_get(path, server.model_info)
    for path in ("/get_server_info", "/server_info"):
        app.router.add_get(path, server.server_info)
    app.router.add_get("/v1/models", server.models)
    app.router.add_get("/v1/models/{model:.+}", server.model_card)
    app.router.add_route("GET", "/flush_cache", server.flush_cache)
    app.router.add_route("POST", "/flush_cache", server.flush_cache)
    return app

"""vLLM `/inference/v1/generate` requests: parse, validate as vLLM does, project onto envelopes.

The server behaves like vLLM started with `--tokens-only` (reference `engine-apis.md` §B):
token ids in, token ids out, no tokenizer, so stop strings, `bad_words` and multimodal
`content_parts` are refused with 400 (when sent non-empty). Multimodal `features` (the
rendered form: item hashes, placeholder ranges, processed tensors) are checked as vLLM
checks them and travel in `engine` to the engine; routing reads their layout
(`shared/multimodal`).

IDs. The client's ID is the trimmed, non-empty `X-Request-Id` header, else the body's
`request_id` (the header wins, as in vLLM and Dynamo); it travels only as `client_id` and
the handler mints the private ID. The response's `request_id` is `"generate-tokens-" +
<client ID>` (or + a fresh public ID when the client sent none): the prefix is what the
newest vLLM builds return, in unary bodies and in every SSE chunk (§B.4, §B.5); only the
earliest v0.11 builds returned a bare random uuid. The `X-Request-Id` response header
carries the bare ID.

Defaults are vLLM's `SamplingParams` defaults, except `max_tokens`: an omitted
`max_tokens` is the room left in the context, capped by the generation config's
`max_new_tokens` (newest vLLM's `get_max_tokens`; older builds silently used 16). When the
engine catalog knows nothing of the model it is sent as None and the engine decides.

`n > 1` fans out into one envelope per sample with `n = 1` each; with a `seed`, sample `i`
gets `seed + i`, which is what vLLM V1's parallel sampling gives its child requests.
Prompt logprobs are asked of sample 0 only (every sample has the same prompt).

The envelope's `engine` map is the body as the client sent it (for engines that speak
vLLM), minus `request_id`, `token_ids`, `stream` and `stream_options`, which the mesh
handles; a fanned-out sample's `sampling_params` say `n = 1` and carry its own seed.
`kv_transfer_params` stays at the top level: an adapter for vLLM v0.11-v0.18, which reads
it only from `sampling_params.extra_args`, copies it there.

Validation is vLLM's: the body is validated by the pydantic models in `schema.py`, and a
failure is answered as the newest vLLM's RequestValidationError handler answers it (the
error count, then at most ten errors with their inputs summarised, `param` = the first
error's dotted location, e.g. `body.token_ids`). Unknown
fields, top level or in `sampling_params` or `stream_options`, are ignored as vLLM ignores
them (and logged once per name). What vLLM accepts but this server cannot deliver is
refused afterwards, by its value only.

Errors use vLLM's envelope `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from pydantic import ValidationError

from genmesh.formats.base import Bound, RequestRejected
from genmesh.formats.checks import IgnoredFields, oversized_int
from genmesh.formats.fastapi import UNREADABLE_BODY, BodyError, body_errors, read_json
from genmesh.formats.vllm.schema import (
    SAMPLING_FIELDS,
    TOP_LEVEL_FIELDS,
    GenerateRequest,
    SamplingParams,
    VLLMValidationError,
)
from genmesh.shared.engine_info import NO_ENGINES, EngineCatalog, EngineInfo
from genmesh.shared.envelope import (
    MAX_TOKEN_ID,
    Envelope,
    OutputOptions,
    Routing,
    Sampling,
    TokenIds,
    pack_token_ids,
)

FORMAT = "vllm"
RESPONSE_ID_PREFIX = "generate-tokens-"
# vLLM's default `max_num_seqs`; also a bound on how many envelopes one request fans into.
MAX_N = 256
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_UINT32_MAX = 2**32 - 1
_UINT64_MAX = 2**64 - 1
# The `type` vLLM's RequestValidationError handler writes (HTTPStatus.BAD_REQUEST.phrase);
# errors made by the serving code say "BadRequestError" instead.
VALIDATION_ERROR_TYPE = "Bad Request"
# Fields the mesh handles itself: they never reach an engine's native payload.
_NOT_FORWARDED = frozenset(("request_id", "token_ids", "stream", "stream_options"))

log = logging.getLogger(__name__)
# vLLM's own words for the fields it drops, at its level (a warning).
IGNORED = IgnoredFields(
    log, "The following fields were present in the request but ignored: %s", logging.WARNING
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


_ADDRESS = re.compile(r" at 0x[0-9a-f]+>")
_TRACEBACK_LINE = re.compile(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?')
_SYSTEM_PATH = re.compile(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+")
_FILE_PATH = re.compile(r"(?:/[\w\-]+)+/[\w\-]+\.\w+")


def sanitize_message(message: str) -> str:
    """vLLM's `sanitize_message`, applied to every error message it sends: no memory
    addresses, traceback lines or file paths (so also none from a client's own values)."""
    message = _ADDRESS.sub(">", message)
    message = _TRACEBACK_LINE.sub("", message)
    message = _SYSTEM_PATH.sub("<path>", message)
    return _FILE_PATH.sub("<path>", message).strip()


def error(
    message: str, status: int = 400, param: str | None = None, type_: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": sanitize_message(message),
            "type": type_ or error_type(status),
            "param": param,
            "code": status,
        }
    }


def _reject(message: str, param: str | None = None, status: int = 400) -> RequestRejected:
    body = error(message, status, param)
    return RequestRejected(status, body, body["error"]["message"])


# vLLM's bounds on its validation answer (newest handlers/validation.py): pydantic repeats
# the whole offending value in every error, so a 5 kB body of bad list items once made a
# 24 MB answer. At most this many errors are listed, each value and each error cut short.
_MAX_REPORTED_ERRORS = 10
_MAX_ERROR_INPUT_CHARS = 200
_MAX_ERROR_CHARS = 1000
_TRUNCATED = "...[truncated]"


def _summarize_input(value: object) -> object:
    """vLLM's `_summarize_error_input`: a string cut short, a container described (its
    repr is never built), anything else as its bounded `str`."""
    if isinstance(value, str):
        if len(value) > _MAX_ERROR_INPUT_CHARS:
            return value[:_MAX_ERROR_INPUT_CHARS] + _TRUNCATED
        return value
    if isinstance(value, bytes | bytearray):
        return f"<{type(value).__name__} of {len(value)} bytes>"
    if isinstance(value, list | tuple | set | frozenset | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    try:
        text = str(value)
    except Exception:  # e.g. an int past sys.get_int_max_str_digits()
        return f"<{type(value).__name__}>"
    if len(text) > _MAX_ERROR_INPUT_CHARS:
        return text[:_MAX_ERROR_INPUT_CHARS] + _TRUNCATED
    return text


def _format_error(err: object) -> str:
    """vLLM's `_format_error`: one error, its input summarised and its `loc` cleaned."""
    if isinstance(err, dict):
        err = dict(err)
        if "input" in err:
            err["input"] = _summarize_input(err["input"])
        loc = err.get("loc")
        if isinstance(loc, tuple | list):
            err["loc"] = _param_of(tuple(loc))
    text = str(err)
    if len(text) > _MAX_ERROR_CHARS:
        text = text[:_MAX_ERROR_CHARS] + _TRUNCATED
    return text


def invalid(errors: list[Any], param: str | None) -> RequestRejected:
    """vLLM's RequestValidationError answer: the count, then at most ten errors."""
    count = len(errors)
    label = "error" if count == 1 else "errors"
    reported = errors[:_MAX_REPORTED_ERRORS]
    message = f"{count} validation {label}:\n"
    message += "".join(f"  {_format_error(err)}\n" for err in reported)
    if count > len(reported):
        message += f"  ...and {count - len(reported)} more {label}\n"
    body = error(message.rstrip(), 400, param, VALIDATION_ERROR_TYPE)
    return RequestRejected(400, body, body["error"]["message"])


# pydantic-core's wrapper/union-branch markers, which vLLM drops from `param` paths:
# anything bracketed, and its schema-kind names (vLLM's `_INTERNAL_LOC_MARKERS`).
_INTERNAL_LOC = re.compile(r"[\[\]{}()]")
_INTERNAL_LOC_MARKERS = frozenset(
    ("function-wrap", "function-after", "function-before", "function-plain",
     "json-or-python", "lax-or-strict", "chain", "default", "nullable", "tagged-union",
     "union", "call", "arguments", "is-instance", "is-subclass", "callable", "str", "int",
     "float", "bool", "bytes", "bytearray", "list", "tuple", "dict", "set", "frozenset",
     "complex", "none", "nonetype")
)  # fmt: skip


def _internal_segment(segment: str) -> bool:
    return bool(_INTERNAL_LOC.search(segment)) or segment.lower() in _INTERNAL_LOC_MARKERS


def _param_of(loc: tuple[Any, ...]) -> str:
    """vLLM's `clean_loc_for_param`: the dotted location without pydantic's markers."""
    parts = [str(p) for p in loc if not _internal_segment(str(p))]
    return ".".join(parts) if parts else ".".join(str(p) for p in loc)


def validation_rejected(exc: ValidationError) -> RequestRejected:
    errors = body_errors(exc.errors(include_url=False))
    param = None
    for err in errors:
        ctx_error = err.get("ctx", {}).get("error")
        if isinstance(ctx_error, VLLMValidationError):
            param = ctx_error.parameter
            break
    if param is None and errors:
        param = _param_of(errors[0]["loc"])
    return invalid(errors, param)


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
    # vLLM's `should_include_usage(stream_options)`.
    include_usage: bool
    continuous_usage: bool
    # `return_token_ids`: the prompt token ids in the unary body and the first SSE chunk,
    # with the multimodal placeholders of a request that has `features` (else None).
    return_token_ids: bool = False
    mm_placeholders: dict[str, list[dict[str, int]]] | None = None


@dataclass(frozen=True, slots=True)
class _Unparsed:
    """A body that is not JSON. FastAPI reports that only once it has checked the
    content type (when one is sent), so `bind` raises it, not `parse`."""

    rejected: RequestRejected


def parse(body: bytes) -> Any:
    try:
        return read_json(body)
    except BodyError as exc:
        if exc.errors is None:
            answer = error(UNREADABLE_BODY, 400, None, "Bad Request")
            return _Unparsed(RequestRejected(400, answer, UNREADABLE_BODY))
        loc = exc.errors[0]["loc"]
        return _Unparsed(invalid(exc.errors, ".".join(str(p) for p in loc)))


def _check_content_type(headers: Mapping[str, str]) -> None:
    """vLLM's `validate_json_request`: only `application/json` bodies."""
    content_type = (_header(headers, "content-type") or "").lower()
    if content_type.split(";", 1)[0] != "application/json":
        raise invalid(["Unsupported Media Type: Only 'application/json' is allowed"], None)


def _client_id(req: GenerateRequest, headers: Mapping[str, str]) -> str | None:
    """The trimmed, non-empty `X-Request-Id` header, else the body's `request_id`."""
    return _header(headers, "x-request-id") or req.request_id or None


def _dp_rank(headers: Mapping[str, str]) -> int | None:
    """`X-data-parallel-rank` as a u32; malformed values are ignored, as Dynamo does (and
    vLLM's `_get_data_parallel_rank`, whose `int()` fails past Python's 4,300 digits: a u32
    has at most 10, so longer runs of digits are never converted)."""
    value = _header(headers, "x-data-parallel-rank")
    digits = None if value is None else re.fullmatch(r"\+?0*([0-9]{1,10})", value)
    if digits is None:
        return None
    rank = int(digits[1])
    return rank if rank <= _UINT32_MAX else None


def _priority(value: int) -> int:
    """vLLM's priority (lower = more urgent) as a routing priority (higher = more
    urgent): negated, saturating at the bounds of a signed 64-bit integer."""
    return max(_INT64_MIN, min(_INT64_MAX, -value))


def _refuse_what_this_server_cannot_do(req: GenerateRequest, sp: SamplingParams) -> None:
    """Values that ask for what a tokens-only, text-only mesh cannot deliver. Absent,
    null or default values never get here: only a value that asks for the behaviour."""
    if req.content_parts:
        # vLLM fetches and processes the media itself here, which needs the model's
        # processor; rendered `features` (from vLLM's /render) are served.
        raise _reject("multimodal inputs as content_parts are not supported by this server; "
                      "send them rendered, as features", "content_parts")  # fmt: skip
    if req.ec_transfer_params:
        raise _reject("encoder-cache transfer (ec_transfer_params) is not supported "
                      "by this server", "ec_transfer_params")  # fmt: skip
    if req.output_mode != "tokens":
        raise _reject(f"output_mode {req.output_mode!r} is not supported: this tokens-only "
                      "server answers in output_mode 'tokens'", "output_mode")  # fmt: skip
    if sp.stop:
        raise _reject("stop strings need a tokenizer and this tokens-only server has none; "
                      "use stop_token_ids", "sampling_params.stop")  # fmt: skip
    if sp.bad_words:
        raise _reject("bad_words need a tokenizer and this tokens-only server has none",
                      "sampling_params.bad_words")  # fmt: skip
    for name in ("logprob_token_ids", "prompt_logprob_token_ids", "trace_decode_token_ids"):
        if getattr(sp, name) is not None:
            raise _reject(f"{name} is not supported by this server", f"sampling_params.{name}")
    if sp.repetition_detection is not None and sp.repetition_detection.max_pattern_size > 0:
        raise _reject("repetition_detection is not supported by this server",
                      "sampling_params.repetition_detection")  # fmt: skip
    if sp.thinking_token_budget is not None:
        # vLLM's own answer when no reasoning parser is configured.
        raise _reject("thinking_token_budget is set but reasoning_config is not configured. "
                      "Please set --reasoning-parser and/or --reasoning-config to use "
                      "thinking_token_budget.", "thinking_token_budget")  # fmt: skip


def _logprobs(sp: SamplingParams, info: EngineInfo | None) -> tuple[int | None, int | None]:
    """The sample and prompt logprob counts, `-1` resolved to the vocabulary size, checked
    as vLLM's `SamplingParams._validate_logprobs` checks them against `max_logprobs`.

    vLLM always knows both (its default `--max-logprobs` is 20). The mesh knows them only
    when the engines state them in their cards: without `max_logprobs` nothing is checked
    here (the engine behind the worker checks its own limit, e.g. a real vLLM's), and
    without the vocabulary size `-1` cannot be resolved, so it is refused."""
    vocab = info.vocab_size if info else None
    limit = info.max_logprobs if info else None
    resolved: list[int | None] = []
    for kind, name in (("sample", "logprobs"), ("prompt", "prompt_logprobs")):
        count: int | None = getattr(sp, name)
        if count == -1:
            if vocab is None:
                raise _reject(f"{name}=-1 (the whole vocabulary) needs the vocabulary size, "
                              "which this server's engines do not state; ask for a top-k",
                              f"sampling_params.{name}")  # fmt: skip
            count = vocab
        if count and limit is not None and count > limit:
            # vLLM's VLLMValidationError, whose str() appends its parameter and value.
            raise _reject(f"Requested {kind} logprobs of {count}, which is greater than max "
                          f"allowed: {limit} (parameter={name}, value={count})",
                          name)  # fmt: skip
        resolved.append(count)
    return resolved[0], resolved[1]


def _check_token_ids(prompt: TokenIds | list[int], sp: SamplingParams) -> TokenIds:
    """Token ids the mesh can carry, and the prompt as a token array. vLLM checks them
    against the vocabulary, which the mesh does not know; it bounds them by the envelope's
    token id range (the schema refused negatives, and packed every prompt of plain token
    ids already: a list is what pydantic coerced or what is out of range)."""
    packed = prompt if isinstance(prompt, TokenIds) else pack_token_ids(prompt)  # one C pass
    if packed is None:
        i = next(i for i, tid in enumerate(prompt) if tid > MAX_TOKEN_ID)
        raise _reject(f"Token id {prompt[i]} is out of vocabulary", f"token_ids.{i}")
    for name, ids in (
        ("stop_token_ids", sp.stop_token_ids or []),
        ("logit_bias", list(sp.logit_bias or {})),
    ):
        invalid = [t for t in ids if not 0 <= t <= MAX_TOKEN_ID]
        if invalid:
            raise _reject(f"token_id(s) {invalid} in {name} contain out-of-vocab token ids.",
                          f"sampling_params.{name}")  # fmt: skip
    if sp.allowed_token_ids is not None:
        if not sp.allowed_token_ids:
            raise _reject("allowed_token_ids is not None and empty!", "allowed_token_ids")
        if any(not 0 <= t <= MAX_TOKEN_ID for t in sp.allowed_token_ids):
            raise _reject("allowed_token_ids contains out-of-vocab token id!", "allowed_token_ids")
    return packed


def _max_tokens(
    sp: SamplingParams, provided: bool, prompt_len: int, info: EngineInfo | None
) -> int | None:
    """`max_tokens` as vLLM's tokens serving settles it, checked against the context.

    Omitted: `get_max_tokens` - the room left in the context, capped by the generation
    config's `max_new_tokens`. Sent: kept, but a value beyond the room is refused (the
    engine once crashed on `prompt + max_tokens` overflowing; vllm-project/vllm#54175).
    An explicit null is the room left, as vLLM's engine makes it. With nothing known of
    the engine nothing is checked: None then lets the engine use its own room."""
    context = info.context_length if info else None
    default = info.sampling_defaults.get("max_new_tokens") if info else None
    if context is None:
        if provided:
            return sp.max_tokens
        return int(default) if isinstance(default, int | float) and default >= 1 else None
    if prompt_len > context:
        if provided:  # the engine's admission check
            raise _reject(
                f"The decoder prompt (length {prompt_len}) is longer than the maximum model "
                f"length of {context}. Make sure that `max_model_len` is no smaller than the "
                "number of text tokens."
            )
        raise _reject(  # get_max_tokens
            f"Input length ({prompt_len}) exceeds model's maximum context length ({context})."
        )
    room = context - prompt_len
    if provided and sp.max_tokens is not None and sp.max_tokens > room:
        raise _reject(
            f"'max_tokens' or 'max_completion_tokens' is too large: {sp.max_tokens}. "
            f"This model's maximum context length is {context} tokens and your request "
            f"has {prompt_len} input tokens ({sp.max_tokens} > {context} - {prompt_len}).",
            "max_tokens",
        )
    if room == 0:
        raise _reject(
            f"The decoder prompt (length {prompt_len}) plus the number of requested output "
            f"tokens (at least 1) is longer than the maximum model length of {context}. "
            "Make sure that `max_model_len` is no smaller than the number of text tokens "
            "(prompt + requested output tokens)."
        )
    if provided and sp.max_tokens is not None:
        return sp.max_tokens
    if not provided and isinstance(default, int | float) and default >= 1:
        return min(room, int(default))
    return room


def _canonical(sp: SamplingParams, max_tokens: int | None) -> Sampling:
    """The mesh's sampling controls from vLLM's (already normalised) SamplingParams."""
    return Sampling(
        max_tokens=max_tokens,
        min_tokens=sp.min_tokens,
        temperature=float(sp.temperature),
        top_p=float(sp.top_p),
        top_k=None if sp.top_k in (0, -1) else sp.top_k,
        min_p=float(sp.min_p),
        seed=sp.seed,
        stop_token_ids=list(sp.stop_token_ids or []),
        ignore_eos=sp.ignore_eos,
    )


def bind(body: Any, headers: Mapping[str, str], engines: EngineCatalog = NO_ENGINES) -> Bound:
    if isinstance(body, _Unparsed) and _header(headers, "content-type") is None:
        raise body.rejected  # FastAPI parses a body with no content type as JSON first
    _check_content_type(headers)
    if isinstance(body, _Unparsed):
        raise body.rejected
    try:
        req = GenerateRequest.model_validate(body)
    except ValidationError as exc:
        raise validation_rejected(exc) from None
    raw_sp: dict[str, Any] = body["sampling_params"]  # a dict: validation passed
    IGNORED.note(set(body) - TOP_LEVEL_FIELDS)
    IGNORED.note(set(raw_sp) - SAMPLING_FIELDS, "sampling_params.")
    if req.stream_options is not None and req.stream_options.model_extra:
        IGNORED.note(req.stream_options.model_extra, "stream_options.")

    sp = req.sampling_params
    n = sp.n
    if n > MAX_N:  # vLLM's serving check against --max-num-seqs
        raise _reject(f"sampling_params.n must be at most the server's max_num_seqs "
                      f"({MAX_N}), got {n}.")  # fmt: skip
    if sp.seed is not None and n > 1 and sp.seed + n - 1 > _UINT64_MAX:
        # Sample i gets seed + i (vLLM V1's child requests): each must fit the bus.
        raise _reject(f"seed must be in [-2**63, 2**64 - n], got {sp.seed}.",
                      "sampling_params.seed")  # fmt: skip
    # The native payload as the client sent it, minus what the mesh handles itself.
    native = {k: v for k, v in body.items() if k not in _NOT_FORWARDED}
    if req.features is not None:
        # As validated (pydantic's lax "8" is 8): what routing and engines read of the
        # layout is what vLLM read.
        native["features"] = req.features.model_dump(exclude_unset=True)
    _check_wire_ints(native)
    _refuse_what_this_server_cannot_do(req, sp)
    prompt = _check_token_ids(req.token_ids, sp)
    info = engines.get(req.model)
    # The serving layer settles max_tokens; the engine's SamplingParams.verify then checks
    # the logprob counts: vLLM refuses in that order.
    max_tokens = _max_tokens(sp, "max_tokens" in raw_sp, len(prompt), info)
    k_out, k_prompt = _logprobs(sp, info)

    stream_options = req.stream_options
    include_usage = stream_options is not None and bool(stream_options.include_usage)
    continuous = include_usage and bool(stream_options and stream_options.continuous_usage_stats)
    routing = Routing(
        dp_rank=_dp_rank(headers),
        priority=_priority(req.priority) if "priority" in body else None,
        cache_salt=req.cache_salt,
    )
    client_id = _client_id(req, headers)
    base = _canonical(sp, max_tokens)
    items: list[Envelope] = []
    for index in range(n):
        canonical = base.copy()
        item_native = dict(native)
        if n > 1:
            # Each sample asks its engine for one generation (the fan-out is the mesh's).
            item_native["sampling_params"] = {**raw_sp, "n": 1}
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
                model=req.model,
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
        model=req.model,
        include_usage=include_usage,
        continuous_usage=continuous,
        return_token_ids=bool(req.return_token_ids),
        mm_placeholders=None
        if req.features is None
        else {
            modality: [{"offset": p.offset, "length": p.length} for p in ranges]
            for modality, ranges in req.features.mm_placeholders.items()
        },
    )
    return Bound(
        items=items,
        stream=bool(req.stream),
        client_id=client_id,
        options=options,
        migration=migration_refusal(raw_sp),
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

"""SGLang `/generate` requests: parse, validate as SGLang does, project onto envelopes.

The steps follow SGLang's own, in its order: FastAPI's pydantic check of the JSON types
(`schema`), `GenerateReqInput.normalize_batch_and_arguments` (batch, `n`, rids, per-prompt
fields), then per prompt the tokenizer manager's checks (context length, `token_ids_logprob`)
and `SamplingParams` with the server's preferred sampling params under the request's own,
`normalize` and `verify`.

Every field the real server accepts is accepted. Fields genmesh cannot honour (images,
hidden states, sessions, ...) are refused only when their value asks for something: absent,
null or the server's default never is. Fields SGLang does not know are ignored, as SGLang
ignores them, and logged once per name.

Error shapes are SGLang's (reference `engine-apis.md` §A.6): wrong JSON types get the legacy
`{"object": "error", "message", "type": "Bad Request", "param": null, "code": 400}` with
FastAPI's message; values SGLang refuses get `{"error": {"message"}}` with SGLang's words.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from genmesh.formats.base import Bound, RequestRejected
from genmesh.formats.checks import IgnoredFields, oversized_int
from genmesh.formats.fastapi import UNREADABLE_BODY, BodyError, read_json
from genmesh.formats.sglang.errors import legacy_error, type_error, value_error
from genmesh.formats.sglang.sampling import Sampled, migration_refusal, resolve_sampling
from genmesh.formats.sglang.schema import (
    GENERATE_FIELDS,
    GenerateReqInput,
    SamplingParams,
    SchemaError,
    validate_body,
    validate_sampling,
    validation_message,
)
from genmesh.shared.engine_info import NO_ENGINES, EngineCatalog, EngineInfo
from genmesh.shared.envelope import (
    MAX_TOKEN_ID,
    Envelope,
    IntArray,
    OutputOptions,
    Routing,
    TokenIds,
)
from genmesh.shared.ids import new_public_id

# One request may fan out into at most this many generations (batch size x n).
MAX_GENERATIONS = 1024

SKIP_TOKENIZER_TEXT = (
    "The engine initialized with skip_tokenizer_init=True cannot accept text prompts. "
    "Please provide input_ids or re-initialize the engine with skip_tokenizer_init=False."
)

# Fields whose value asks for what this server cannot do, with the reason it gives. An
# "empty" value (null, false, "", [], {}, or lists of those) asks for nothing.
UNSUPPORTED = {
    "input_embeds": "input_embeds is not supported by this server; send input_ids",
    "image_data": "multimodal inputs (image_data) are not supported by this server",
    "video_data": "multimodal inputs (video_data) are not supported by this server",
    "audio_data": "multimodal inputs (audio_data) are not supported by this server",
    "return_hidden_states": "return_hidden_states is not supported by this server",
    "custom_logit_processor": "custom_logit_processor is not enabled on this server",
    "session_params": "sessions (session_params) are not supported by this server",
    "return_sampling_mask": "return_sampling_mask is not supported by this server",
    "return_flat_raw_top_logprobs": "return_flat_raw_top_logprobs is not supported by "
    "this server; read input_top_logprobs",
    "return_indexer_topk": "return_indexer_topk is not supported by this server",
    "positional_embed_overrides": "positional_embed_overrides is not supported by this server",
    "multi_item_delimiter_indices": "multi-item scoring (multi_item_delimiter_indices) is not "
    "supported by this server",
    # SGLang's own refusal, unless launched with --enable-strict-thinking.
    "max_thinking_tokens": "max_thinking_tokens requires the server to be launched with "
    "--enable-strict-thinking",
}
# Prefill/decode pairing is the mesh's business, never the client's.
INTERNAL = (
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "decode_tp_size",
    "disagg_prefill_dp_rank",
)
# Fields SGLang takes per prompt of a batch (a scalar, or a list with one entry per prompt).
_PER_PROMPT = (
    "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "lora_path", "extra_key", "cache_salt",
)  # fmt: skip
# Also per prompt, but a flat list of ids is one value for every prompt.
_TOKEN_IDS = "token_ids_logprob"
_LOGPROB_LISTS = ("return_logprob", "logprob_start_len", "top_logprobs_num")
# Fields the mesh handles itself: they never reach an engine's native payload.
_NOT_FORWARDED = frozenset(("input_ids", "rid", "stream", "text"))

# SGLang (FastAPI over a dataclass) drops fields it does not know, silently; say it once,
# quietly: sglang-router adds `model` to every body.
IGNORED = IgnoredFields(
    logging.getLogger(__name__), "ignoring request field(s) SGLang does not know: %s", logging.INFO
)


@dataclass(frozen=True, slots=True)
class ItemOptions:
    """What the renderer needs to know about one generation of the request."""

    public_id: str | None  # None: the handler's public ID (single requests without an ID)
    prompt_tokens: int
    return_logprob: bool
    top_logprobs_num: int
    max_new_tokens: int | None
    return_routed_experts: bool = False
    # `token_ids_logprob` was asked for (with return_logprob): render its two lists.
    token_ids_logprob: bool = False
    # `return_prompt_token_ids`: every record carries the prompt as `prompt_token_ids`.
    return_prompt_token_ids: bool = False


@dataclass(frozen=True, slots=True)
class SglangOptions:
    items: list[ItemOptions]
    # A batch or n > 1: the answer is an array, and SSE chunks carry `index`.
    multi: bool


def parse(body: bytes) -> Any:
    """The body as FastAPI reads it for SGLang: JSON, or the error FastAPI answers with."""
    try:
        return read_json(body)
    except BodyError as exc:
        if exc.errors is not None:
            raise type_error(validation_message(exc.errors)) from None
        # FastAPI's answer to a body it cannot read at all: an HTTPException(400).
        answer = legacy_error(UNREADABLE_BODY) | {"type": "400"}
        raise RequestRejected(400, answer, UNREADABLE_BODY) from None


def _empty(value: Any) -> bool:
    """A value that asks for nothing: null, false, "", [] or {} (or lists of those)."""
    if isinstance(value, list):
        return all(_empty(v) for v in value)
    return value is None or value is False or value == "" or value == {}


@dataclass(slots=True)
class _Batch:
    """A request after SGLang's normalize step: one entry per prompt."""

    prompts: list[TokenIds]
    single: bool
    n: int
    per_prompt: dict[str, list[Any]]
    token_ids: list[list[int] | None]
    # Each prompt's sampling_params, type-checked.
    params: list[SamplingParams]


def _prompts(obj: GenerateReqInput) -> tuple[list[TokenIds], bool]:
    """The prompts and whether it is one request (SGLang: `_determine_batch_size`)."""
    ids = obj.input_ids
    if ids is None:
        if obj.text is not None:
            raise value_error(SKIP_TOKENIZER_TEXT)
        raise value_error("Either text, input_ids or input_embeds should be provided.")
    if not ids:
        raise value_error("input_ids cannot be empty.")
    # The schema packed each prompt in C, and checked its range there: TokenIds when every
    # id is a token id, else an int64 array, which alone is walked in Python, to say where.
    single = not isinstance(ids, list)
    rows: list[IntArray] = ids if isinstance(ids, list) else [ids]
    prompts: list[TokenIds] = []
    for b, prompt in enumerate(rows):
        if not prompt:
            raise value_error("input_ids cannot be empty.")
        if not isinstance(prompt, TokenIds):
            i, tid = next((i, t) for i, t in enumerate(prompt) if not 0 <= t <= MAX_TOKEN_ID)
            where = f"input_ids[{i}]" if single else f"input_ids[{b}][{i}]"
            raise value_error(f"{where}: token id {tid} is out of range")
        prompts.append(prompt)
    return prompts, single


def _per_prompt(body: Mapping[str, Any], key: str, count: int, single: bool) -> list[Any]:
    """A field that is a scalar, or (for a batch) a list with one entry per prompt."""
    value = body.get(key)
    if not isinstance(value, list):
        return [value] * count
    if single:
        kind = "string" if key in ("extra_key", "cache_salt") else "scalar"
        raise value_error(f"{key} should be a {kind} for a single request.")
    if len(value) != count:
        if key == "lora_path":  # SGLang's normalize_lora_paths
            raise value_error(
                f"lora_path list length ({len(value)}) must match batch size ({count})"
            )
        raise value_error(f"The length of {key} should be equal to the batch size.")
    return value


def _params(body: Mapping[str, Any], sps: list[Any]) -> list[SamplingParams]:
    """Each prompt's sampling_params, type-checked (`where`: their place in the body)."""
    listed = isinstance(body.get("sampling_params"), list)
    out = []
    for b, sent in enumerate(sps):
        where: tuple[Any, ...] = ("sampling_params", b) if listed else ("sampling_params",)
        try:
            out.append(validate_sampling(dict(sent or {}), where))
        except SchemaError as exc:
            raise type_error(str(exc)) from None
        except TypeError as exc:  # a key SamplingParams does not take
            raise value_error(str(exc)) from None
    return out


def _samples(params: list[SamplingParams]) -> int:
    """`n`, which every prompt's sampling_params must agree on (`_handle_parallel_sampling`)."""
    counts = [1 if p.n is None else p.n for p in params]
    if any(count != counts[0] for count in counts):
        raise value_error(
            "The parallel_sample_num should be the same for all samples in sample params."
        )
    n: int = counts[0]
    if n < 1:
        raise value_error(f"sampling_params.n must be at least 1, got {n}")
    return n


def _token_ids_logprob(value: Any, count: int, single: bool, n: int) -> list[list[int] | None]:
    """One list of token ids per prompt (a flat list: the same for every prompt)."""
    if not value:
        return [None] * count
    if not isinstance(value[0], list):
        rows: list[Any] = [list(value) for _ in range(count)]
    elif single:
        raise value_error("token_ids_logprob must be a flat list of integers.")
    elif n > 1:
        raise value_error("Cannot use list token_ids_logprob with parallel_sample_num > 1")
    elif len(value) != count:
        raise value_error("The length of token_ids_logprob should be equal to the batch size.")
    else:
        rows = list(value)
    for row in rows:
        for tid in row or ():
            if not 0 <= tid <= MAX_TOKEN_ID:
                raise value_error(
                    f"token_ids_logprob contains out-of-vocabulary token id {tid}; "
                    f"token ids are in [0, {MAX_TOKEN_ID + 1})."
                )
    return [row or None for row in rows]


def _normalize(body: Mapping[str, Any], obj: GenerateReqInput) -> _Batch:
    """`normalize_batch_and_arguments`: the checks SGLang makes before tokenizing."""
    if obj.session_id is not None and obj.session_params is not None:
        raise value_error("session_id and session_params cannot both be set.")
    if obj.return_flat_raw_top_logprobs_b64 and not obj.return_flat_raw_top_logprobs:
        raise value_error("return_flat_raw_top_logprobs_b64 requires return_flat_raw_top_logprobs.")
    prompts, single = _prompts(obj)
    count = len(prompts)
    per_prompt = {key: _per_prompt(body, key, count, single) for key in _PER_PROMPT}
    params = _params(body, per_prompt["sampling_params"])
    n = _samples(params)
    if count * n > MAX_GENERATIONS:
        raise value_error(
            f"this request asks for {count * n} generations ({count} prompts x n={n}); "
            f"at most {MAX_GENERATIONS} per request"
        )
    if n > 1:
        for key in _LOGPROB_LISTS:
            if isinstance(body.get(key), list):
                raise value_error(f"Cannot use list {key} with parallel_sample_num > 1")
    for key in ("extra_key", "cache_salt"):
        # An empty key is no key (SGLang: `_normalize_extra_key`).
        per_prompt[key] = [value or None for value in per_prompt[key]]
    token_ids = _token_ids_logprob(obj.token_ids_logprob, count, single, n)
    return _Batch(prompts, single, n, per_prompt, token_ids, params)


def _refuse_by_value(obj: GenerateReqInput) -> None:
    for key in INTERNAL:
        if getattr(obj, key) is not None:
            raise value_error(
                f"`{key}` is internal routing state and cannot be set by clients "
                "(this server does its own prefill/decode pairing)"
            )
    for key, reason in UNSUPPORTED.items():
        if not _empty(getattr(obj, key)):
            raise value_error(reason)


# ---------------------------------------------------------------- per prompt


def _check_context(prompt: TokenIds, sent: Mapping[str, Any], info: EngineInfo | None) -> None:
    """The tokenizer manager's `_validate_one_request`: against the engine's context length,
    the prompt, and the prompt plus an explicitly requested max_new_tokens (refused, not
    capped: SGLang caps only with --allow-auto-truncate)."""
    context = info.context_length if info else None
    if context is None:
        return
    length = len(prompt)
    if length >= context:
        raise value_error(
            f"The input ({length} tokens) is longer than the model's context length "
            f"({context} tokens)."
        )
    max_new = sent.get("max_new_tokens")
    if isinstance(max_new, int) and max_new + length > context:
        raise value_error(
            "Requested token count exceeds the model's maximum context length "
            f"of {context} tokens. You requested a total of {max_new + length} "
            f"tokens: {length} tokens from the input messages and "
            f"{max_new} tokens for the completion. Please reduce the number "
            "of tokens in the input messages or the completion to fit within the limit."
        )


def _int_field(value: Any, default: int) -> int:
    return default if value is None else int(value)


def _output(prompt: TokenIds, batch: _Batch, b: int) -> tuple[OutputOptions, bool, int]:
    """The logprob options of prompt `b`: (options, return_logprob, top_logprobs_num)."""
    per = batch.per_prompt
    wanted = bool(per["return_logprob"][b])
    start = _int_field(per["logprob_start_len"][b], -1)
    top_k = _int_field(per["top_logprobs_num"][b], 0)
    if top_k < 0:
        raise value_error(f"top_logprobs_num must be >= 0, got {top_k}")
    if start < -1:
        raise value_error(f"logprob_start_len must be >= -1, got {start}")
    if wanted and start >= len(prompt):
        # The scheduler aborts it so (a 400 abort: SGLang answers with its message).
        raise value_error(
            f"req.logprob_start_len={start} is higher than the number of input tokens "
            f"len(req.origin_input_ids)={len(prompt)}. Please use a smaller logprob_start_len."
        )
    if not wanted:
        return OutputOptions(), False, 0
    output = OutputOptions(
        logprobs=True,
        top_logprobs=top_k,
        prompt_logprobs_start=len(prompt) - 1 if start == -1 else start,
        logprob_token_ids=batch.token_ids[b],
    )
    return output, True, top_k


def _routed_experts(obj: GenerateReqInput, prompts: list[TokenIds]) -> int | None:
    """Where routed-expert rows are wanted from, if they are."""
    if not obj.return_routed_experts:
        return None
    start = obj.routed_experts_start_len
    for prompt in prompts:
        if not 0 <= start <= len(prompt):
            raise value_error(
                f"routed_experts_start_len must be in [0, {len(prompt)}] "
                f"(the prompt length), got {start}"
            )
    return start


def _routing(obj: GenerateReqInput, batch: _Batch, b: int) -> Routing:
    dp_rank = obj.routed_dp_rank if obj.routed_dp_rank is not None else obj.data_parallel_rank
    if dp_rank is not None and dp_rank < 0:
        raise value_error(f"the data-parallel rank must be >= 0, got {dp_rank}")
    salt = batch.per_prompt["cache_salt"][b] or batch.per_prompt["extra_key"][b]
    return Routing(dp_rank=dp_rank, priority=obj.priority, cache_salt=salt, session=obj.session_id)


def _rids(
    obj: GenerateReqInput, headers: Mapping[str, str], batch: _Batch
) -> tuple[str | None, list[str | None]]:
    """The client ID of the request and the echoed ID of each prompt (SGLang's rules)."""
    rid, count = obj.rid, len(batch.prompts)
    if isinstance(rid, list):
        if batch.single:
            raise value_error("The rid should be a string for a single request.")
        if len(rid) != count:
            raise value_error(
                "The specified rids length mismatch with the batch_size for batch processing."
            )
        duplicates = sorted({r for r in rid if rid.count(r) > 1})
        if duplicates:
            raise value_error(f"Duplicate request IDs detected within the request: {duplicates}")
        return None, list(rid)
    client_id = rid if rid is not None else _header(headers, "x-request-id")
    if batch.single:
        return client_id, [client_id]
    # A scalar rid on a batch: item i is "{rid}_{i}".
    return client_id, [None if client_id is None else f"{client_id}_{b}" for b in range(count)]


def _migration(sampled: list[Sampled]) -> str | None:
    for one in sampled:
        refusal = migration_refusal(one.params, one.repetition_penalty)
        if refusal is not None:
            return refusal
    return None


def bind(body: Any, headers: Mapping[str, str], engines: EngineCatalog = NO_ENGINES) -> Bound:
    try:
        obj = validate_body(body)
    except SchemaError as exc:
        raise type_error(str(exc)) from None
    assert isinstance(body, dict)  # the schema takes JSON objects only
    IGNORED.note(key for key in body if key not in GENERATE_FIELDS)
    _refuse_by_value(obj)
    batch = _normalize(body, obj)
    # input_ids were checked as int64 already; the rest must fit the bus (msgpack: 64 bits).
    oversized = oversized_int({k: v for k, v in body.items() if k != "input_ids"})
    if oversized is not None:
        raise value_error(f"{oversized[0]}: integer {oversized[1]} does not fit in 64 bits")
    client_id, rids = _rids(obj, headers, batch)
    # SGLang serves one model; the `model` a router adds to the body means nothing to it.
    info = engines.get(None)
    experts = _routed_experts(obj, batch.prompts)
    multi = not batch.single or batch.n > 1
    n = batch.n

    forwarded = {k: v for k, v in body.items() if k in GENERATE_FIELDS and k not in _NOT_FORWARDED}
    shared = {k: v for k, v in forwarded.items() if k not in _PER_PROMPT and k != _TOKEN_IDS}
    items: list[Envelope] = []
    options: list[ItemOptions] = []
    sampled: list[Sampled] = []
    for b, prompt in enumerate(batch.prompts):
        sent = batch.per_prompt["sampling_params"][b] or {}
        _check_context(prompt, sent, info)
        one = resolve_sampling(batch.params[b], sent, info)
        sampled.append(one)
        output, wanted, top_k = _output(prompt, batch, b)
        if experts is not None:
            output.routed_experts_start = experts
        # The native payload as the client sent it, narrowed to this prompt; each sample
        # asks the engine for one generation (the fan-out is the mesh's job).
        native = dict(shared)
        for key in _PER_PROMPT:
            if key in forwarded:
                value = forwarded[key]
                native[key] = value[b] if isinstance(value, list) else value
        if _TOKEN_IDS in forwarded:
            native[_TOKEN_IDS] = batch.token_ids[b]
        if n > 1:
            native["sampling_params"] = {**native["sampling_params"], "n": 1}
        routing = _routing(obj, batch, b)
        for _ in range(n):
            # With n > 1 SGLang gives every sample a fresh random rid.
            item_id = new_public_id() if n > 1 else rids[b]
            if item_id is None and multi:
                item_id = new_public_id()
            items.append(
                Envelope(
                    id="",
                    token_ids=prompt,
                    format="sglang",
                    client_id=item_id,
                    sampling=one.sampling.copy(),
                    output=replace(
                        output,
                        logprob_token_ids=None
                        if output.logprob_token_ids is None
                        else list(output.logprob_token_ids),
                    ),
                    routing=routing.copy(),
                    engine=dict(native),
                )
            )
            options.append(
                ItemOptions(
                    public_id=item_id,
                    prompt_tokens=len(prompt),
                    return_logprob=wanted,
                    return_routed_experts=experts is not None,
                    top_logprobs_num=top_k,
                    max_new_tokens=one.sampling.max_tokens,
                    token_ids_logprob=wanted and output.logprob_token_ids is not None,
                    return_prompt_token_ids=obj.return_prompt_token_ids,
                )
            )
    return Bound(
        items=items,
        stream=obj.stream,
        client_id=client_id,
        options=SglangOptions(options, multi),
        migration=_migration(sampled),
        running_ids=_running_ids(obj, rids, n),
    )


def _running_ids(obj: GenerateReqInput, rids: list[str | None], n: int) -> list[str]:
    """The rids SGLang keeps in its rid_to_state while they run, and so refuses twice:
    those of the body's `rid` (not an `X-Request-Id` standing in for it: SGLang never
    sees the header as a rid), none with `n > 1` (SGLang regenerates every rid)."""
    if obj.rid is None or n > 1:
        return []
    return [rid for rid in rids if rid is not None]


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None:
        return None
    value = value.strip()
    return value or None

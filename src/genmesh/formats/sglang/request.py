"""SGLang `/generate` requests: parse, validate as SGLang does, project onto an envelope.

Error shapes follow SGLang (reference `engine-apis.md` §A.6): a body that is not JSON, or a
field of the wrong JSON type, gets the legacy validation shape
`{"object": "error", "message", "type": "Bad Request", "param": null, "code": 400}`; a value
SGLang would reject gets `{"error": {"message"}}`. Messages reuse SGLang's wording where it
has one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
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
from genmesh.shared.ids import new_public_id

DEFAULT_MAX_NEW_TOKENS = 128

# Fields a tokenizer-less server cannot honour, with the reason it gives.
_UNSUPPORTED = {
    "input_embeds": "input_embeds is not supported by this server; send input_ids",
    "image_data": "multimodal inputs (image_data) are not supported by this server",
    "video_data": "multimodal inputs (video_data) are not supported by this server",
    "audio_data": "multimodal inputs (audio_data) are not supported by this server",
    "token_ids_logprob": "token_ids_logprob is not supported by this server yet",
    "return_hidden_states": "return_hidden_states is not supported by this server",
    "custom_logit_processor": "custom_logit_processor is not enabled on this server",
    "session_params": "sessions (session_params) are not supported by this server",
    "session_id": "sessions (session_id) are not supported by this server",
}
# Prefill/decode pairing is the mesh's business, never the client's.
_INTERNAL = (
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "decode_tp_size",
    "disagg_prefill_dp_rank",
)
# Fields accepted and passed to the engine untouched (ignored where they mean nothing here).
_PASSTHROUGH = (
    "lora_path",
    "return_text_in_logprobs",
    "modalities",
    "background",
    "conversation_id",
    "custom_labels",
    "no_logs",
    "return_entropy",
    "return_prompt_token_ids",
    "log_metrics",
    "require_reasoning",
    "routing_key",
)
_ROUTING = ("data_parallel_rank", "routed_dp_rank", "priority", "extra_key")
# Fields SGLang takes per prompt of a batch (a scalar, or a list with one entry per prompt).
_PER_PROMPT = (
    "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "lora_path", "extra_key",
)  # fmt: skip
# Fields the mesh handles itself: they never reach an engine's native payload.
_NOT_FORWARDED = frozenset(("input_ids", "rid", "stream", "text"))
# One request may fan out into at most this many generations (batch size x n).
MAX_GENERATIONS = 1024
_CORE = (
    "return_routed_experts",
    "routed_experts_start_len",
    "text",
    "input_ids",
    "sampling_params",
    "rid",
    "stream",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
)
KNOWN_FIELDS = frozenset((*_CORE, *_UNSUPPORTED, *_INTERNAL, *_PASSTHROUGH, *_ROUTING))


def legacy_error(message: str, status: int = 400) -> dict[str, Any]:
    return {
        "object": "error",
        "message": message,
        "type": "Bad Request",
        "param": None,
        "code": status,
    }


def error(message: str, status: int = 400) -> dict[str, Any]:
    """SGLang's error body: `{"error": {"message"}}`, except for the 5xx answers SGLang
    raises as HTTPExceptions (queue full, engine failures), which get the legacy shape."""
    if status >= 500:
        return legacy_error(message, status) | {"type": str(status)}
    return {"error": {"message": message}}


def _type_error(message: str) -> RequestRejected:
    return RequestRejected(400, legacy_error(message), message)


def _value_error(message: str) -> RequestRejected:
    return RequestRejected(400, error(message), message)


@dataclass(frozen=True, slots=True)
class ItemOptions:
    """What the renderer needs to know about one generation of the request."""

    public_id: str | None  # None: the handler's public ID (single requests without an ID)
    prompt_tokens: int
    return_logprob: bool
    top_logprobs_num: int
    max_new_tokens: int | None
    return_routed_experts: bool = False


@dataclass(frozen=True, slots=True)
class SglangOptions:
    items: list[ItemOptions]
    # A batch or n > 1: the answer is an array, and SSE chunks carry `index`.
    multi: bool


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _opt_int(obj: Mapping[str, Any], key: str, where: str) -> int | None:
    value = obj.get(key)
    if value is not None and not _is_int(value):
        raise _type_error(f"{where}{key}: Input should be a valid integer, got {value!r}")
    return value


def _opt_number(obj: Mapping[str, Any], key: str) -> float | None:
    value = obj.get(key)
    if value is None:
        return None
    if not _is_number(value):
        raise _type_error(f"sampling_params.{key}: Input should be a valid number, got {value!r}")
    number = finite_float(value)
    if number is None:
        raise _value_error(f"{key} must be a finite number, got {value!r:.40}.")
    return number


def _opt_bool(obj: Mapping[str, Any], key: str, where: str = "") -> bool:
    value = obj.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _type_error(f"{where}{key}: Input should be a valid boolean, got {value!r}")
    return value


def _input_ids(body: Mapping[str, Any]) -> tuple[list[list[int]], bool]:
    """The prompts, and whether the request is a batch."""
    if body.get("text") is not None:
        raise _value_error(
            "text prompts need a tokenizer and this server has none "
            "(it serves like SGLang with --skip-tokenizer-init): send input_ids instead"
        )
    ids = body.get("input_ids")
    if ids is None:
        raise _value_error("Either text or input_ids should be provided.")
    if not isinstance(ids, list):
        raise _type_error(f"input_ids: Input should be a valid list, got {type(ids).__name__}")
    if not ids:
        raise _value_error("input_ids cannot be empty.")
    batch = isinstance(ids[0], list)
    prompts = ids if batch else [ids]
    for b, prompt in enumerate(prompts):
        where = f"input_ids[{b}]" if batch else "input_ids"
        if not isinstance(prompt, list):
            raise _type_error(f"{where}: Input should be a valid list (batch items are lists)")
        if not prompt:
            raise _value_error("input_ids cannot be empty.")
        for i, tid in enumerate(prompt):
            if not _is_int(tid):
                raise _type_error(f"{where}[{i}]: Input should be a valid integer, got {tid!r}")
            if not 0 <= tid <= MAX_TOKEN_ID:
                raise _value_error(f"{where}[{i}]: token id {tid} is out of range")
    return prompts, batch


def _per_item(body: Mapping[str, Any], key: str, count: int, batch: bool) -> list[Any]:
    """A field that is a scalar, or (for a batch) a list with one entry per prompt."""
    value = body.get(key)
    if isinstance(value, list):
        if not batch:
            raise _value_error(f"{key}: a list is only allowed with batch input_ids")
        if len(value) != count:
            raise _value_error(f"{key} has {len(value)} entries for {count} prompts")
        return value
    return [value] * count


def _sampling(sp: Mapping[str, Any]) -> Sampling:
    max_new = sp.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if max_new is not None:
        if not _is_int(max_new):
            raise _type_error(
                f"sampling_params.max_new_tokens: Input should be a valid integer, got {max_new!r}"
            )
        if max_new < 0:
            raise _value_error(f"max_new_tokens must be at least 0, got {max_new}.")
    min_new = _opt_int(sp, "min_new_tokens", "sampling_params.") or 0
    # null max_new_tokens is uncapped: then only the lower bound applies, as in SGLang.
    if min_new < 0 or (max_new is not None and min_new > max_new):
        raise _value_error(
            f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new}."
        )
    temperature = _opt_number(sp, "temperature")
    if temperature is not None and temperature < 0:
        raise _value_error(f"temperature must be non-negative, got {temperature}.")
    top_p = _opt_number(sp, "top_p")
    if top_p is not None and not 0 < top_p <= 1:
        raise _value_error(f"top_p must be in (0, 1], got {top_p}.")
    min_p = _opt_number(sp, "min_p")
    if min_p is not None and not 0 <= min_p <= 1:
        raise _value_error(f"min_p must be in [0, 1], got {min_p}.")
    top_k = _opt_int(sp, "top_k", "sampling_params.")
    if top_k is not None and top_k != -1 and top_k < 1:
        raise _value_error(f"top_k must be -1 (disable), or at least 1, got {top_k}.")
    for key in ("frequency_penalty", "presence_penalty"):
        value = _opt_number(sp, key)
        if value is not None and not -2 <= value <= 2:
            raise _value_error(f"{key} must be in [-2, 2], got {value}.")
    repetition = _opt_number(sp, "repetition_penalty")
    if repetition is not None and not 0 < repetition <= 2:
        raise _value_error(f"repetition_penalty must be in (0, 2], got {repetition}.")
    for key in ("stop", "stop_regex"):
        if sp.get(key) not in (None, [], ""):
            raise _value_error(
                f"sampling_params.{key}: stop strings need a tokenizer and this server has "
                "none; use stop_token_ids"
            )
    if sum(sp.get(key) is not None for key in ("json_schema", "regex", "ebnf")) > 1:
        raise _value_error("Only one of regex, json_schema, or ebnf can be set.")
    stop_ids = sp.get("stop_token_ids")
    if stop_ids is None:
        stop_ids = []
    if not isinstance(stop_ids, list) or not all(
        _is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in stop_ids
    ):
        raise _type_error("sampling_params.stop_token_ids: Input should be a list of token ids")
    seed = _opt_int(sp, "sampling_seed", "sampling_params.")
    ignore_eos = _opt_bool(sp, "ignore_eos", "sampling_params.")
    return Sampling(
        max_tokens=max_new,
        min_tokens=min_new,
        temperature=temperature,
        top_p=top_p,
        top_k=None if top_k == -1 else top_k,
        min_p=min_p,
        seed=seed,
        # SGLang's Req.check_finished skips stop token ids as well as EOS under
        # ignore_eos; canonical stop_token_ids are honoured by every engine, so say so here.
        stop_token_ids=[] if ignore_eos else stop_ids,
        ignore_eos=ignore_eos,
    )


def _routing(body: Mapping[str, Any], cache_salt: Any) -> Routing:
    dp_rank = _opt_int(body, "routed_dp_rank", "")
    if dp_rank is None:
        dp_rank = _opt_int(body, "data_parallel_rank", "")
    if dp_rank is not None and dp_rank < 0:
        raise _value_error(f"the data-parallel rank must be >= 0, got {dp_rank}")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise _type_error("extra_key: Input should be a valid string")
    return Routing(dp_rank=dp_rank, priority=_opt_int(body, "priority", ""), cache_salt=cache_salt)


def parse(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise _type_error(f"request body is not valid JSON: {exc}") from None


def _samples(sps: list[Any]) -> int:
    counts = set()
    for sp in sps:
        n = _opt_int(sp, "n", "sampling_params.")
        n = 1 if n is None else n
        if n < 1:
            raise _value_error(f"sampling_params.n must be at least 1, got {n}")
        counts.add(n)
    if len(counts) > 1:
        raise _value_error("sampling_params: every entry of a batch must have the same n")
    return counts.pop()


def _logprob_options(
    body: Mapping[str, Any], prompts: list[list[int]], batch: bool
) -> list[OutputOptions]:
    count = len(prompts)
    flags = _per_item(body, "return_logprob", count, batch)
    starts = _per_item(body, "logprob_start_len", count, batch)
    tops = _per_item(body, "top_logprobs_num", count, batch)
    out = []
    for b, prompt in enumerate(prompts):
        item = {
            "return_logprob": flags[b],
            "logprob_start_len": starts[b],
            "top_logprobs_num": tops[b],
        }
        wanted = _opt_bool(item, "return_logprob")
        start = _opt_int(item, "logprob_start_len", "")
        start = -1 if start is None else start
        top_k = _opt_int(item, "top_logprobs_num", "") or 0
        if top_k < 0:
            raise _value_error(f"top_logprobs_num must be >= 0, got {top_k}")
        if start < -1:
            raise _value_error(f"logprob_start_len must be >= -1, got {start}")
        if wanted and start >= len(prompt):
            raise _value_error(
                f"logprob_start_len ({start}) is higher than the number of input tokens "
                f"({len(prompt)}). Request with a lower logprob_start_len."
            )
        out.append(
            OutputOptions(
                logprobs=True,
                top_logprobs=top_k,
                prompt_logprobs_start=len(prompt) - 1 if start == -1 else start,
            )
            if wanted
            else OutputOptions()
        )
    return out


def _routed_experts(
    body: Mapping[str, Any], prompts: list[list[int]], outputs: list[OutputOptions]
) -> bool:
    """Ask for routed-expert rows from `routed_experts_start_len` (into each output)."""
    wanted = _opt_bool(body, "return_routed_experts")
    start = _opt_int(body, "routed_experts_start_len", "") or 0
    if not wanted:
        return False
    for prompt, output in zip(prompts, outputs, strict=True):
        if not 0 <= start <= len(prompt):
            raise _value_error(
                f"routed_experts_start_len must be in [0, {len(prompt)}] "
                f"(the prompt length), got {start}"
            )
        output.routed_experts_start = start
    return True


def _rids(
    body: Mapping[str, Any], headers: Mapping[str, str], count: int, batch: bool
) -> tuple[str | None, list[str | None]]:
    """The client ID of the request and the echoed ID of each prompt (SGLang's rules)."""
    rid = body.get("rid")
    if isinstance(rid, list):
        if not batch:
            raise _value_error("rid: a list is only allowed with batch input_ids")
        if not all(isinstance(r, str) for r in rid):
            raise _type_error("rid: Input should be a list of valid strings")
        if len(rid) != count:
            raise _value_error(f"rid: expected {count} strings, one per prompt")
        if len(set(rid)) != len(rid):
            raise _value_error("rid: duplicate request ids in one batch")
        return None, list(rid)
    if rid is not None and not isinstance(rid, str):
        raise _type_error("rid: Input should be a valid string")
    client_id = rid if rid is not None else _header(headers, "x-request-id")
    if not batch:
        return client_id, [client_id]
    # A scalar rid on a batch: item i is "{rid}_{i}".
    return client_id, [None if client_id is None else f"{client_id}_{b}" for b in range(count)]


def bind(body: Any, headers: Mapping[str, str], engines: EngineCatalog = NO_ENGINES) -> Bound:
    if not isinstance(body, dict):
        raise _type_error(f"request body must be a JSON object, got {type(body).__name__}")

    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        raise _value_error(f"unsupported top-level SGLang generate field(s): {', '.join(unknown)}")
    for key in _INTERNAL:
        if body.get(key) is not None:
            raise _value_error(
                f"`{key}` is internal routing state and cannot be set by clients "
                "(this server does its own prefill/decode pairing)"
            )
    for key, reason in _UNSUPPORTED.items():
        if body.get(key) not in (None, False, [], {}):
            raise _value_error(reason)

    prompts, batch = _input_ids(body)
    count = len(prompts)
    oversized = oversized_int(body)
    if oversized is not None:
        raise _value_error(f"{oversized[0]}: integer {oversized[1]} does not fit in 64 bits")
    per_prompt = {key: _per_item(body, key, count, batch) for key in _PER_PROMPT if key in body}
    sps = per_prompt.get("sampling_params", [None] * count)
    for sp in sps:
        if sp is not None and not isinstance(sp, dict):
            raise _type_error("sampling_params: Input should be a valid dictionary")
    samplings = [_sampling(sp or {}) for sp in sps]
    n = _samples([sp or {} for sp in sps])
    if count * n > MAX_GENERATIONS:
        raise _value_error(
            f"this request asks for {count * n} generations ({count} prompts x n={n}); "
            f"at most {MAX_GENERATIONS} per request"
        )
    if n > 1 and isinstance(body.get("top_logprobs_num"), list):
        raise _value_error("top_logprobs_num cannot be a list when sampling_params.n > 1")
    outputs = _logprob_options(body, prompts, batch)
    experts = _routed_experts(body, prompts, outputs)
    client_id, rids = _rids(body, headers, count, batch)
    salts = per_prompt.get("extra_key", [None] * count)
    stream = _opt_bool(body, "stream")
    multi = batch or n > 1

    items: list[Envelope] = []
    options: list[ItemOptions] = []
    shared = {k: v for k, v in body.items() if k not in _NOT_FORWARDED and k not in per_prompt}
    for b, prompt in enumerate(prompts):
        # The native payload as the client sent it, narrowed to this prompt; each sample
        # asks the engine for one generation (the fan-out is the mesh's job).
        native = {**shared, **{key: values[b] for key, values in per_prompt.items()}}
        if n > 1:
            native["sampling_params"] = {**native["sampling_params"], "n": 1}
        routing = _routing(body, salts[b])
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
                    sampling=samplings[b].copy(),
                    output=replace(outputs[b]),
                    routing=routing.copy(),
                    engine=dict(native),
                )
            )
            options.append(
                ItemOptions(
                    public_id=item_id,
                    prompt_tokens=len(prompt),
                    return_logprob=outputs[b].logprobs,
                    return_routed_experts=experts,
                    top_logprobs_num=outputs[b].top_logprobs,
                    max_new_tokens=samplings[b].max_tokens,
                )
            )
    return Bound(
        items=items,
        stream=stream,
        client_id=client_id,
        options=SglangOptions(options, multi),
        migration=next(filter(None, (migration_refusal(sp or {}) for sp in sps)), None),
    )


def migration_refusal(sp: Mapping[str, Any]) -> str | None:
    """Why replaying the delivered tokens as prompt would change what comes next."""
    for key in ("json_schema", "regex", "ebnf", "structural_tag"):
        if sp.get(key) is not None:
            return f"guided decoding ({key}) would restart its grammar from the schema root"
    for key in ("presence_penalty", "frequency_penalty"):
        if sp.get(key):
            return f"{key} counts generated tokens, which a continuation sees as prompt"
    # SGLang's repetition penalizer counts output tokens only, too.
    if sp.get("repetition_penalty") not in (None, 1, 1.0):
        return "repetition_penalty counts generated tokens, which a continuation sees as prompt"
    return None


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None:
        return None
    value = value.strip()
    return value or None

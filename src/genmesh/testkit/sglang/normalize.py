"""A /generate body becomes validated `Item`s, one per prompt and parallel sample.

`GenerateReqInput.normalize_batch_and_arguments` (one prompt or a batch, `n` parallel
samples, rids, per-prompt logprob parameters) plus the tokenizer manager's and the
scheduler's per-request checks. Every refusal is a `Rejected` (400 `{"error"}`), except
the scheduler's own checks, which become an abort the request finishes with
(`Item.scheduler_abort`).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from genmesh.testkit.config import MockServerConfig
from genmesh.testkit.sglang.pd import Bootstrap
from genmesh.testkit.sglang.request import JSON, Rejected, is_int
from genmesh.testkit.sglang.sampling import parse_sampling

SKIP_TOKENIZER_TEXT = (
    "The engine initialized with skip_tokenizer_init=True cannot accept text prompts. "
    "Please provide input_ids or re-initialize the engine with skip_tokenizer_init=False."
)


def preferred_sampling_params(config: MockServerConfig) -> JSON:
    """`--preferred-sampling-params` as the tokenizer manager holds it (`json.loads` of the
    text; a server given text that is not a JSON object does not start)."""
    text = config.preferred_sampling_params
    if not text:
        return {}
    params = json.loads(text)
    if not isinstance(params, dict):
        raise ValueError(f"preferred_sampling_params must be a JSON object, got {text!r}")
    return params


@dataclass(slots=True)
class Item:
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
    # P/D (--disaggregation-mode): where the KV comes from or goes to.
    bootstrap: Bootstrap | None = None


def normalize(body: JSON, config: MockServerConfig) -> tuple[list[Item], bool]:
    """`GenerateReqInput.normalize_batch_and_arguments` plus the tokenizer manager's and
    the scheduler's per-request checks. Returns the items and whether it is one request."""
    batch = _normalize_batch(body)
    _refuse_disabled_features(body)
    items: list[Item] = []
    for i in range(batch.shape.batch):
        items.extend(_prompt_items(batch, i, config))
    return items, batch.shape.single


@dataclass(frozen=True, slots=True)
class _Shape:
    """How many prompts, how many parallel samples of each, and whether it is one request
    (a single prompt with n = 1: its reply is an object, not a list)."""

    single: bool
    batch: int
    n: int


@dataclass(frozen=True, slots=True)
class _Batch:
    """A request after `normalize_batch_and_arguments`: one value per prompt, and one rid
    per prompt and parallel sample."""

    shape: _Shape
    prompts: list[list[int] | None]  # None: a text prompt
    sampling_params: list[JSON]
    rids: list[str]
    return_logprob: list[Any]
    logprob_start_len: list[Any]
    top_logprobs_num: list[Any]
    token_ids_logprob: list[list[int] | None]
    return_routed_experts: bool
    routed_experts_start: int
    # The scheduler aborts every prompt of a request naming a session it does not have.
    session_abort: str | None


def _normalize_batch(body: JSON) -> _Batch:
    prompts, single = _prompts(body)
    batch = len(prompts)
    sp_raw = body.get("sampling_params")
    n = _parallel_sample_num(sp_raw)
    if isinstance(sp_raw, list) and len(sp_raw) != batch:
        raise Rejected("The length of sampling_params should be equal to the batch size.")
    shape = _Shape(single=single and n == 1, batch=batch, n=n)
    # Keyword arguments run in the order written: the order of SGLang's checks.
    return _Batch(
        shape=shape,
        prompts=prompts,
        sampling_params=list(sp_raw) if isinstance(sp_raw, list) else [sp_raw or {}] * batch,
        rids=_rids(body.get("rid"), shape),
        return_logprob=_per_prompt(body, "return_logprob", False, shape),
        logprob_start_len=_per_prompt(body, "logprob_start_len", -1, shape),
        top_logprobs_num=_per_prompt(body, "top_logprobs_num", 0, shape),
        token_ids_logprob=_token_ids_logprob(body.get("token_ids_logprob"), shape),
        return_routed_experts=bool(body.get("return_routed_experts", False)),
        routed_experts_start=_routed_experts_start(body),
        session_abort=_session_abort(body.get("session_params")),
    )


def _prompts(body: JSON) -> tuple[list[list[int] | None], bool]:
    """The batch's prompts (None for a text prompt) and whether it is one request."""
    text = body.get("text")
    input_ids = body.get("input_ids")
    if text is None and input_ids is None and body.get("input_embeds") is None:
        raise Rejected("Either text, input_ids or input_embeds should be provided.")
    if text is not None:  # batch detection looks at text first
        single = isinstance(text, str)
        batch = 1 if single else len(text)
        if input_ids is None:
            return [None] * batch, single
        prompts = _split_input_ids(input_ids)
        if len(prompts) != batch:
            raise Rejected("The length of input_ids should be equal to the batch size.")
        return prompts, single
    if input_ids is not None:
        return _split_input_ids(input_ids), is_int(input_ids[0])
    raise Rejected(
        "input_embeds is provided while disable_radix_cache is False. "
        "Please add `--disable-radix-cache` when you launch the server "
        "if you want to use input_embeds as inputs."
    )


def _split_input_ids(input_ids: list[Any]) -> list[list[int] | None]:
    if len(input_ids) == 0:
        raise Rejected("input_ids cannot be empty.")
    return [input_ids] if is_int(input_ids[0]) else list(input_ids)


def _parallel_sample_num(sp_raw: JSON | list[JSON] | None) -> int:
    """`_handle_parallel_sampling`: `n`, which every sampling_params must agree on."""
    if sp_raw is None or isinstance(sp_raw, dict):
        n = (sp_raw or {}).get("n", 1)
    else:
        n = sp_raw[0].get("n", 1) if sp_raw else 1
        for sp in sp_raw:
            if sp.get("n", 1) != n:
                raise Rejected(
                    "The parallel_sample_num should be the same for all samples in sample params."
                )
    n = 1 if n is None else n
    if not is_int(n) or n < 1:
        raise Rejected(f"n must be a positive integer, got {n!r}.")
    return n


def _rids(rid: str | list[str] | None, shape: _Shape) -> list[str]:
    """One rid per generation: a string on a batch gets "_{i}" suffixes; n > 1 regenerates
    all of them."""
    batch, n = shape.batch, shape.n
    if shape.single:
        if isinstance(rid, list):
            raise Rejected("The rid should be a string for a single request.")
        return [rid if rid is not None else uuid.uuid4().hex]
    if rid is None or n > 1:
        if isinstance(rid, list) and len(rid) != batch:
            raise Rejected(
                "The specified rids length mismatch with the batch_size for batch processing."
            )
        return [uuid.uuid4().hex for _ in range(batch * n)]
    if isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(batch * n)]
    if len(rid) != batch:
        raise Rejected(
            "The specified rids length mismatch with the batch_size for batch processing."
        )
    rids = list(rid)
    duplicates = sorted({r for r in rids if rids.count(r) > 1})
    if duplicates:
        raise Rejected(f"Duplicate request IDs detected within the request: {duplicates}")
    return rids


def _per_prompt(body: JSON, name: str, default: Any, shape: _Shape) -> list[Any]:
    """`_normalize_logprob_params`: one value per prompt of the batch."""
    value = body.get(name)
    if value is None:
        return [default] * shape.batch
    if not isinstance(value, list):
        return [value] * shape.batch
    if shape.single:
        raise Rejected(f"{name} should be a scalar for a single request.")
    if shape.n > 1:
        raise Rejected(f"Cannot use list {name} with parallel_sample_num > 1")
    if len(value) != shape.batch:
        raise Rejected(f"The length of {name} should be equal to the batch size.")
    return value


def _token_ids_logprob(tids: Any, shape: _Shape) -> list[list[int] | None]:
    """One list of token ids per prompt (an id or a list of them: the same for every prompt)."""
    if not tids:
        return [None] * shape.batch
    if is_int(tids):
        return [[tids]] * shape.batch
    if is_int(tids[0]):
        return [list(tids)] * shape.batch
    if shape.single or shape.n > 1:
        raise Rejected("Cannot use list token_ids_logprob with parallel_sample_num > 1")
    if len(tids) != shape.batch:
        raise Rejected("The length of token_ids_logprob should be equal to the batch size.")
    return list(tids)


def _routed_experts_start(body: JSON) -> int:
    routed_start: int = body.get("routed_experts_start_len", 0)
    if routed_start < 0:
        raise Rejected(
            f"routed_experts_start_len must be in [0, prompt_tokens], got {routed_start}."
        )
    return routed_start


def _session_abort(session: JSON | None) -> str | None:
    if session and session.get("id") is not None:
        return f"Invalid request: session id {session['id']} does not exist"
    return None


def _refuse_disabled_features(body: JSON) -> None:
    """What this server was not launched to do (SGLang's launch flags)."""
    if body.get("return_hidden_states"):
        raise Rejected(
            "The server is not configured to return the hidden states. "
            "Please set `--enable-return-hidden-states` to enable this feature."
        )
    if body.get("custom_logit_processor"):
        raise Rejected(
            "The server is not configured to enable custom logit processor. "
            "Please set `--enable-custom-logit-processor` to enable this feature."
        )
    if body.get("lora_path"):
        raise Rejected(
            "LoRA is not enabled on this server; launch it with `--enable-lora` to use "
            f"lora_path={body['lora_path']!r}."
        )


def _prompt_items(batch: _Batch, i: int, config: MockServerConfig) -> list[Item]:
    """The items of prompt `i`, one per parallel sample, after its own checks."""
    sp = batch.sampling_params[i]
    prompt = _check_prompt(batch.prompts[i], sp, config)
    length = len(prompt)
    # `_create_tokenized_object`: the server's preferred params under the request's own,
    # merged after the context checks (which read the request's max_new_tokens alone).
    sampling = parse_sampling({**preferred_sampling_params(config), **sp}, config.vocab_size)
    start, k = batch.logprob_start_len[i], batch.top_logprobs_num[i]
    ids = batch.token_ids_logprob[i]
    _check_logprob_params(start, k, ids, config.vocab_size)
    abort = batch.session_abort
    if abort is None:
        abort = _scheduler_check(batch, i, length, sampling.grammar)
    room = config.max_model_len - length - 1  # the scheduler clamps an uncapped max_new_tokens
    budget = sampling.max_new_tokens
    n = batch.shape.n
    return [
        Item(
            index=j,
            rid=batch.rids[j],
            prompt=list(prompt),
            max_new_tokens=room if budget is None else min(budget, room),
            min_new_tokens=sampling.min_new_tokens,
            stop_token_ids=sampling.stop_token_ids,
            ignore_eos=sampling.ignore_eos,
            seed=sampling.seed,
            stream_interval=sampling.stream_interval,
            return_logprob=bool(batch.return_logprob[i]),
            logprob_start=length - 1 if start == -1 else start,
            top_logprobs_num=k,
            token_ids_logprob=ids,
            return_routed_experts=batch.return_routed_experts,
            routed_experts_start=batch.routed_experts_start,
            scheduler_abort=abort,
        )
        for j in range(i * n, (i + 1) * n)
    ]


def _check_prompt(prompt: list[int] | None, sp: JSON, config: MockServerConfig) -> list[int]:
    """The tokenizer manager's `_validate_one_request`."""
    if prompt is None:
        raise Rejected(SKIP_TOKENIZER_TEXT)
    length = len(prompt)
    if length == 0:
        raise Rejected("input_ids cannot be empty.")
    ctx = config.max_model_len
    if length >= ctx:
        raise Rejected(
            f"The input ({length} tokens) is longer than the model's context length ({ctx} tokens)."
        )
    explicit_max = sp.get("max_new_tokens")
    if is_int(explicit_max) and explicit_max + length > ctx:
        raise Rejected(
            "Requested token count exceeds the model's maximum context length "
            f"of {ctx} tokens. You requested a total of {explicit_max + length} "
            f"tokens: {length} tokens from the input messages and "
            f"{explicit_max} tokens for the completion. Please reduce the number "
            "of tokens in the input messages or the completion to fit within the limit."
        )
    if any(t >= config.vocab_size for t in prompt):
        raise Rejected(
            f"The input_ids {prompt} contains values greater than the vocab size "
            f"({config.vocab_size})."
        )
    if any(t < 0 for t in prompt):
        raise Rejected(f"The input_ids {prompt} contains negative values.")
    return prompt


def _check_logprob_params(start: Any, k: Any, ids: list[int] | None, vocab_size: int) -> None:
    if not is_int(start) or start < -1:
        raise Rejected(f"logprob_start_len must be -1 or at least 0, got {start!r}.")
    if not is_int(k) or k < 0:
        raise Rejected(f"top_logprobs_num must be at least 0, got {k!r}.")
    for token_id in ids or ():
        if not 0 <= token_id < vocab_size:
            raise Rejected(
                f"token_ids_logprob contains out-of-vocabulary token id {token_id}; "
                f"valid range is [0, {vocab_size})."
            )


def _scheduler_check(batch: _Batch, i: int, length: int, grammar: str | None) -> str | None:
    """The scheduler's own checks of prompt `i`: a failure aborts it with status 400."""
    start = batch.logprob_start_len[i]
    if batch.return_logprob[i] and start != -1 and start >= length:
        return (
            f"req.logprob_start_len={start} is higher than the number of input tokens "
            f"len(req.origin_input_ids)={length}. Please use a smaller logprob_start_len."
        )
    if batch.return_routed_experts and batch.routed_experts_start > length:
        start = batch.routed_experts_start
        return (
            f"routed_experts_start_len={start} is higher than the number of "
            f"input tokens {length}. Please use a smaller routed_experts_start_len."
        )
    if grammar is not None:
        return f"The mock SGLang server cannot do guided decoding ({grammar})."
    return None

"""A /generate body becomes validated `Item`s, one per prompt and parallel sample.

`GenerateReqInput.normalize_batch_and_arguments` (one prompt or a batch, `n` parallel
samples, rids, per-prompt logprob parameters) plus the tokenizer manager's and the
scheduler's per-request checks. Every refusal is a `Rejected` (400 `{"error"}`), except
the scheduler's own checks, which become an abort the request finishes with
(`Item.scheduler_abort`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from genmesh.testkit.common import MockServerConfig
from genmesh.testkit.sglang.request import JSON, Rejected, is_int
from genmesh.testkit.sglang.sampling import parse_sampling

SKIP_TOKENIZER_TEXT = (
    "The engine initialized with skip_tokenizer_init=True cannot accept text prompts. "
    "Please provide input_ids or re-initialize the engine with skip_tokenizer_init=False."
)


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
        raise Rejected(f"{name} should be a scalar for a single request.")
    if n > 1:
        raise Rejected(f"Cannot use list {name} with parallel_sample_num > 1")
    if len(value) != batch:
        raise Rejected(f"The length of {name} should be equal to the batch size.")
    return value


def normalize(body: JSON, config: MockServerConfig) -> tuple[list[Item], bool]:
    """`GenerateReqInput.normalize_batch_and_arguments` plus the tokenizer manager's and
    the scheduler's per-request checks. Returns the items and whether it is one request."""
    text = body.get("text")
    input_ids = body.get("input_ids")
    if text is None and input_ids is None and body.get("input_embeds") is None:
        raise Rejected("Either text, input_ids or input_embeds should be provided.")
    prompts: list[list[int] | None]
    if text is not None:  # batch detection looks at text first
        single = isinstance(text, str)
        batch = 1 if single else len(text)
        if input_ids is not None:
            if len(input_ids) == 0:
                raise Rejected("input_ids cannot be empty.")
            prompts = [input_ids] if is_int(input_ids[0]) else list(input_ids)
            if len(prompts) != batch:
                raise Rejected("The length of input_ids should be equal to the batch size.")
        else:
            prompts = [None] * batch
    elif input_ids is not None:
        if len(input_ids) == 0:
            raise Rejected("input_ids cannot be empty.")
        single = is_int(input_ids[0])
        prompts = [input_ids] if single else list(input_ids)
        batch = len(prompts)
    else:
        raise Rejected(
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
                raise Rejected(
                    "The parallel_sample_num should be the same for all samples in sample params."
                )
    n = 1 if n is None else n
    if not is_int(n) or n < 1:
        raise Rejected(f"n must be a positive integer, got {n!r}.")
    if n > 1:
        single = False
    if isinstance(sp_raw, list) and len(sp_raw) != batch:
        raise Rejected("The length of sampling_params should be equal to the batch size.")
    sps: list[JSON] = list(sp_raw) if isinstance(sp_raw, list) else [sp_raw or {}] * batch

    # rids: a string on a batch gets "_{i}" suffixes; n > 1 regenerates all of them.
    num = batch * n
    rid = body.get("rid")
    rids: list[str]
    if single:
        if isinstance(rid, list):
            raise Rejected("The rid should be a string for a single request.")
        rids = [rid if rid is not None else uuid.uuid4().hex]
    elif rid is None or n > 1:
        if isinstance(rid, list) and len(rid) != batch:
            raise Rejected(
                "The specified rids length mismatch with the batch_size for batch processing."
            )
        rids = [uuid.uuid4().hex for _ in range(num)]
    elif isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(num)]
    else:
        if len(rid) != batch:
            raise Rejected(
                "The specified rids length mismatch with the batch_size for batch processing."
            )
        rids = list(rid)
        duplicates = sorted({r for r in rids if rids.count(r) > 1})
        if duplicates:
            raise Rejected(f"Duplicate request IDs detected within the request: {duplicates}")

    def per_item(name: str, default: Any) -> list[Any]:
        return _per_item(body, name, default, single=single, batch=batch, n=n)

    return_logprob = per_item("return_logprob", False)
    logprob_start_len = per_item("logprob_start_len", -1)
    top_logprobs_num = per_item("top_logprobs_num", 0)
    tids = body.get("token_ids_logprob")
    token_ids: list[list[int] | None]
    if not tids:
        token_ids = [None] * batch
    elif is_int(tids):
        token_ids = [[tids]] * batch
    elif is_int(tids[0]):
        token_ids = [list(tids)] * batch
    elif single or n > 1:
        raise Rejected("Cannot use list token_ids_logprob with parallel_sample_num > 1")
    elif len(tids) != batch:
        raise Rejected("The length of token_ids_logprob should be equal to the batch size.")
    else:
        token_ids = list(tids)

    routed = bool(body.get("return_routed_experts", False))
    routed_start = body.get("routed_experts_start_len", 0)
    if routed_start < 0:
        raise Rejected(
            f"routed_experts_start_len must be in [0, prompt_tokens], got {routed_start}."
        )
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
    session = body.get("session_params")
    session_abort = None
    if session and session.get("id") is not None:
        session_abort = f"Invalid request: session id {session['id']} does not exist"

    ctx = config.max_model_len
    items: list[Item] = []
    for i in range(batch):
        prompt = prompts[i]
        if prompt is None:
            raise Rejected(SKIP_TOKENIZER_TEXT)
        length = len(prompt)
        if length == 0:
            raise Rejected("input_ids cannot be empty.")
        # _validate_one_request
        if length >= ctx:
            raise Rejected(
                f"The input ({length} tokens) is longer than the model's context length "
                f"({ctx} tokens)."
            )
        sp = sps[i]
        explicit_max = sp.get("max_new_tokens")
        if is_int(explicit_max) and explicit_max + length >= ctx:
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
        sampling = parse_sampling(sp, config.vocab_size)
        want_lp = bool(return_logprob[i])
        start = logprob_start_len[i]
        k = top_logprobs_num[i]
        if not is_int(start) or start < -1:
            raise Rejected(f"logprob_start_len must be -1 or at least 0, got {start!r}.")
        if not is_int(k) or k < 0:
            raise Rejected(f"top_logprobs_num must be at least 0, got {k!r}.")
        ids = token_ids[i]
        if ids is not None and any(not 0 <= t < config.vocab_size for t in ids):
            raise Rejected(
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
                Item(
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

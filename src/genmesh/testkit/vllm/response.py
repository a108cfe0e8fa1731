"""What the mock vLLM server puts on the wire: JSON bodies, SSE events, error replies.

A streaming reply ("new" profile) is SSE deltas with one choice per event, the terminal
chunk always sent (also for an abort without new tokens), a usage chunk
`{"request_id", "choices": [], "usage"}` when `stream_options` asks for it, `usage` on
every chunk with `continuous_usage_stats`, then `data: [DONE]`. A unary reply is one JSON
body with every choice; its fields differ by profile. Logprobs are rendered per profile:
integer token ids and ranks ("new"), or the `"token_id:N"` placeholder strings of
tokens-only servers ("old"). Errors carry vLLM's envelope (`errors`); what FastAPI's
HTTPException handler answers carries the reason phrase as `type` instead.
"""

from __future__ import annotations

import json
import time
from http import HTTPStatus
from typing import Any

from aiohttp import web

from genmesh.engines.mock import TokenModel, advance, initial_state
from genmesh.testkit.vllm.decode import Sample, Step
from genmesh.testkit.vllm.errors import ApiError, error_body
from genmesh.testkit.vllm.request import GenerateOptions

MIN_LOGPROB = -9999.0

JSON = dict[str, Any]


def dumps(obj: Any) -> str:
    # Starlette's JSONResponse rendering (and pydantic's model_dump_json): compact.
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(text=dumps(obj), status=status, content_type="application/json")


def error_response(error: ApiError) -> web.Response:
    return json_response(error.body(), error.status)


def sse_error(error: ApiError) -> bytes:
    """A refusal once the stream has started: an in-band error event, then `[DONE]`."""
    return f"data: {dumps(error.body())}\n\ndata: [DONE]\n\n".encode()


def http_exception(status: int, detail: str) -> web.Response:
    """What vLLM's HTTPException handler answers: the envelope, `type` = reason phrase."""
    body = error_body(detail, status)
    body["error"]["type"] = HTTPStatus(status).phrase
    return json_response(body, status)


# -------------------------------------------------------------------------- logprobs


def clamp(logprob: float) -> float:
    return max(float(logprob), MIN_LOGPROB)


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


# ---------------------------------------------------------------------- chunks, bodies


def usage_counts(prompt: int, completion: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion}  # fmt: skip


def chunk(options: GenerateOptions, profile: str, sample: Sample, step: Step | None) -> JSON:
    """One SSE event: a delta of one choice (`step` None = the abort terminal)."""
    requested = options.sampling.logprobs
    logprobs = None
    if requested is not None:
        content = [] if step is None else [logprob_content(step, requested or 0, profile)]
        logprobs = {"content": content}
    counts = None
    if options.continuous_usage:
        counts = {
            **usage_counts(len(options.prompt), len(sample.tokens)),
            "prompt_tokens_details": None,
        }
    return {
        "request_id": options.engine_id,
        "usage": counts,
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


def usage_chunk(options: GenerateOptions, counts: dict[str, Any]) -> JSON:
    """The last event before `[DONE]` when `stream_options` asks for usage."""
    return {
        "request_id": options.engine_id,
        "usage": counts,
        "output_mode": "tokens",
        "choices": [],
    }


def unary_body(
    options: GenerateOptions,
    profile: str,
    *,
    model: str,
    samples: list[Sample],
    counts: dict[str, Any],
    prompt_lps: list[JSON | None] | None,
    kv_transfer_params: JSON | None,
) -> JSON:
    """The unary reply: every choice at once."""
    out: JSON = {
        "request_id": options.engine_id,
        "model": model,
        "created": int(time.time()),
        "usage": {**counts, "prompt_tokens_details": counts.get("prompt_tokens_details")},
        "prompt_logprobs": prompt_lps,
    }
    if profile == "new":
        out.update(prompt_token_id_logprobs=None, prompt_token_ids=None,
                   mm_placeholders=None, metrics=None)  # fmt: skip
    out["kv_transfer_params"] = kv_transfer_params
    if profile == "new":
        out.update(ec_transfer_params=None, output_mode="tokens")
    out["choices"] = [_choice(sample, options.sampling.logprobs, profile) for sample in samples]
    return out


def _choice(sample: Sample, requested: int | None, profile: str) -> JSON:
    logprobs = None
    if requested is not None:
        logprobs = {"content": [logprob_content(s, requested or 0, profile) for s in sample.steps]}
    finish = sample.finish_reason or "stop"  # a null finish is reported as "stop"
    if profile == "new":
        return {
            "index": sample.index,
            "finish_reason": finish,
            "token_ids": list(sample.tokens),
            "routed_experts": None,
            "sampling_mask": None,
            "weight_versions": None,
            "logprobs": logprobs,
            "stop_reason": sample.stop_reason,
        }
    return {
        "index": sample.index,
        "logprobs": logprobs,
        "finish_reason": finish,
        "token_ids": list(sample.tokens),
        "stop_reason": sample.stop_reason,
    }

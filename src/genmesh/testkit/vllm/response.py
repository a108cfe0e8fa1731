"""What the mock vLLM server puts on the wire: its error envelope, JSON, logprobs.

Errors are vLLM's `ErrorResponse`, `{"error": {"message", "type", "param", "code"}}`,
with `type` named after the status (`BadRequestError`, `NotFoundError`, ...); what
FastAPI's HTTPException handler answers carries the reason phrase as `type` instead.
Logprobs are rendered per profile: integer token ids and ranks ("new"), or the
`"token_id:N"` placeholder strings of tokens-only servers ("old").
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from aiohttp import web

from genmesh.engines.mock import TokenModel, advance, initial_state
from genmesh.testkit.vllm.decode import Step

MIN_LOGPROB = -9999.0

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
        return json_response(self.body(), self.status)


def type_error(loc: str, expected: str, value: Any) -> ApiError:
    """pydantic's wording, roughly: "<loc>: Input should be a valid <type>"."""
    return ApiError(f"1 validation error for GenerateRequest\n{loc}\n  Input should be a valid "
                    f"{expected} [input_value={value!r:.60}]")  # fmt: skip


def dumps(obj: Any) -> str:
    # Starlette's JSONResponse rendering (and pydantic's model_dump_json): compact.
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(text=dumps(obj), status=status, content_type="application/json")


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

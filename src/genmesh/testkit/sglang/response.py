"""What the mock SGLang server puts on the wire: output objects, SSE events, error bodies.

An output object is what SGLang's tokenizer manager builds from the scheduler's
`BatchTokenIDOutput`: `output_ids` and `meta_info` (finish reason, token counts, logprobs
as `[logprob, token_id, None]` triples, routed experts), with the whole output so far in
cumulative streaming and only what is new in incremental streaming.

Errors: besides `{"error": ...}` and `{"object": "error", ...}` (see `request`), an
injected HTTP error answers with the body SGLang sends for its status, and the scheduler
finishes a request it aborts with `FINISH_ABORT`'s reason object.
"""

from __future__ import annotations

import base64
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from genmesh.engines.faults import Fault
from genmesh.testkit.sglang.normalize import Item
from genmesh.testkit.sglang.request import JSON, Malformed

WEIGHT_VERSION = "default"
WAITING_ABORT = "Abort in waiting queue"
DONE = b"data: [DONE]\n\n"


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=dumps(obj), status=status, content_type="application/json")


def error_response(message: str, status: int = 400) -> web.Response:
    """`_create_error_response`: what a ValueError becomes on a non-streaming request."""
    return json_response({"error": {"message": message}}, status)


def http_exception(status: int, message: str) -> web.Response:
    """FastAPI's HTTPException handler in SGLang's http_server (`ErrorResponse`)."""
    body = {"object": "error", "message": message, "type": str(status), "param": None}
    return json_response({**body, "code": status}, status)


def malformed_response(exc: Malformed) -> web.Response:
    body = {"object": "error", "message": exc.message, "type": "Bad Request", "param": None}
    return json_response({**body, "code": 400}, 400)


def fault_response(fault: Fault) -> web.Response:
    """An injected HTTP error with the body SGLang sends for that status."""
    if 400 <= fault.status < 500:
        return error_response(fault.message, fault.status)
    return http_exception(fault.status, fault.message)


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


def abort_reason(message: str, status: int | None) -> JSON:
    """`FINISH_ABORT(message, status_code, err_type).to_json()`."""
    err_type = "BadRequestError" if status == 400 else None
    return {"type": "abort", "message": message, "status_code": status, "err_type": err_type}


# ---------------------------------------------------------------- output objects

LogprobEntry = list[Any]  # [logprob | None, token_id, None]


def triple(logprob: float | None, token: int) -> LogprobEntry:
    return [logprob, token, None]


@dataclass(slots=True)
class Transcript:
    """What a generation has produced so far, as its output objects report it."""

    output_ids: list[int] = field(default_factory=list)
    out_lps: list[LogprobEntry] = field(default_factory=list)
    out_tops: list[list[LogprobEntry] | None] = field(default_factory=list)
    out_tids: list[list[LogprobEntry] | None] = field(default_factory=list)
    in_lps: list[LogprobEntry] = field(default_factory=list)
    in_tops: list[list[LogprobEntry] | None] = field(default_factory=list)
    in_tids: list[list[LogprobEntry] | None] = field(default_factory=list)
    # Routed-expert rows, one per position from `routed_experts_start` on.
    rows: list[list[int]] = field(default_factory=list)
    # Prompt tokens found in the prefix cache.
    cached_tokens: int = 0


def output(
    item: Item, record: Transcript, finish: JSON | None, *, offset: int, created: float
) -> JSON:
    """An output object as the tokenizer manager builds it (BatchTokenIDOutput), with the
    output tokens from `offset` on."""
    meta: JSON = {
        "id": item.rid,
        "finish_reason": finish,
        "prompt_tokens": len(item.prompt),
        "weight_version": WEIGHT_VERSION,
        "num_retractions": 0,
    }
    if item.return_logprob:
        meta.update(_logprobs(item, record, offset))
    meta["reasoning_tokens"] = 0
    meta["completion_tokens"] = len(record.output_ids)
    meta["cached_tokens"] = record.cached_tokens
    if finish is not None:
        if item.return_routed_experts:
            meta["routed_experts"] = _routed_experts(item, record)
        meta["e2e_latency"] = _latency(created)
    return {"output_ids": record.output_ids[offset:], "meta_info": meta}


def _logprobs(item: Item, record: Transcript, offset: int) -> JSON:
    meta: JSON = {
        "input_token_logprobs": list(record.in_lps),
        "output_token_logprobs": record.out_lps[offset:],
        "output_token_logprobs_length": len(record.out_lps),
    }
    if item.top_logprobs_num:
        meta["input_top_logprobs"] = list(record.in_tops)
        meta["output_top_logprobs"] = record.out_tops[offset:]
    if item.token_ids_logprob is not None:
        meta["input_token_ids_logprobs"] = list(record.in_tids)
        meta["output_token_ids_logprobs"] = record.out_tids[offset:]
    return meta


def _routed_experts(item: Item, record: Transcript) -> str:
    """Rows for positions [start, seqlen - 1): the last token has had no forward pass."""
    want = max(0, len(item.prompt) + len(record.output_ids) - 1 - item.routed_experts_start)
    flat = [e for row in record.rows[:want] for e in row]
    return base64.b64encode(struct.pack(f"<{len(flat)}i", *flat)).decode("ascii")


def _latency(created: float) -> float:
    return round(time.monotonic() - created, 6)


def waiting_abort(item: Item) -> JSON:
    """The tokenizer manager's `_handle_abort_req`: a request aborted while waiting.

    Its output carries an empty `text` even under --skip-tokenizer-init."""
    meta: JSON = {"id": item.rid, "finish_reason": {"type": "abort", "message": WAITING_ABORT}}
    if item.return_logprob:
        meta.update(_logprobs(item, Transcript(), 0))
    meta["completion_tokens"] = 0
    return {"text": "", "output_ids": [], "meta_info": meta}


def scheduler_abort(item: Item, output_ids: list[int], message: str, created: float) -> JSON:
    """A request the scheduler aborted (`set_finish_with_abort`) after one forward pass."""
    return {
        "output_ids": list(output_ids),
        "meta_info": {
            "id": item.rid,
            "finish_reason": abort_reason(message, 400),
            "prompt_tokens": 1,
            "weight_version": WEIGHT_VERSION,
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": len(output_ids),
            "cached_tokens": 0,
            "e2e_latency": _latency(created),
        },
    }

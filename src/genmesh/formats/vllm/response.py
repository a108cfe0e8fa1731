"""vLLM `/inference/v1/generate` responses in the newest tokens-mode form (reference
`engine-apis.md` §B.4-§B.5).

Unary: `{request_id, choices: [{index, token_ids, logprobs, finish_reason, stop_reason,
...engine metadata}], usage, prompt_logprobs, kv_transfer_params}`. Logprobs carry integer
token ids and ranks: `{"content": [{"token_id", "logprob", "rank", "top_logprobs":
[{"token_id", "logprob", "rank"}]}]}`, where `top_logprobs` is the first k entries of
vLLM's per-position logprob map: the sampled token first, then the best alternatives
(so with greedy decoding it is exactly the top k). Logprobs are clamped to >= -9999.0.

With `return_token_ids` the unary body, and the stream's first chunk, also carry
`prompt_token_ids` (the newest builds' field), and `mm_placeholders` when the request
had multimodal `features`.

SSE (which vLLM's older builds lack): one `{request_id, choices: [one choice with deltas],
usage}` per frame; frames with no token, no finish reason and nothing else to carry are
skipped, the terminal chunk is always sent. The chunk that carries the prompt logprobs
(the first) has them at its top level, so a stream carries everything a unary body does.

Records (what merge rules fold): per item and frame
`{token_ids (delta), logprobs.content (delta), finish_reason, stop_reason (last),
usage.completion_tokens (attempt), usage.cached_tokens (prompt), prompt_logprobs (prompt),
engine (the frame's engine metadata, merged key by key, last wins)}`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from genmesh.formats.base import Exchange, Record
from genmesh.formats.merge import Rule
from genmesh.formats.vllm.request import RESPONSE_ID_PREFIX, VllmOptions, error
from genmesh.shared import frames
from genmesh.shared.envelope import TokenIds
from genmesh.shared.errors import ErrorCode, MeshError

MERGE_RULES: dict[str, Rule] = {
    "token_ids": Rule.DELTA,
    "logprobs.content": Rule.DELTA,
    "finish_reason": Rule.LAST,
    "stop_reason": Rule.LAST,
    "prompt_logprobs": Rule.PROMPT,
    "usage.completion_tokens": Rule.ATTEMPT,
    "usage.cached_tokens": Rule.PROMPT,
    # Listing a field below `engine` makes the metadata merge key by key.
    "engine.kv_transfer_params": Rule.LAST,
}

MIN_LOGPROB = -9999.0
# Engine metadata that belongs at the top level of the response, not in a choice.
TOP_LEVEL_METADATA = ("kv_transfer_params", "ec_transfer_params")
# Names the renderer owns; engine metadata never overrides them.
_RESERVED = frozenset(
    ("index", "token_ids", "logprobs", "finish_reason", "stop_reason",
     "request_id", "choices", "usage", "prompt_logprobs",
     # An SGLang engine's extras (its meta_info) mean nothing in a vLLM answer.
     "meta_info")
)  # fmt: skip

TopList = list[tuple[int, float]]


def clamp(logprob: float) -> float:
    """vLLM's clamp: no logprob below -9999.0 (so -inf becomes -9999.0)."""
    if math.isnan(logprob):
        return MIN_LOGPROB
    return max(float(logprob), MIN_LOGPROB)


def finish_reason(finish: frames.Finish | None) -> tuple[str | None, int | str | None]:
    """vLLM's (finish_reason, stop_reason) for an engine finish."""
    if finish is None:
        return None, None
    reason = finish.get("reason")
    if reason == "eos":
        return "stop", None
    if reason == "stop":
        matched = finish.get("matched")
        return "stop", matched if isinstance(matched, int | str) else None
    if reason == "length":
        return "length", None
    return "abort", None


def top_entries(
    token: int, logprob: float | None, rank: int | None, top: TopList | None, k: int
) -> list[dict[str, Any]]:
    """The first max(k, 1) entries of vLLM's logprob map at one position: the token
    itself, then the engine's best alternatives (rank = place in the engine's list).
    vLLM always lists the sampled token, so logprobs=0 still gives one entry."""
    k = max(k, 1)
    entries: list[dict[str, Any]] = []
    if logprob is not None:
        entries.append({"token_id": token, "logprob": clamp(logprob), "rank": rank})
    for place, (tid, lp) in enumerate((top or [])[:k], start=1):
        if len(entries) == k:
            break
        if tid != token:
            entries.append({"token_id": tid, "logprob": clamp(lp), "rank": place})
    return entries


def _rank_of(token: int, rank: int | None, top: TopList | None) -> int | None:
    if rank is not None:
        return rank
    for place, (tid, _) in enumerate(top or [], start=1):
        if tid == token:
            return place
    return None


def logprob_content(frame: frames.OutputFrame, tokens: list[int], k: int) -> list[dict[str, Any]]:
    """`logprobs.content` entries for the tokens of one frame."""
    lps: list[Any] = frame.get("logprobs") or []
    ranks: list[Any] = frame.get("ranks") or []
    tops: list[Any] = frame.get("top_logprobs") or []
    content = []
    for i, token in enumerate(tokens):
        lp = lps[i] if i < len(lps) else None
        top = tops[i] if i < len(tops) else None
        rank = _rank_of(token, ranks[i] if i < len(ranks) else None, top)
        content.append(
            {
                "token_id": token,
                "logprob": None if lp is None else clamp(lp),
                "rank": rank,
                "top_logprobs": top_entries(token, lp, rank, top, k),
            }
        )
    return content


def prompt_logprobs(frame: frames.OutputFrame, prompt: Sequence[int], k: int) -> list[Any]:
    """vLLM's `prompt_logprobs`: one entry per prompt position, entry 0 null; each entry
    maps the prompt token, then its top-k alternatives, to `{logprob, rank,
    decoded_token}`. Lists shorter than the prompt are aligned to its end (positions
    before them have no data: null); a one-token prompt gives `[null]`."""
    lps: list[Any] = frame.get("prompt_logprobs") or []
    ranks: list[Any] = frame.get("prompt_ranks") or []
    tops: list[Any] = frame.get("prompt_top_logprobs") or []
    offset = len(prompt) - len(lps)
    out: list[Any] = []
    for pos, token in enumerate(prompt):
        i = pos - offset
        lp = lps[i] if 0 <= i < len(lps) else None
        if pos == 0 or lp is None:
            out.append(None)
            continue
        top = tops[i] if i < len(tops) else None
        rank = _rank_of(token, ranks[i] if i < len(ranks) else None, top)
        entry = {str(token): {"logprob": clamp(lp), "rank": rank, "decoded_token": None}}
        for place, (tid, alt_lp) in enumerate((top or [])[:k], start=1):
            key = str(tid)
            if key not in entry:
                entry[key] = {"logprob": clamp(alt_lp), "rank": place, "decoded_token": None}
        out.append(entry)
    return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def choice_metadata(engine: Any) -> dict[str, Any]:
    """The engine metadata that goes into a choice (e.g. `sampling_mask`)."""
    if not isinstance(engine, dict):
        return {}
    return {k: v for k, v in engine.items() if k not in _RESERVED and k not in TOP_LEVEL_METADATA}


class _Item:
    """Rendering state of one sample."""

    __slots__ = (
        "attempts",
        "cached_tokens",
        "completion_tokens",
        "earlier_tokens",
        "prompt_rendered",
    )

    def __init__(self) -> None:
        self.completion_tokens = 0  # in this attempt (records count per attempt)
        self.earlier_tokens = 0  # in the attempts before a migration
        self.cached_tokens = 0  # the first attempt's: a property of the original prompt
        self.attempts = 1
        self.prompt_rendered = False

    @property
    def total_tokens(self) -> int:
        return self.earlier_tokens + self.completion_tokens


class VllmExchange(Exchange):
    def __init__(self, options: VllmOptions, public_id: str, prompt: TokenIds, count: int) -> None:
        self.options = options
        self.request_id = RESPONSE_ID_PREFIX + public_id
        self.prompt = prompt
        self.items = [_Item() for _ in range(count)]
        # `return_token_ids`: the stream's first chunk carries the prompt's token ids.
        self.prompt_ids_pending = options.return_token_ids

    def render(self, index: int, frame: frames.OutputFrame) -> Record:
        opts = self.options
        item = self.items[index]
        tokens = frame["tokens"]
        item.completion_tokens += len(tokens)
        finish = frame.get("finish") if frame["t"] == frames.END else None
        reason, stop_reason = finish_reason(finish)
        record: Record = {"token_ids": tokens}
        if opts.logprobs is not None:
            record["logprobs"] = {"content": logprob_content(frame, tokens, opts.logprobs)}
        record["finish_reason"] = reason
        record["stop_reason"] = stop_reason
        counts: dict[str, int] = {"completion_tokens": item.completion_tokens}
        cached = frame.get("cached_tokens")
        if not isinstance(cached, int) and frame["t"] == frames.END:
            cached = (frame.get("usage") or {}).get("cached_tokens")
        if isinstance(cached, int):
            counts["cached_tokens"] = cached
            if item.attempts == 1:
                item.cached_tokens = cached
        record["usage"] = counts
        if (
            opts.prompt_logprobs is not None
            and index == 0
            and not item.prompt_rendered
            and frame.get("prompt_logprobs") is not None
        ):
            item.prompt_rendered = True
            record["prompt_logprobs"] = prompt_logprobs(frame, self.prompt, opts.prompt_logprobs)
        engine = frame.get("engine")
        if isinstance(engine, dict) and engine:
            record["engine"] = dict(engine)
        return record

    def new_attempt(self, index: int) -> None:
        item = self.items[index]
        item.earlier_tokens += item.completion_tokens
        item.completion_tokens = 0
        item.attempts += 1

    def _usage(self, items: list[_Item]) -> dict[str, Any]:
        return usage(
            self.options.prompt_tokens,
            sum(item.total_tokens for item in items),
            items[0].cached_tokens,
        )

    def _choice(self, index: int, record: Record) -> dict[str, Any]:
        token_ids = record.get("token_ids")
        choice: dict[str, Any] = {
            "index": index,
            "token_ids": [] if token_ids is None else token_ids,
            "logprobs": None,
            "finish_reason": record.get("finish_reason"),
            "stop_reason": record.get("stop_reason"),
        }
        if self.options.logprobs is not None:
            logprobs = record.get("logprobs") or {}
            content = logprobs.get("content")
            choice["logprobs"] = {"content": [] if content is None else content}
        choice.update(choice_metadata(record.get("engine")))
        return choice

    def sse(self, index: int, record: Record) -> list[Any]:
        item = self.items[index]
        engine = record.get("engine")
        tokens = record.get("token_ids")
        # (A client codec may have encoded the token ids: then the chunk is sent.)
        empty = tokens is None or len(tokens) == 0
        carries = "prompt_logprobs" in record or bool(engine)
        if empty and record.get("finish_reason") is None and not carries:
            return []
        chunk: dict[str, Any] = {
            "request_id": self.request_id,
            "choices": [self._choice(index, record)],
            "usage": self._usage([item]) if self.options.continuous_usage else None,
        }
        if "prompt_logprobs" in record:
            chunk["prompt_logprobs"] = record["prompt_logprobs"]
        if self.prompt_ids_pending:
            self.prompt_ids_pending = False
            chunk["prompt_token_ids"] = self.prompt.tolist()
            if self.options.mm_placeholders is not None:
                chunk["mm_placeholders"] = self.options.mm_placeholders
        if isinstance(engine, dict):
            for key in TOP_LEVEL_METADATA:
                if engine.get(key) is not None:
                    chunk[key] = engine[key]
        return [chunk]

    def sse_end(self) -> list[Any]:
        if not self.options.include_usage:
            return []
        return [{"request_id": self.request_id, "choices": [], "usage": self._usage(self.items)}]

    def body(self, items: list[Record]) -> Any:
        completion = 0
        for record in items:
            counted = (record.get("usage") or {}).get("completion_tokens")
            completion += counted if isinstance(counted, int) else 0
        cached = (items[0].get("usage") or {}).get("cached_tokens")
        out: dict[str, Any] = {
            "request_id": self.request_id,
            "choices": [self._choice(i, record) for i, record in enumerate(items)],
            "usage": usage(
                self.options.prompt_tokens, completion, cached if isinstance(cached, int) else 0
            ),
            "prompt_logprobs": items[0].get("prompt_logprobs")
            if self.options.prompt_logprobs is not None
            else None,
            "kv_transfer_params": None,
        }
        if self.options.return_token_ids:
            out["prompt_token_ids"] = self.prompt.tolist()
            if self.options.mm_placeholders is not None:
                out["mm_placeholders"] = self.options.mm_placeholders
        for key in TOP_LEVEL_METADATA:
            for record in items:
                engine = record.get("engine")
                if isinstance(engine, dict) and engine.get(key) is not None:
                    out[key] = engine[key]
                    break
        return out

    def error(self, err: MeshError, status: int) -> Any:
        if err.code is ErrorCode.NOT_FOUND and self.options.model is not None:
            # vLLM's own wording for a model it does not serve.
            return error(f"The model `{self.options.model}` does not exist.", status, "model")
        return error(err.message, status)

"""SGLang `/generate` responses, as a server started with `--skip-tokenizer-init` and
`--incremental-streaming-output` sends them (reference `engine-apis.md` §A.4-A.5): no
`text`; each chunk's `output_ids` and output logprob lists are deltas; `completion_tokens`
is a running total; `input_token_logprobs` is repeated in full on every chunk.
"""

from __future__ import annotations

import time
from typing import Any

from genmesh.formats.base import Exchange
from genmesh.formats.merge import Rule
from genmesh.formats.sglang.request import SglangOptions, error
from genmesh.shared import frames
from genmesh.shared.errors import MeshError

MERGE_RULES: dict[str, Rule] = {
    "output_ids": Rule.DELTA,
    "meta_info.id": Rule.LAST,
    "meta_info.finish_reason": Rule.LAST,
    "meta_info.prompt_tokens": Rule.PROMPT,
    "meta_info.completion_tokens": Rule.ATTEMPT,
    "meta_info.cached_tokens": Rule.PROMPT,
    "meta_info.e2e_latency": Rule.LAST,
    "meta_info.input_token_logprobs": Rule.PROMPT,
    "meta_info.input_top_logprobs": Rule.PROMPT,
    "meta_info.output_token_logprobs": Rule.DELTA,
    "meta_info.output_top_logprobs": Rule.DELTA,
}


def native_finish_reason(finish: dict[str, Any], max_new_tokens: int | None) -> dict[str, Any]:
    reason = finish.get("reason")
    if reason in ("eos", "stop"):
        return {"type": "stop", "matched": finish.get("matched")}
    if reason == "length":
        return {"type": "length", "length": max_new_tokens}
    return {
        "type": "abort",
        "message": finish.get("message") or "Aborted",
        "status_code": finish.get("status_code"),
        "err_type": finish.get("err_type"),
    }


def _triples(logprobs: list[Any], tokens: list[int]) -> list[list[Any]]:
    return [[lp, tid, None] for lp, tid in zip(logprobs, tokens, strict=True)]


def _top_triples(tops: list[Any]) -> list[Any]:
    return [None if top is None else [[lp, tid, None] for tid, lp in top] for top in tops]


class SglangExchange(Exchange):
    def __init__(
        self, options: SglangOptions, public_id: str, prompt: list[int], received_at: float
    ) -> None:
        self.options = options
        self.public_id = public_id
        self.prompt = prompt
        self.received_at = received_at
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.input_logprobs: list[Any] = []
        self.input_top_logprobs: list[Any] = []

    def render(self, frame: frames.Frame) -> list[Any]:
        tokens: list[int] = frame.get("tokens") or []
        self.completion_tokens += len(tokens)
        cached = frame.get("cached_tokens")
        if isinstance(cached, int):
            self.cached_tokens = cached
        finish = frame.get("finish") if frame["t"] == frames.END else None
        opts = self.options
        meta: dict[str, Any] = {
            "id": self.public_id,
            "finish_reason": None
            if finish is None
            else native_finish_reason(finish, opts.max_new_tokens),
            "prompt_tokens": opts.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
        }
        if opts.return_logprob:
            self._note_prompt_logprobs(frame)
            meta["input_token_logprobs"] = self.input_logprobs
            meta["output_token_logprobs"] = _triples(frame.get("logprobs") or [], tokens)
            if opts.top_logprobs_num > 0:
                meta["input_top_logprobs"] = self.input_top_logprobs
                meta["output_top_logprobs"] = _top_triples(frame.get("top_logprobs") or [])
        if finish is not None:
            meta["e2e_latency"] = round(time.monotonic() - self.received_at, 6)
        return [{"output_ids": tokens, "meta_info": meta}]

    def _note_prompt_logprobs(self, frame: frames.Frame) -> None:
        prompt_lps = frame.get("prompt_logprobs")
        if prompt_lps is None or self.input_logprobs:
            return
        start = len(self.prompt) - len(prompt_lps)
        self.input_logprobs = _triples(prompt_lps, self.prompt[start:])
        tops = frame.get("prompt_top_logprobs")
        if tops is not None:
            self.input_top_logprobs = _top_triples(tops)

    def error(self, err: MeshError, status: int) -> Any:
        return error(err.message)

"""SGLang `/generate` responses, as a server started with `--skip-tokenizer-init` and
`--incremental-streaming-output` sends them (reference `engine-apis.md` §A.4-A.5): no
`text`; each chunk's `output_ids` and output logprob lists are deltas; `completion_tokens`
is a running total; `input_token_logprobs` is repeated in full on every chunk.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Sequence
from typing import Any

from genmesh.codecs.int32 import to_le_bytes
from genmesh.formats.base import Exchange, Record
from genmesh.formats.merge import Rule
from genmesh.formats.sglang.errors import error
from genmesh.formats.sglang.request import ItemOptions, SglangOptions
from genmesh.shared import frames
from genmesh.shared.envelope import TokenIds
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
    "meta_info.output_token_logprobs_length": Rule.ATTEMPT,
    "meta_info.output_top_logprobs": Rule.DELTA,
    "meta_info.input_token_ids_logprobs": Rule.PROMPT,
    "meta_info.output_token_ids_logprobs": Rule.DELTA,
    "meta_info.routed_experts": Rule.DELTA,
    "prompt_token_ids": Rule.PROMPT,
}


def pack_int32(values: list[int]) -> bytes:
    """Little-endian int32, SGLang's layout for routed experts."""
    return to_le_bytes(values)


def join_base64(pieces: list[Any]) -> str:
    """Base64 pieces of one byte sequence join by decode-concatenate-encode."""
    return base64.b64encode(b"".join(base64.b64decode(p) for p in pieces)).decode()


JOINERS = {"meta_info.routed_experts": join_base64}


def native_finish_reason(finish: frames.Finish, max_new_tokens: int | None) -> dict[str, Any]:
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


def _triples(logprobs: list[Any], tokens: Sequence[int]) -> list[list[Any]]:
    return [[lp, tid, None] for lp, tid in zip(logprobs, tokens, strict=True)]


def _top_triples(tops: list[Any]) -> list[Any]:
    return [None if top is None else [[lp, tid, None] for tid, lp in top] for top in tops]


class _Item:
    """Rendering state of one generation."""

    __slots__ = (
        "cached_tokens",
        "completion_tokens",
        "input_logprobs",
        "input_token_ids_logprobs",
        "input_top_logprobs",
        "opts",
        "prompt",
        "prompt_list",
        "public_id",
    )

    def __init__(self, opts: ItemOptions, public_id: str, prompt: TokenIds) -> None:
        self.opts = opts
        self.public_id = public_id
        self.prompt = prompt
        # The prompt as a list, made once, and only when a record echoes it.
        self.prompt_list: list[int] | None = None
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.input_logprobs: list[Any] = []
        self.input_top_logprobs: list[Any] = []
        self.input_token_ids_logprobs: list[Any] = []


class SglangExchange(Exchange):
    def __init__(
        self, options: SglangOptions, public_id: str, prompts: list[TokenIds], received_at: float
    ) -> None:
        self.multi = options.multi
        self.received_at = received_at
        self.items = [
            _Item(opts, opts.public_id or public_id, prompt)
            for opts, prompt in zip(options.items, prompts, strict=True)
        ]

    def render(self, index: int, frame: frames.OutputFrame) -> Record:
        item = self.items[index]
        opts = item.opts
        tokens = frame["tokens"]
        item.completion_tokens += len(tokens)
        cached = frame.get("cached_tokens")
        if isinstance(cached, int):
            item.cached_tokens = cached
        finish = frame.get("finish") if frame["t"] == frames.END else None
        meta: dict[str, Any] = {
            "id": item.public_id,
            "finish_reason": None
            if finish is None
            # Uncapped (null max_new_tokens): the engine's own limit is what was generated.
            else native_finish_reason(finish, opts.max_new_tokens or item.completion_tokens),
            "prompt_tokens": opts.prompt_tokens,
            "completion_tokens": item.completion_tokens,
            "cached_tokens": item.cached_tokens,
        }
        if opts.return_logprob:
            self._note_prompt_logprobs(item, frame)
            meta["input_token_logprobs"] = item.input_logprobs
            meta["output_token_logprobs"] = _triples(frame.get("logprobs") or [], tokens)
            # Newest SGLang: the length of the whole output logprob list so far (a running
            # total even when the list itself streams as deltas).
            meta["output_token_logprobs_length"] = item.completion_tokens
            if opts.top_logprobs_num > 0:
                meta["input_top_logprobs"] = item.input_top_logprobs
                meta["output_top_logprobs"] = _top_triples(frame.get("top_logprobs") or [])
            if opts.token_ids_logprob:
                meta["input_token_ids_logprobs"] = item.input_token_ids_logprobs
                meta["output_token_ids_logprobs"] = _top_triples(
                    frame.get("token_ids_logprobs") or []
                )
        if opts.return_routed_experts:
            rows = frame.get("routed_experts") or []
            flat = [expert for row in rows for expert in row]
            meta["routed_experts"] = base64.b64encode(pack_int32(flat)).decode()
        extras = (frame.get("engine") or {}).get("meta_info")
        if isinstance(extras, dict):
            # What a real SGLang engine adds (weight_version, spec stats, ...) passes
            # through; the fields above are the mesh's and are never overridden.
            for key, value in extras.items():
                meta.setdefault(key, value)
        if finish is not None:
            meta["e2e_latency"] = round(time.monotonic() - self.received_at, 6)
        record: Record = {"output_ids": tokens, "meta_info": meta}
        if opts.return_prompt_token_ids:
            # SGLang adds the prompt to every output of such a request.
            if item.prompt_list is None:
                item.prompt_list = item.prompt.tolist()
            record["prompt_token_ids"] = item.prompt_list
        return record

    def new_attempt(self, index: int) -> None:
        self.items[index].completion_tokens = 0

    @staticmethod
    def _note_prompt_logprobs(item: _Item, frame: frames.OutputFrame) -> None:
        prompt_lps = frame.get("prompt_logprobs")
        if prompt_lps is None or item.input_logprobs:
            return
        start = len(item.prompt) - len(prompt_lps)
        item.input_logprobs = _triples(prompt_lps, item.prompt[start:])
        tops = frame.get("prompt_top_logprobs")
        if tops is not None:
            item.input_top_logprobs = _top_triples(tops)
        listed = frame.get("prompt_token_ids_logprobs")
        if listed is not None:
            item.input_token_ids_logprobs = _top_triples(listed)

    def sse(self, index: int, record: Record) -> list[Any]:
        # Batch and n > 1 streams interleave; each chunk says which item it belongs to.
        return [{**record, "index": index}] if self.multi else [record]

    def body(self, items: list[Record]) -> Any:
        return items if self.multi else items[0]

    def error(self, err: MeshError, status: int) -> Any:
        return error(err.message, status)

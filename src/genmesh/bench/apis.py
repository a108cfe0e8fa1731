"""What the bench knows of each native API: its route, the body it sends, and how the
answers count output tokens.

The routes are the formats' own (`genmesh.formats`); the bodies ask for exactly the output
length given (`ignore_eos`, as both engines allow). Counting reads only the fields that
carry the count, once per SSE event or unary body:

- SGLang: `meta_info.completion_tokens` is the running total in both of SGLang's
  streaming modes (its tokenizer manager sets it per chunk:
  sglang python/sglang/srt/managers/tokenizer_manager.py `_handle_batch_output`), whereas
  `output_ids` is the whole output so far by default and only the new tokens with
  `--incremental-streaming-output`; so an event's tokens are the total's growth. A server
  that sends no `meta_info` gets its `output_ids` counted as new tokens.
- vLLM: each chunk's `choices[i].token_ids` holds only the new tokens (the tokens route
  streams deltas: vllm vllm/entrypoints/serve/disagg/serving.py `serve_tokens`).

A failure inside a 200 answer is its kind: `error` (an `{"error": ...}` event or body, both
engines' shape) or `abort` (SGLang's `finish_reason.type == "abort"`, vLLM's
`finish_reason == "abort"`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import orjson

from genmesh.formats.sglang import SglangFormat
from genmesh.formats.vllm import VllmFormat


class Failed(Exception):
    """A 200 answer that reports a failure; its message is the failure's kind."""


class EventCounter(ABC):
    """Output tokens per SSE event, for one request."""

    @abstractmethod
    def count(self, event: Any) -> int:
        """New output tokens in `event`; Failed if it reports a failure."""


class Api(ABC):
    """One native API."""

    name: str
    path: str
    prompt_field: str
    budget_field: str

    def body(self, prompt: list[int], output_len: int, stream: bool, model: str | None) -> bytes:
        body: dict[str, Any] = {} if model is None else {"model": model}
        body[self.prompt_field] = prompt
        body["sampling_params"] = {self.budget_field: output_len, "ignore_eos": True}
        body["stream"] = stream
        return orjson.dumps(body)

    @abstractmethod
    def counter(self) -> EventCounter:
        """A fresh count for one request's stream."""

    @abstractmethod
    def count_body(self, body: Any) -> int:
        """Output tokens of a unary answer; Failed if it reports a failure."""


def _check(answer: dict[str, Any], aborted: bool) -> None:
    if "error" in answer:
        raise Failed("error")
    if aborted:
        raise Failed("abort")


def _sglang_count(answer: Any) -> tuple[int, bool]:
    """(tokens, whether that is the running total) of one SGLang answer or event."""
    if not isinstance(answer, dict):
        raise Failed("malformed")
    meta = answer.get("meta_info")
    meta = meta if isinstance(meta, dict) else {}
    finish = meta.get("finish_reason")
    _check(answer, isinstance(finish, dict) and finish.get("type") == "abort")
    total = meta.get("completion_tokens")
    if isinstance(total, int):
        return total, True
    return len(answer.get("output_ids") or ()), False


class _SglangCounter(EventCounter):
    def __init__(self) -> None:
        self.total = 0

    def count(self, event: Any) -> int:
        tokens, running = _sglang_count(event)
        new = tokens - self.total if running else tokens
        self.total += new
        return new


class SglangApi(Api):
    name = "sglang"
    path = SglangFormat.default_routes()[0].path
    prompt_field = "input_ids"
    budget_field = "max_new_tokens"

    def counter(self) -> EventCounter:
        return _SglangCounter()

    def count_body(self, body: Any) -> int:
        return _sglang_count(body)[0]


def _vllm_tokens(answer: Any) -> int:
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list):
        if isinstance(answer, dict) and "error" in answer:
            raise Failed("error")
        raise Failed("malformed")
    _check(answer, any(c.get("finish_reason") == "abort" for c in choices))
    return sum(len(c.get("token_ids") or ()) for c in choices)


class _VllmCounter(EventCounter):
    def count(self, event: Any) -> int:
        return _vllm_tokens(event)


class VllmApi(Api):
    name = "vllm"
    path = VllmFormat.default_routes()[0].path
    prompt_field = "token_ids"
    budget_field = "max_tokens"

    def counter(self) -> EventCounter:
        return _VllmCounter()

    def count_body(self, body: Any) -> int:
        return _vllm_tokens(body)


APIS: dict[str, Api] = {"sglang": SglangApi(), "vllm": VllmApi()}

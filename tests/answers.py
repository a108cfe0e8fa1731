"""Requests to a frontend and what their answers say, for tests that compare two runs of
the same request (migration's law, P/D's differential test): one HTTP call (`call`), its
answer in a form equal for equal answers (`content`), where two differ (`differences`), and
random requests of both formats (`cases`)."""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from hypothesis import strategies as st

from tests.inproc import AnyMesh

PATHS = {"sglang": "/generate", "vllm": "/inference/v1/generate"}

# ---------------------------------------------------------------- HTTP


@dataclass
class Result:
    status: int
    body: Any = None  # unary (or an error answered before the stream started)
    events: list[Any] | None = None  # SSE `data:` payloads, "[DONE]" kept as the string


OnEvent = Callable[[int, Any], Awaitable[None]]


async def call(
    mesh: AnyMesh, fmt: str, body: dict[str, Any], stream: bool, on_event: OnEvent | None = None
) -> Result:
    """One request to the frontend; `on_event(n, payload)` runs after the nth SSE event."""
    timeout = aiohttp.ClientTimeout(total=60)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(mesh.http_url + PATHS[fmt], json={**body, "stream": stream}) as resp,
    ):
        if resp.content_type != "text/event-stream":
            return Result(resp.status, json.loads(await resp.text()))
        events: list[Any] = []
        async for raw in resp.content:
            line = raw.rstrip(b"\r\n")
            if not line.startswith(b"data: "):
                continue
            payload = line[len(b"data: ") :]
            events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
            if on_event is not None:
                await on_event(len(events), events[-1])
        return Result(resp.status, events=events)


def content(fmt: str, body: dict[str, Any], result: Result) -> dict[str, Any]:
    """What a response says, in a form equal for equal answers: the unary body, or what
    the SSE stream adds up to. Fields that legitimately differ between runs
    (`e2e_latency`) are left out; checks every stream's own invariants on the way."""
    assert result.status == 200, (result.status, result.body, result.events)
    if result.events is None:
        out = json.loads(json.dumps(result.body))
        if fmt == "sglang":
            out["meta_info"].pop("e2e_latency")
        return out
    events = result.events
    assert events, "an empty stream"
    assert events[-1] == "[DONE]", events[-3:]
    assert "[DONE]" not in events[:-1]
    if fmt == "sglang":
        return _sglang_stream(events[:-1])
    return _vllm_stream(body, events[:-1])


def _sglang_stream(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    tokens: list[int] = []
    logprobs: list[Any] = []
    tops: list[Any] = []
    experts = b""
    for i, chunk in enumerate(chunks):
        meta = chunk["meta_info"]
        tokens += chunk["output_ids"]
        # completion_tokens is a running total: rebased after a migration.
        assert meta["completion_tokens"] == len(tokens), (i, meta)
        assert (meta["finish_reason"] is None) == (i < len(chunks) - 1), (i, meta)
        logprobs += meta.get("output_token_logprobs") or []
        tops += meta.get("output_top_logprobs") or []
        if "routed_experts" in meta:
            experts += base64.b64decode(meta["routed_experts"])
    last = dict(chunks[-1]["meta_info"])
    for key in ("e2e_latency", "output_token_logprobs", "output_top_logprobs", "routed_experts"):
        last.pop(key, None)
    # Properties of the prompt are repeated on every chunk, the same on each.
    for chunk in chunks:
        for key in ("prompt_tokens", "cached_tokens", "input_token_logprobs", "input_top_logprobs"):
            assert chunk["meta_info"].get(key) == last.get(key), (key, chunk)
    return {
        "output_ids": tokens,
        "output_token_logprobs": logprobs,
        "output_top_logprobs": tops,
        "routed_experts": experts,
        "meta_info": last,
        "keys": sorted(chunks[-1]["meta_info"]),
    }


def _vllm_stream(body: dict[str, Any], chunks: list[dict[str, Any]]) -> dict[str, Any]:
    options = body.get("stream_options") or {}
    usage_chunk = None
    if options.get("include_usage"):
        usage_chunk = chunks.pop()
        assert usage_chunk["choices"] == [], usage_chunk
    continuous = bool(options.get("include_usage") and options.get("continuous_usage_stats"))
    tokens: list[int] = []
    logprobs: list[Any] = []
    prompt_logprobs: list[Any] = []
    ids = set()
    for i, chunk in enumerate(chunks):
        ids.add(chunk["request_id"])
        (choice,) = chunk["choices"]
        tokens += choice["token_ids"]
        if choice["logprobs"] is not None:
            logprobs += choice["logprobs"]["content"]
        if "prompt_logprobs" in chunk:
            prompt_logprobs.append(chunk["prompt_logprobs"])
        assert (choice["finish_reason"] is None) == (i < len(chunks) - 1), (i, chunk)
        if continuous:
            assert chunk["usage"]["completion_tokens"] == len(tokens), (i, chunk)
        else:
            assert chunk["usage"] is None, chunk
    last = dict(chunks[-1]["choices"][0])
    last.pop("token_ids")
    last.pop("logprobs")
    return {
        "request_ids": sorted(ids),
        "token_ids": tokens,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,  # at most once, in the first chunk
        "last_choice": last,
        "usage": None if usage_chunk is None else usage_chunk,
        "last_usage": chunks[-1]["usage"],
    }


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two JSON-like values differ (for readable failures)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                out.append(f"{path}.{key}: only in {'got' if key in a else 'expected'}")
            else:
                out += differences(a[key], b[key], f"{path}.{key}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in differences(x, y, f"{path}[{i}]")
        ]
    return [] if a == b else [f"{path}: got {a!r:.300} expected {b!r:.300}"]


def token_count(fmt: str, summary: dict[str, Any]) -> int:
    if "output_ids" in summary:
        return len(summary["output_ids"])
    if "token_ids" in summary:
        return len(summary["token_ids"])
    return len(summary["choices"][0]["token_ids"])


# ---------------------------------------------------------------- requests


@dataclass(frozen=True)
class Case:
    fmt: str
    stream: bool
    body: dict[str, Any]


@st.composite
def cases(draw: st.DrawFn, vocab: int, routed_experts: bool = True) -> Case:
    fmt = draw(st.sampled_from(["sglang", "vllm"]))
    stream = draw(st.booleans())
    prompt = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40))
    budget = draw(st.integers(1, 40))
    stops = draw(st.lists(st.integers(0, vocab - 1), max_size=3, unique=True))
    min_tokens = draw(st.sampled_from([0, 0, 0, *range(budget + 1)]))
    ignore_eos = draw(st.booleans())
    rid = f"law-{uuid.uuid4().hex}"  # the same ID in both runs: responses echo it
    if fmt == "sglang":
        body: dict[str, Any] = {
            "input_ids": prompt,
            "rid": rid,
            "sampling_params": {
                "max_new_tokens": budget,
                "stop_token_ids": stops,
                "min_new_tokens": min_tokens,
                "ignore_eos": ignore_eos,
            },
        }
        if draw(st.booleans()):
            body["return_logprob"] = True
            body["top_logprobs_num"] = draw(st.integers(0, 3))
            body["logprob_start_len"] = draw(st.integers(-1, len(prompt) - 1))
        if routed_experts and draw(st.booleans()):
            body["return_routed_experts"] = True
            body["routed_experts_start_len"] = draw(st.integers(0, len(prompt)))
    else:
        sp: dict[str, Any] = {
            "max_tokens": budget,
            "stop_token_ids": stops,
            "min_tokens": min_tokens,
            "ignore_eos": ignore_eos,
        }
        logprobs = draw(st.none() | st.integers(0, 3))
        if logprobs is not None:
            sp["logprobs"] = logprobs
        prompt_logprobs = draw(st.none() | st.integers(0, 2))
        if prompt_logprobs is not None:
            sp["prompt_logprobs"] = prompt_logprobs
        body = {"token_ids": prompt, "request_id": rid, "sampling_params": sp}
        if stream:
            options = draw(
                st.sampled_from(
                    [
                        None,
                        {"include_usage": True},
                        {"include_usage": True, "continuous_usage_stats": True},
                    ]
                )
            )
            if options is not None:
                body["stream_options"] = options
    return Case(fmt, stream, body)

"""Port of vLLM's stop_reason tests for /inference/v1/generate.

Origin: vllm-project/vllm `tests/entrypoints/scale_out/token_in_token_out/test_stop_reason.py`
@ 0220c46bc001f6f8363889870b87c96a26940192: the unary and streaming answers carry the
engine's `stop_reason` next to `finish_reason: "stop"`.

Upstream hands `serve_tokens_*_generator` a scripted engine output (stop_reason 42, and
"done" for a stop string). Adapted: a real request whose `stop_token_ids` holds a token the
mock is known to generate (its third token without the stop), so the engine stops on it
and reports it; a stop string ("done") needs detokenization, which this route does not do.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.http_util import stream
from tests.inproc import InProcessMesh
from tests.upstream.kit import post_json

pytestmark = pytest.mark.inproc

GEN_ENDPOINT = "/inference/v1/generate"
PROMPT = [1, 2]


async def stop_token(mesh: InProcessMesh) -> tuple[int, int]:
    """A token the mock generates for PROMPT, first seen at position >= 1, and where."""
    reply = await post_json(
        mesh.http_url + GEN_ENDPOINT,
        {"token_ids": PROMPT, "sampling_params": {"max_tokens": 8, "ignore_eos": True}},
    )
    assert reply.status == 200, reply.body
    tokens: list[int] = reply.body["choices"][0]["token_ids"]
    for i, token in enumerate(tokens[1:], start=1):
        if token not in tokens[:i]:
            return token, i
    raise AssertionError(f"no fresh token among {tokens}")


def body(stop: int, **more: Any) -> dict[str, Any]:
    return {
        "token_ids": PROMPT,
        "sampling_params": {"max_tokens": 8, "ignore_eos": True, "stop_token_ids": [stop]},
        **more,
    }


async def test_generate_full_response_includes_stop_reason_from_engine(
    mesh: InProcessMesh,
) -> None:
    stop, _ = await stop_token(mesh)
    reply = await post_json(mesh.http_url + GEN_ENDPOINT, body(stop))
    assert reply.status == 200, reply.body
    choice = reply.body["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == stop


async def test_generate_stream_response_includes_stop_reason_from_engine(
    mesh: InProcessMesh,
) -> None:
    stop, _ = await stop_token(mesh)
    reply = await stream(mesh.http_url + GEN_ENDPOINT, body(stop))
    assert reply.status == 200, reply.raw
    chunks = [e for e in reply.events if isinstance(e, dict) and e.get("choices")]
    assert chunks
    choice = chunks[-1]["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == stop

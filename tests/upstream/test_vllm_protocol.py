"""Port of vLLM's GenerateRequest protocol tests: an omitted max_tokens is "not provided"
(the server fills in the context room), an explicit one is kept, even when it equals
SamplingParams' default 16.

Origin: vllm-project/vllm `tests/entrypoints/scale_out/token_in_token_out/test_protocol.py`
@ 0cb1561bd9eac308f0d91f3c73dd3f455bd17d46.

Upstream validates `GenerateRequest` directly and reads `is_sampling_param_provided`.
Adapted: the same bodies over HTTP to a mesh whose mock has a 1024-token context, reading
the effect (how many tokens come back, with ignore_eos). Not ported:
`test_json_roundtrip_preserves_provided_keys` and
`test_internal_instance_construction_treats_all_as_provided` (Python-side construction).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.inproc import InProcessMesh
from tests.upstream.kit import post_json, start_mesh_with

pytestmark = pytest.mark.inproc

GEN_ENDPOINT = "/inference/v1/generate"
MAX_MODEL_LEN = 1024
PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def server(nats_url: str) -> Iterator[InProcessMesh]:
    mesh = start_mesh_with(nats_url, "vproto", "--mock-max-model-len", str(MAX_MODEL_LEN))
    yield mesh
    mesh.stop()


async def completion_tokens(server: InProcessMesh, sampling_params: dict[str, Any]) -> int:
    reply = await post_json(
        server.http_url + GEN_ENDPOINT,
        {"token_ids": PROMPT, "sampling_params": {"ignore_eos": True, **sampling_params}},
    )
    assert reply.status == 200, reply.body
    return len(reply.body["choices"][0]["token_ids"])


async def test_omitted_max_tokens_is_not_provided(server: InProcessMesh) -> None:
    """No max_tokens: not SamplingParams' 16 but the room left, max_model_len - prompt."""
    assert await completion_tokens(server, {}) == MAX_MODEL_LEN - len(PROMPT)


async def test_explicit_max_tokens_is_provided(server: InProcessMesh) -> None:
    """An explicit 16 (the dataclass default) is the client's choice, kept; so is 256."""
    assert await completion_tokens(server, {"max_tokens": 16}) == 16
    assert await completion_tokens(server, {"max_tokens": 256}) == 256


async def test_other_fields_tracked_independently(server: InProcessMesh) -> None:
    """Setting temperature does not make max_tokens "provided"."""
    assert await completion_tokens(server, {"temperature": 0.0}) == MAX_MODEL_LEN - len(PROMPT)

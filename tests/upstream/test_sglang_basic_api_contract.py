"""Port of SGLang's basic HTTP contract probes (health and info routes).

Origin: sgl-project/sglang `python/sglang/test/kits/basic_api_contract_kit.py`
@ e861116ea4051e42983d13ce255111cd2c059fc1, class `BasicAPIContractMixin`.

Not ported: `test_openai_chat_completion` and `test_openai_completion` (text in, text
out through a tokenizer; genmesh serves the token-in/token-out routes only).
"""

from __future__ import annotations

import pytest

from tests.inproc import InProcessMesh
from tests.upstream.kit import get

pytestmark = pytest.mark.inproc


async def test_health(mesh: InProcessMesh) -> None:
    reply = await get(mesh.http_url + "/health")
    assert reply.status == 200


async def test_health_generate(mesh: InProcessMesh) -> None:
    """200 only if one prefill + decode completes end to end."""
    reply = await get(mesh.http_url + "/health_generate")
    assert reply.status == 200


async def test_get_server_info(mesh: InProcessMesh) -> None:
    reply = await get(mesh.http_url + "/get_server_info")
    assert reply.status == 200
    assert isinstance(reply.body, dict)
    assert len(reply.body) > 0


async def test_get_model_info(mesh: InProcessMesh) -> None:
    reply = await get(mesh.http_url + "/get_model_info")
    assert reply.status == 200
    assert "model_path" in reply.body
    assert reply.body["model_path"]


@pytest.mark.skip(reason="needs a tokenizer and chat template: /v1/chat/completions is text")
async def test_openai_chat_completion() -> None:
    """Upstream: "Say hi in one word." through /v1/chat/completions."""


@pytest.mark.skip(reason="needs a tokenizer: /v1/completions is text in, text out")
async def test_openai_completion() -> None:
    """Upstream: "The capital of France is" through /v1/completions."""

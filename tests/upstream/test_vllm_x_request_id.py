"""Port of vLLM's X-Request-Id tests.

Origin: vllm-project/vllm `tests/entrypoints/serve/middleware/test_x_request_id.py`
@ ace72730fc7ef8dc14449d789a80adad5365c652, `test_response_has_one_request_id`: the
reply carries exactly one X-Request-Id, the caller's when given, else a generated UUID4
in hex form.

Adapted: upstream mounts `XRequestIdMiddleware` (vLLM's `--enable-request-id-headers`)
on a bare route that may add its own downstream IDs; here the route is genmesh's
/inference/v1/generate, which adds none, so the "downstream" parametrisation has
nothing to vary and is not ported.
"""

from __future__ import annotations

from uuid import UUID

import pytest

from tests.inproc import InProcessMesh
from tests.upstream.kit import post_json

pytestmark = pytest.mark.inproc

BODY = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}


@pytest.mark.parametrize("request_id", [None, "caller"], ids=["generated", "provided"])
async def test_response_has_one_request_id(mesh: InProcessMesh, request_id: str | None) -> None:
    headers = {"X-Request-Id": request_id} if request_id is not None else {}
    reply = await post_json(mesh.http_url + "/inference/v1/generate", BODY, headers=headers)
    assert reply.status == 200, reply.body
    values = reply.headers.getall("x-request-id", [])
    assert len(values) == 1
    if request_id is not None:
        assert values == [request_id]
    else:
        generated = UUID(values[0])
        assert generated.version == 4
        assert generated.hex == values[0]

"""Port of vLLM's request-validation error tests: `param` and the message's form.

Origin: vllm-project/vllm
`tests/entrypoints/serve/exception_handling/test_validation_exception_handler.py`
@ 344e800a9f8076db21ba8fff43f96e77529ab9e8.

Upstream calls `validation_exception_handler` with hand-made pydantic errors (the
`loc` of /v1/chat/completions' `messages`, /v1/responses' `input`). Adapted: real
malformed bodies to POST /inference/v1/generate, whose pydantic errors the real server
turns into the same 400 (`{"error": {"message", "type", "param", "code"}}`, the message
"N validation error(s):" then one line per error, at most a bounded number, inputs
bounded). Not ported: `test_unassigned_request_id_ignores_header` and
`test_validation_error_log_uses_assigned_id` (they read the handler's log records), the
`clean_loc_for_param` unit cases (no HTTP request gives those locs on this route).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.http_util import Reply
from tests.inproc import InProcessMesh
from tests.upstream.kit import post_json

pytestmark = pytest.mark.inproc

GEN_ENDPOINT = "/inference/v1/generate"


async def refused(mesh: InProcessMesh, body: dict[str, Any]) -> Reply:
    reply = await post_json(mesh.http_url + GEN_ENDPOINT, body)
    assert reply.status == 400, reply.body
    return reply


SAMPLING = {"max_tokens": 4}


@pytest.mark.parametrize(
    ("body", "error_type", "msg"),
    [
        ({"sampling_params": SAMPLING}, "missing", "Field required"),
        (
            {"token_ids": "not-a-list", "sampling_params": SAMPLING},
            "list_type",
            "Input should be a valid list",
        ),
    ],
    ids=["missing-field", "wrong-type"],
)
async def test_param_falls_back_to_loc(
    mesh: InProcessMesh, body: dict[str, Any], error_type: str, msg: str
) -> None:
    """`param` is the error's `loc`, dot-joined: "body.token_ids"."""
    reply = await refused(mesh, body)
    error = reply.body["error"]
    assert error["param"] == "body.token_ids"
    assert error_type in error["message"]
    assert msg in error["message"]


async def test_handler_strips_endpoint_file_context(mesh: InProcessMesh) -> None:
    """The message names the error, not the server's files or functions."""
    reply = await refused(mesh, {"token_ids": "not-a-list", "sampling_params": SAMPLING})
    message = reply.body["error"]["message"]
    assert "/usr/" not in message
    assert ".py" not in message
    assert "list_type" in message
    assert "Input should be a valid list" in message


async def test_handler_strips_endpoint_path_only_variant(mesh: InProcessMesh) -> None:
    reply = await refused(mesh, {"sampling_params": SAMPLING})
    message = reply.body["error"]["message"]
    assert "missing" in message
    assert "Field required" in message
    assert GEN_ENDPOINT not in message


async def test_many_errors_are_capped(mesh: InProcessMesh) -> None:
    """5000 bad elements: 5000 errors counted, a bounded body, the rest acknowledged."""
    reply = await refused(mesh, {"token_ids": ["a"] * 5000, "sampling_params": SAMPLING})
    message = reply.body["error"]["message"]
    assert len(str(reply.body)) < 32_000, f"body was {len(str(reply.body))} chars"
    assert message.startswith("5000 validation errors:")
    assert "more errors" in message


async def test_container_input_is_described_not_echoed(mesh: InProcessMesh) -> None:
    """A container given where a scalar belongs is described, not echoed."""
    body = {
        "token_ids": [1, 2, 3],
        "sampling_params": SAMPLING,
        "stream": [{"text": "payload"} for _ in range(300)],
    }
    reply = await refused(mesh, body)
    message = reply.body["error"]["message"]
    assert "<list of 300 items>" in message
    assert "payload" not in message


async def test_long_string_input_is_truncated(mesh: InProcessMesh) -> None:
    body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": "A" * 100_000}}
    reply = await refused(mesh, body)
    message = reply.body["error"]["message"]
    assert "[truncated]" in message
    assert len(message) < 4_000


async def test_small_input_is_still_reported_verbatim(mesh: InProcessMesh) -> None:
    reply = await refused(mesh, {"token_ids": "not-a-list", "sampling_params": SAMPLING})
    message = reply.body["error"]["message"]
    assert "not-a-list" in message
    assert "[truncated]" not in message

"""How vLLM's cancel routes read their bodies (vllm/entrypoints/serve/cancel/api_router.py):
`/abort_requests` forgives any body (none named = abort all), `/v1/requests/cancel`
validates a `CancelRequest` as FastAPI does."""

from __future__ import annotations

import pytest

from genmesh.formats.base import RequestRejected
from genmesh.formats.vllm.cancel import (
    ABORT_ALL,
    abort_requests_ids,
    batch_cancel_ids,
    engine_client_id,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "body",
    [b"", b"not json", b"[1, 2]", b"null", b"{}", b'{"request_ids": []}',
     b'{"request_ids": null}', b'{"request_ids": ""}', b'{"other": ["x"]}'],
)  # fmt: skip
def test_abort_requests_without_ids_means_all(body: bytes) -> None:
    assert abort_requests_ids(body) is ABORT_ALL


def test_abort_requests_names_ids() -> None:
    assert abort_requests_ids(b'{"request_ids": ["generate-tokens-a", "b"]}') == [
        "generate-tokens-a",
        "b",
    ]
    # vLLM loops over whatever `request_ids` is: a string by character, a map by key.
    assert abort_requests_ids(b'{"request_ids": "ab"}') == ["a", "b"]
    assert abort_requests_ids(b'{"request_ids": {"x": 1}}') == ["x"]


@pytest.mark.parametrize("body", [b'{"request_ids": 5}', b'{"request_ids": ["a", 3]}'])
def test_abort_requests_refuses_ids_that_are_not_strings(body: bytes) -> None:
    with pytest.raises(RequestRejected) as info:
        abort_requests_ids(body)
    assert info.value.status == 400
    assert info.value.body["error"]["type"] == "BadRequestError"


def test_batch_cancel_reads_a_cancel_request() -> None:
    assert batch_cancel_ids(b'{"request_ids": ["a", "b"], "extra": 1}') == ["a", "b"]
    assert batch_cancel_ids(b"{}") == []  # request_ids defaults to []


@pytest.mark.parametrize(
    ("body", "param", "kind"),
    [
        (b"", "body", "missing"),
        (b'{"request_ids": [1]}', "body.request_ids.0", "string_type"),
        (b"[]", "body", "model_type"),
        (b'{"request_ids": ', "body.16", "json_invalid"),
    ],
)
def test_batch_cancel_refuses_as_fastapi_does(body: bytes, param: str, kind: str) -> None:
    with pytest.raises(RequestRejected) as info:
        batch_cancel_ids(body)
    error = info.value.body["error"]
    assert (info.value.status, error["type"], error["param"]) == (400, "Bad Request", param)
    assert error["message"].startswith("1 validation error:\n")
    assert f"'type': '{kind}'" in error["message"]


def test_engine_ids_map_to_client_ids() -> None:
    assert engine_client_id("generate-tokens-abc") == "abc"
    assert engine_client_id("generate-tokens-") is None
    assert engine_client_id("cmpl-123") is None

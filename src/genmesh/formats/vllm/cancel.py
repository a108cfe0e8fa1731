"""vLLM's cancel routes' bodies (vllm/entrypoints/serve/cancel/{protocol,api_router}.py).

- `POST /v1/requests/cancel` takes a `CancelRequest` as a FastAPI body model: a body that
  is not one is refused as every vLLM body model is (RequestValidationError, 400).
- `POST /abort_requests` reads its body itself and forgives everything: a body that is
  not JSON, or not an object, or has no (or empty) `request_ids`, means "abort every
  in-flight request".

IDs are vLLM's engine request IDs, which for this route are `generate-tokens-<id>` (the
generate response's `request_id`); `engine_client_id` turns one into the client ID the
mesh's abort orders match.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, ValidationError

from genmesh.formats.base import RequestRejected
from genmesh.formats.fastapi import UNREADABLE_BODY, BodyError, read_json
from genmesh.formats.vllm.request import (
    RESPONSE_ID_PREFIX,
    error,
    invalid,
    validation_rejected,
)


class CancelRequest(BaseModel):
    """vLLM's `CancelRequest`: unknown keys are ignored (pydantic's default)."""

    request_ids: list[str] = Field(default_factory=list)


def batch_cancel_ids(body: bytes) -> list[str]:
    """The IDs a `POST /v1/requests/cancel` body names; RequestRejected as vLLM refuses
    a body that is not a `CancelRequest`."""
    try:
        value = read_json(body)
    except BodyError as exc:
        if exc.errors is None:
            answer = error(UNREADABLE_BODY, 400, None, "Bad Request")
            raise RequestRejected(400, answer, UNREADABLE_BODY) from None
        raise invalid(exc.errors, ".".join(str(p) for p in exc.errors[0]["loc"])) from None
    try:
        return CancelRequest.model_validate(value).request_ids
    except ValidationError as exc:
        raise validation_rejected(exc) from None


class AbortAll:
    """`/abort_requests` with no IDs: abort every in-flight request."""


ABORT_ALL = AbortAll()


def abort_requests_ids(body: bytes) -> list[str] | AbortAll:
    """What a `POST /abort_requests` body asks for, read as the cancel router reads it
    (`contextlib.suppress(Exception)` around `request.json()`, then
    `body.get("request_ids")`): the IDs, or ABORT_ALL when it names none.

    vLLM then loops over `request_ids` and hands each item to `engine.abort`, which fails
    (500) on anything but a string; genmesh refuses those with 400 instead (RequestRejected)
    rather than answer with a server error for a client's mistake. A string is looped
    over character by character, as vLLM's loop does."""
    try:
        value = read_json(body)
    except BodyError:
        return ABORT_ALL
    ids: Any = value.get("request_ids") if isinstance(value, dict) else None
    if not ids:
        return ABORT_ALL
    if isinstance(ids, dict):
        ids = list(ids)  # iterating a dict gives its keys
    elif isinstance(ids, str):
        ids = list(ids)
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        answer = error("'request_ids' must be a list of request ID strings", 400)
        raise RequestRejected(400, answer, answer["error"]["message"])
    return ids


def engine_client_id(request_id: str) -> str | None:
    """The client ID behind a vLLM engine request ID (`generate-tokens-<client id>`),
    None for any other ID (no request of this route can have it)."""
    if request_id.startswith(RESPONSE_ID_PREFIX) and len(request_id) > len(RESPONSE_ID_PREFIX):
        return request_id[len(RESPONSE_ID_PREFIX) :]
    return None

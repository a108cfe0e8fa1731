"""SGLang's error bodies (reference `engine-apis.md` §A.6), and the two ways `bind` refuses.

- a wrong JSON type (what FastAPI refuses before SGLang's code runs) gets the legacy shape
  `{"object": "error", "message", "type": "Bad Request", "param": null, "code": 400}`;
- a value SGLang refuses (a ValueError in its code) gets `{"error": {"message"}}`.
"""

from __future__ import annotations

from typing import Any

from genmesh.formats.base import RequestRejected


def legacy_error(message: str, status: int = 400) -> dict[str, Any]:
    return {
        "object": "error",
        "message": message,
        "type": "Bad Request",
        "param": None,
        "code": status,
    }


def error(message: str, status: int = 400) -> dict[str, Any]:
    """SGLang's error body: `{"error": {"message"}}`, except for the 5xx answers SGLang
    raises as HTTPExceptions (queue full, engine failures), which get the legacy shape."""
    if status >= 500:
        return legacy_error(message, status) | {"type": str(status)}
    return {"error": {"message": message}}


def type_error(message: str) -> RequestRejected:
    return RequestRejected(400, legacy_error(message), message)


def value_error(message: str) -> RequestRejected:
    return RequestRejected(400, error(message), message)


def duplicate_rid(rid: str) -> RequestRejected:
    """SGLang's `_init_req_state`: a rid already in `rid_to_state` is a ValueError."""
    return value_error(f"Duplicate request ID detected: {rid}")

"""How the mock vLLM server refuses a request: vLLM's error envelope.

Errors are vLLM's `ErrorResponse`, `{"error": {"message", "type", "param", "code"}}`,
with `type` named after the status (`BadRequestError`, `NotFoundError`, ...). A field of
the wrong JSON type gets pydantic's wording (`1 validation error for GenerateRequest`).
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any


def error_type(status: int) -> str:
    """vLLM's error `type` for a status: `BadRequestError`, `NotFoundError`, ..."""
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        return "InternalServerError" if status >= 500 else "BadRequestError"
    name = "".join(word[:1].upper() + word[1:] for word in phrase.replace("-", " ").split())
    return name if name.endswith("Error") else name + "Error"


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """vLLM's `ErrorResponse`: `{"error": {"message", "type", "param", "code"}}`."""
    return {
        "error": {"message": message, "type": error_type(status), "param": param, "code": status}
    }


class ApiError(Exception):
    """A refusal: answered with `error_body` and `status`."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.param)


def type_error(loc: str, expected: str, value: Any) -> ApiError:
    """pydantic's wording, roughly: "<loc>: Input should be a valid <type>"."""
    return ApiError(f"1 validation error for GenerateRequest\n{loc}\n  Input should be a valid "
                    f"{expected} [input_value={value!r:.60}]")  # fmt: skip

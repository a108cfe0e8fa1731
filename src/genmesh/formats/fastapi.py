"""How FastAPI reads a JSON request body. SGLang's and vLLM's servers are both FastAPI
apps, so a body either format refuses before any of the server's own code runs is refused
the same way: the error list of a RequestValidationError (each server's handler words it),
or, for bytes FastAPI cannot decode at all, an HTTPException(400)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

# FastAPI's HTTPException detail for a body that is not even text (or nested too deep).
UNREADABLE_BODY = "There was an error parsing the body"


class BodyError(Exception):
    """A body FastAPI would not hand to the endpoint: `errors` is the RequestValidationError
    list, or None for the unreadable body (`UNREADABLE_BODY`)."""

    def __init__(self, errors: list[dict[str, Any]] | None) -> None:
        super().__init__(UNREADABLE_BODY if errors is None else str(errors))
        self.errors = errors


def read_json(body: bytes) -> Any:
    """The body as a JSON value, or the BodyError FastAPI's body reading raises."""
    if not body:
        raise BodyError(
            [{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]
        )
    try:
        return json.loads(body)
    except json.JSONDecodeError as exc:
        raise BodyError(
            [
                {
                    "type": "json_invalid",
                    "loc": ("body", exc.pos),
                    "msg": "JSON decode error",
                    "input": {},
                    "ctx": {"error": exc.msg},
                }
            ]
        ) from None
    except (ValueError, RecursionError):  # not UTF-8, or nested too deep
        raise BodyError(None) from None


def body_errors(
    errors: Sequence[Mapping[str, Any]], prefix: tuple[Any, ...] = ("body",)
) -> list[dict[str, Any]]:
    """pydantic's errors (`errors(include_url=False)`) as FastAPI reports a body model's:
    located under `body`."""
    return [{**err, "loc": prefix + tuple(err.get("loc", ()))} for err in errors]

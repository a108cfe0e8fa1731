"""How the mock SGLang server refuses a /generate request, and its first check: JSON types.

SGLang refuses a request in one of two ways, each with its own error shape:

- `Malformed`: FastAPI parses the body into `GenerateReqInput` with pydantic; a missing or
  undecodable body, or a field of the wrong JSON type, fails there, before any SGLang code
  runs, with a 400 `{"object": "error", ...}` reply (`check_body` here);
- `Rejected`: a ValueError in SGLang's normalize/tokenize/validate steps (`normalize`,
  `sampling`): a 400 `{"error": {"message"}}`, or an in-band `data: {"error": ...}` event
  once a stream has started.

The third shape, the scheduler's abort finish reasons, is the `schedule` module's.
"""

from __future__ import annotations

import json
from typing import Any, TypeGuard

JSON = dict[str, Any]


class Malformed(Exception):
    """A body FastAPI/pydantic would refuse before the handler runs: 400 `object: error`."""

    def __init__(self, errors: list[JSON]) -> None:
        super().__init__(errors)
        self.errors = errors

    @property
    def message(self) -> str:
        # FastAPI's RequestValidationError: f"{exc} {exc.errors()}".
        count = len(self.errors)
        lines = "\n".join(f"  {e!r}" for e in self.errors)
        return f"{count} validation error{'s' if count > 1 else ''}:\n{lines} {self.errors!r}"


class Rejected(ValueError):
    """A ValueError in SGLang's normalize/tokenize/validate steps: 400 `{"error": ...}`."""


# ---------------------------------------------------------------- body type checks


def is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def is_int_list(v: Any) -> bool:
    return isinstance(v, list) and all(is_int(x) for x in v)


def as_bool(v: Any) -> bool | None:
    """pydantic's lax bool: true/false, 0/1 and the usual strings; None if not a bool."""
    if isinstance(v, bool):
        return v
    if is_int(v) and v in (0, 1):
        return bool(v)
    if isinstance(v, str):
        low = v.strip().lower()
        if low in ("true", "1", "yes", "on", "t", "y"):
            return True
        if low in ("false", "0", "no", "off", "f", "n"):
            return False
    return None


def check_body(raw: bytes) -> JSON:
    if not raw.strip():
        raise Malformed([{"type": "missing", "loc": ("body",), "msg": "Field required"}])
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        err = {"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error"}
        raise Malformed([{**err, "input": {}, "ctx": {"error": str(exc)}}]) from exc
    if not isinstance(body, dict):
        raise Malformed(
            [
                {
                    "type": "dataclass_type",
                    "loc": ("body",),
                    "msg": "Input should be a dictionary or an instance of GenerateReqInput",
                    "input": body,
                }
            ]
        )
    errors: list[JSON] = []

    def bad(name: str, kind: str, msg: str) -> None:
        errors.append({"type": kind, "loc": ("body", name), "msg": msg, "input": body[name]})

    def present(name: str) -> bool:
        return body.get(name) is not None

    for name in ("stream", "return_text_in_logprobs", "return_routed_experts"):
        if name in body:
            value = as_bool(body[name])
            if value is None:
                bad(name, "bool_parsing", "Input should be a valid boolean")
            else:
                body[name] = value
    if present("return_logprob"):
        value = body["return_logprob"]
        if isinstance(value, list):
            coerced = [as_bool(v) for v in value]
            if any(v is None for v in coerced):
                bad("return_logprob", "bool_parsing", "Input should be a valid boolean")
            else:
                body["return_logprob"] = coerced
        elif as_bool(value) is None:
            bad("return_logprob", "bool_parsing", "Input should be a valid boolean")
        else:
            body["return_logprob"] = as_bool(value)
    for name in ("logprob_start_len", "top_logprobs_num"):
        if present(name) and not (is_int(body[name]) or is_int_list(body[name])):
            bad(name, "int_type", "Input should be a valid integer")
    if "routed_experts_start_len" in body and not is_int(body["routed_experts_start_len"]):
        bad("routed_experts_start_len", "int_type", "Input should be a valid integer")
    if present("priority") and not is_int(body["priority"]):
        bad("priority", "int_type", "Input should be a valid integer")
    if present("text"):
        text = body["text"]
        if not (
            isinstance(text, str)
            or (isinstance(text, list) and all(isinstance(t, str) for t in text))
        ):
            bad("text", "string_type", "Input should be a valid string")
    if present("input_ids"):
        ids = body["input_ids"]
        if not (
            is_int_list(ids)
            or (isinstance(ids, list) and all(is_int_list(p) for p in ids) and len(ids) > 0)
        ):
            bad(
                "input_ids",
                "value_error",
                "Value error, input_ids must be a list of int64 or a list of lists of int64",
            )
    if present("token_ids_logprob"):
        tids = body["token_ids_logprob"]
        if not (
            is_int(tids)
            or is_int_list(tids)
            or (isinstance(tids, list) and all(is_int_list(t) for t in tids))
        ):
            bad("token_ids_logprob", "list_type", "Input should be a valid list")
    if present("sampling_params"):
        sp = body["sampling_params"]
        if not (
            isinstance(sp, dict) or (isinstance(sp, list) and all(isinstance(s, dict) for s in sp))
        ):
            bad("sampling_params", "dict_type", "Input should be a valid dictionary")
    if present("rid"):
        rid = body["rid"]
        if not (
            isinstance(rid, str) or (isinstance(rid, list) and all(isinstance(r, str) for r in rid))
        ):
            bad("rid", "string_type", "Input should be a valid string")
    if present("session_params") and not isinstance(body["session_params"], dict):
        bad("session_params", "dict_type", "Input should be a valid dictionary")
    if errors:
        raise Malformed(errors)
    return body

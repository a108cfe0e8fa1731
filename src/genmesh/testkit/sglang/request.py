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
from collections.abc import Callable
from dataclasses import dataclass
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


def _lax_bool(v: Any) -> bool:
    return as_bool(v) is not None


def _lax_bools(v: Any) -> bool:
    return all(_lax_bool(x) for x in v) if isinstance(v, list) else _lax_bool(v)


def _int_or_ints(v: Any) -> bool:
    return is_int(v) or is_int_list(v)


def _str_or_strs(v: Any) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))


def _prompt_or_prompts(v: Any) -> bool:
    return is_int_list(v) or (isinstance(v, list) and all(is_int_list(p) for p in v) and len(v) > 0)


def _ids_or_id_lists(v: Any) -> bool:
    return is_int(v) or is_int_list(v) or (isinstance(v, list) and all(is_int_list(t) for t in v))


def _dict_or_dicts(v: Any) -> bool:
    return isinstance(v, dict) or (isinstance(v, list) and all(isinstance(s, dict) for s in v))


def _is_dict(v: Any) -> bool:
    return isinstance(v, dict)


@dataclass(frozen=True, slots=True)
class _Field:
    """A field of `GenerateReqInput` and the JSON values pydantic accepts for it."""

    name: str
    accepts: Callable[[Any], bool]
    error: tuple[str, str]  # pydantic's error type and message
    # Optional[...] fields take null as their default; the others refuse it.
    nullable: bool = True

    def refuses(self, body: JSON) -> bool:
        if self.name not in body or (self.nullable and body[self.name] is None):
            return False
        return not self.accepts(body[self.name])

    def report(self, body: JSON) -> JSON:
        kind, msg = self.error
        return {"type": kind, "loc": ("body", self.name), "msg": msg, "input": body[self.name]}


_BOOL = "bool_parsing", "Input should be a valid boolean"
_INT = "int_type", "Input should be a valid integer"
_STR = "string_type", "Input should be a valid string"
_DICT = "dict_type", "Input should be a valid dictionary"
_LIST = "list_type", "Input should be a valid list"
_INPUT_IDS = (
    "value_error",
    "Value error, input_ids must be a list of int64 or a list of lists of int64",
)

# Checked, and reported, in this order.
_FIELDS = (
    _Field("stream", _lax_bool, _BOOL, nullable=False),
    _Field("return_text_in_logprobs", _lax_bool, _BOOL, nullable=False),
    _Field("return_routed_experts", _lax_bool, _BOOL, nullable=False),
    _Field("return_logprob", _lax_bools, _BOOL),
    _Field("logprob_start_len", _int_or_ints, _INT),
    _Field("top_logprobs_num", _int_or_ints, _INT),
    _Field("routed_experts_start_len", is_int, _INT, nullable=False),
    _Field("priority", is_int, _INT),
    _Field("text", _str_or_strs, _STR),
    _Field("input_ids", _prompt_or_prompts, _INPUT_IDS),
    _Field("token_ids_logprob", _ids_or_id_lists, _LIST),
    _Field("sampling_params", _dict_or_dicts, _DICT),
    _Field("rid", _str_or_strs, _STR),
    _Field("session_params", _is_dict, _DICT),
)


def check_body(raw: bytes) -> JSON:
    """The body as pydantic hands it to SGLang (lax bools made bools), or `Malformed`
    listing every field of the wrong type."""
    body = _json_object(raw)
    errors = [field.report(body) for field in _FIELDS if field.refuses(body)]
    if errors:
        raise Malformed(errors)
    return _coerce_bools(body)


def _json_object(raw: bytes) -> JSON:
    if not raw.strip():
        raise Malformed([{"type": "missing", "loc": ("body",), "msg": "Field required"}])
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        err = {"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error"}
        raise Malformed([{**err, "input": {}, "ctx": {"error": str(exc)}}]) from exc
    if not isinstance(body, dict):
        msg = "Input should be a dictionary or an instance of GenerateReqInput"
        raise Malformed([{"type": "dataclass_type", "loc": ("body",), "msg": msg, "input": body}])
    return body


def _coerce_bools(body: JSON) -> JSON:
    """What pydantic accepted as a lax bool, stored as a bool."""
    for name in ("stream", "return_text_in_logprobs", "return_routed_experts"):
        if name in body:
            body[name] = as_bool(body[name])
    value = body.get("return_logprob")
    if isinstance(value, list):
        body["return_logprob"] = [as_bool(v) for v in value]
    elif value is not None:
        body["return_logprob"] = as_bool(value)
    return body

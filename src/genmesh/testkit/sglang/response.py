"""What the mock SGLang server puts on the wire: JSON bodies, SSE events, error bodies.

Besides `{"error": ...}` and `{"object": "error", ...}` (see `request`), an injected HTTP
error answers with the body SGLang sends for its status, and the scheduler finishes a
request it aborts with `FINISH_ABORT`'s reason object.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from genmesh.engines.faults import Fault
from genmesh.testkit.sglang.request import JSON, Malformed

WEIGHT_VERSION = "default"

WAITING_ABORT = "Abort in waiting queue"

DONE = b"data: [DONE]\n\n"


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=dumps(obj), status=status, content_type="application/json")


def error_response(message: str, status: int = 400) -> web.Response:
    """`_create_error_response`: what a ValueError becomes on a non-streaming request."""
    return json_response({"error": {"message": message}}, status)


def http_exception(status: int, message: str) -> web.Response:
    """FastAPI's HTTPException handler in SGLang's http_server (`ErrorResponse`)."""
    body = {"object": "error", "message": message, "type": str(status), "param": None}
    return json_response({**body, "code": status}, status)


def malformed_response(exc: Malformed) -> web.Response:
    body = {"object": "error", "message": exc.message, "type": "Bad Request", "param": None}
    return json_response({**body, "code": 400}, 400)


def fault_response(fault: Fault) -> web.Response:
    """An injected HTTP error with the body SGLang sends for that status."""
    if 400 <= fault.status < 500:
        return error_response(fault.message, fault.status)
    return http_exception(fault.status, fault.message)


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


def abort_reason(message: str, status: int | None) -> JSON:
    """`FINISH_ABORT(message, status_code, err_type).to_json()`."""
    err_type = "BadRequestError" if status == 400 else None
    return {"type": "abort", "message": message, "status_code": status, "err_type": err_type}

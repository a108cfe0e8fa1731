"""The admin routes: abort by ID (SGLang's and vLLM's routes) and `/flush_cache`, fanned
out to every worker over NATS; and the API keys that guard routes as SGLang guards them.

Aborts match the client IDs the envelopes carry (`shared/abort.py`), so one reaches its
request whichever frontend the request came through. Replies are the real servers':
SGLang `POST /abort_request` (http_server.py, tokenizer_manager.abort_request): 200 with
an empty body, also for an unknown rid; vLLM's cancel router (serve/cancel/api_router.py),
which a vLLM server mounts before its tokens-only router and so also answers
`/abort_requests`: `POST /abort_requests` and `POST /v1/requests/cancel` 200 `{"status":
"cancelled", "cancelled_request_ids": [...]}` (no IDs on `/abort_requests` = abort all),
`POST /v1/requests/{id}/cancel` and `DELETE /v1/requests/{id}` 200 `{"status":
"cancelled", "request_id"}`, 404 `NotFoundError` when nothing ran under that ID; and the
tokens-only abort at `/inference/v1/abort_requests`: 200 empty, 400 without
`request_ids`. See docs/admin.md. `/flush_cache` answers SGLang's text, 200 when every
worker flushed and 400 when one failed (SGLang refuses while it has requests) or did not
answer in time.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable
from enum import Enum
from typing import Any

import orjson
from aiohttp import web

from genmesh.formats.base import RequestRejected
from genmesh.formats.vllm.cancel import (
    AbortAll,
    abort_requests_ids,
    batch_cancel_ids,
    engine_client_id,
)
from genmesh.services.frontend.state import FrontendState
from genmesh.shared.abort import AbortOrder

log = logging.getLogger(__name__)

# SGLang's flush_cache reply text (http_server.py), for success and failure alike.
FLUSH_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
CANCEL_PATH = "/v1/requests/{request_id}"
BATCH_CANCEL_PATH = "/v1/requests/cancel"


class AuthLevel(Enum):
    """SGLang's per-route auth levels (sglang/srt/utils/auth.py)."""

    NORMAL = "normal"
    ADMIN_OPTIONAL = "admin_optional"


# The routes SGLang and vLLM mark admin (`@auth_level(AuthLevel.ADMIN_OPTIONAL)`).
ADMIN_ROUTES = frozenset(
    (
        "/abort_request",
        "/abort_requests",
        "/inference/v1/abort_requests",
        f"{CANCEL_PATH}/cancel",
        CANCEL_PATH,
        BATCH_CANCEL_PATH,
        "/flush_cache",
    )
)


def add_admin_routes(app: web.Application, state: FrontendState) -> None:
    routes = AdminRoutes(state)
    app.router.add_post("/abort_request", routes.sglang_abort)
    app.router.add_post("/abort_requests", routes.vllm_abort_requests)
    app.router.add_post("/inference/v1/abort_requests", routes.vllm_tokens_only_abort)
    app.router.add_post(BATCH_CANCEL_PATH, routes.vllm_cancel_batch)
    app.router.add_post(f"{CANCEL_PATH}/cancel", routes.vllm_cancel)
    app.router.add_delete(CANCEL_PATH, routes.vllm_cancel)
    app.router.add_route("GET", "/flush_cache", routes.flush_cache)
    app.router.add_route("POST", "/flush_cache", routes.flush_cache)


def _sglang_validation_error(message: str) -> web.Response:
    """FastAPI's RequestValidationError as SGLang answers it (400, legacy shape)."""
    body = {"object": "error", "message": message, "type": "Bad Request", "param": None,
            "code": 400}  # fmt: skip
    return web.json_response(body, status=400)


def _vllm_error(message: str, status: int, err_type: str) -> web.Response:
    body = {"error": {"message": message, "type": err_type, "param": None, "code": status}}
    return web.json_response(body, status=status)


def _rejected(exc: RequestRejected) -> web.Response:
    return web.json_response(exc.body, status=exc.status)


class AdminRoutes:
    def __init__(self, state: FrontendState) -> None:
        self.state = state

    async def sglang_abort(self, request: web.Request) -> web.Response:
        """`{"rid": str}` or `{"abort_all": true}` (SGLang's `AbortReq`)."""
        raw = await request.read()
        try:
            body = orjson.loads(raw) if raw.strip() else {}
        except orjson.JSONDecodeError as exc:
            return _sglang_validation_error(f"JSON decode error: {exc}")
        if not isinstance(body, dict):
            return _sglang_validation_error("Input should be a valid dictionary or AbortReq")
        rid = body.get("rid")
        abort_all = body.get("abort_all", False)
        if rid is not None and not isinstance(rid, str):
            return _sglang_validation_error("rid: Input should be a valid string")
        if not isinstance(abort_all, bool):
            return _sglang_validation_error("abort_all: Input should be a valid boolean")
        if abort_all:
            order = AbortOrder((), "all")
        elif not rid:
            # SGLang ignores it: an empty rid would prefix-match every request.
            log.warning("ignored /abort_request with an empty rid and abort_all false")
            return web.Response(status=200)
        else:
            order = AbortOrder((rid,), "exact", "sglang")
        try:
            aborted = await self.state.backend.abort(order)
            if aborted and order.match == "exact":
                # SGLang's second stage: its tokenizer manager knew the rid, so its
                # scheduler aborts every request whose rid starts with it.
                aborted += await self.state.backend.abort(AbortOrder(order.ids, "prefix", "sglang"))
        except Exception as exc:  # SGLang: any exception is a 400 {"error": {"message"}}
            log.exception("abort failed")
            return web.json_response({"error": {"message": str(exc)}}, status=400)
        log.info("abort %s: aborted %s", order.to_wire(), sorted(set(aborted)))
        return web.Response(status=200)

    async def _vllm_cancel_each(self, request_ids: list[str]) -> list[str]:
        """Abort each of `request_ids` (vLLM engine IDs) in one fan-out; the ones that hit
        a request, in the order given, each once (vLLM's loop of `engine.abort` calls: a
        repeated ID finds nothing the second time)."""
        wanted = {rid: cid for rid in request_ids if (cid := engine_client_id(rid))}
        if not wanted:
            return []
        order = AbortOrder(tuple(dict.fromkeys(wanted.values())), "exact", "vllm")
        hit = set(await self.state.backend.abort(order))
        return [rid for rid in dict.fromkeys(request_ids) if wanted.get(rid) in hit]

    async def vllm_cancel_batch(self, request: web.Request) -> web.Response:
        """`POST /v1/requests/cancel` `{"request_ids": [...]}`: the IDs that were running."""
        try:
            request_ids = batch_cancel_ids(await request.read())
        except RequestRejected as exc:
            return _rejected(exc)
        cancelled = await self._vllm_cancel_each(request_ids)
        return web.json_response({"status": "cancelled", "cancelled_request_ids": cancelled})

    async def vllm_abort_requests(self, request: web.Request) -> web.Response:
        """The cancel router's `POST /abort_requests`: the named IDs, or with none named
        (no body, not JSON, no or empty `request_ids`) every in-flight request."""
        try:
            wanted = abort_requests_ids(await request.read())
        except RequestRejected as exc:
            return _rejected(exc)
        if isinstance(wanted, AbortAll):
            # vLLM lists the engine IDs it aborted; the mesh knows the client IDs.
            aborted = await self.state.backend.abort(AbortOrder((), "all"))
            cancelled = list(dict.fromkeys(aborted))
            log.info("abort_requests (all): aborted %s", cancelled)
        else:
            cancelled = await self._vllm_cancel_each(wanted)
        return web.json_response({"status": "cancelled", "cancelled_request_ids": cancelled})

    async def vllm_tokens_only_abort(self, request: web.Request) -> web.Response:
        """The tokens-only router's abort (serve/disagg/api_router.py), served where the
        cancel router does not shadow it: `{"request_ids": [...]}`, 200 empty."""
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            return _vllm_error(f"JSON decode error: {exc}", 400, "BadRequestError")
        if not isinstance(body, dict):
            return _vllm_error("request body must be a JSON object", 400, "BadRequestError")
        ids = body.get("request_ids")
        if ids is None:
            return _vllm_error("Missing 'request_ids' in request body", 400, "BadRequestError")
        if isinstance(ids, str):  # vLLM's engine.abort takes one ID or several
            ids = [ids]
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            return _vllm_error("'request_ids' must be a list of strings", 400, "BadRequestError")
        client_ids = tuple(c for i in ids if (c := engine_client_id(i)) is not None)
        if client_ids:
            await self.state.backend.abort(AbortOrder(client_ids, "exact", "vllm"))
        return web.Response(status=200)

    async def vllm_cancel(self, request: web.Request) -> web.Response:
        request_id = request.match_info["request_id"]
        client_id = engine_client_id(request_id)
        aborted: list[str] = []
        if client_id is not None:
            aborted = await self.state.backend.abort(AbortOrder((client_id,), "exact", "vllm"))
        if not aborted:
            return _vllm_error(
                f"Request {request_id} not found or already completed.", 404, "NotFoundError"
            )
        return web.json_response({"status": "cancelled", "request_id": request_id})

    async def flush_cache(self, request: web.Request) -> web.Response:
        report = await self.state.backend.flush_cache()
        lines = [f"Flushed on {len(report.flushed)} of {len(report.expected)} workers."]
        if not report.expected:
            lines.append("No worker is registered: nothing was flushed.")
        lines += [f"Worker {w} did not flush: {why}" for w, why in sorted(report.failed.items())]
        lines += [f"Worker {w} did not answer in time." for w in report.missing]
        if not report.ok:
            log.warning("flush_cache: %s", " ".join(lines))
        return web.Response(
            text=FLUSH_TEXT + "\n".join(lines) + "\n", status=200 if report.ok else 400
        )


# ------------------------------------------------------------------------- API keys


def _token_matches(request: web.Request, expected: str) -> bool:
    """`Authorization: Bearer <key>`, or an `x-api-key` header (SGLang's `_check_token`)."""
    authorization = request.headers.get("Authorization")
    if authorization:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(token, expected):
            return True
    api_key = request.headers.get("x-api-key")
    return bool(api_key and secrets.compare_digest(api_key, expected))


def allowed(request: web.Request, api_key: str | None, admin_api_key: str | None) -> bool:
    """SGLang's `decide_request_auth` for the levels genmesh's routes have."""
    path = request.path
    if request.method == "OPTIONS" or path.startswith(("/health", "/ready", "/metrics")):
        return True  # probes and scrapers carry no secrets
    route = request.match_info.route
    canonical = route.resource.canonical if route.resource is not None else None
    if canonical in ADMIN_ROUTES:
        # Admin key if set (the API key is then refused), else the API key, else open.
        key = admin_api_key or api_key
        return key is None or _token_matches(request, key)
    return api_key is None or _token_matches(request, api_key)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def auth_middlewares(api_key: str | None, admin_api_key: str | None) -> list[Any]:
    """The middleware that answers 401 `{"error": "Unauthorized"}` (SGLang's), if a key
    is set; no middleware at all otherwise."""
    if not api_key and not admin_api_key:
        return []

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not allowed(request, api_key or None, admin_api_key or None):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return [authenticate]

"""What the mock engine servers share: generation state, injected faults, admin routes.

The mock SGLang and vLLM servers stand in for GPU engines in tests. Tests steer them
through a small admin API on the same port (all under `/testkit/`):

- `POST /testkit/faults` `{"kind", "status"?, "after_tokens"?, "count"?, "message"?}` queues
  a fault for the next `count` generate requests (`count: -1` = every request until
  cleared); `DELETE /testkit/faults` clears the queue. Kinds:
  - `http_error`: answer with HTTP `status` and the engine's native error body;
  - `drop`: after `after_tokens` tokens, drop the TCP connection mid-stream;
  - `no_terminal`: after `after_tokens` tokens, end the response without a terminal chunk
    (and without `[DONE]`);
  - `done_early`: after `after_tokens` tokens, send `data: [DONE]` without a terminal chunk;
  - `hang`: after `after_tokens` tokens, send nothing more until the client goes away or
    the request is aborted;
  - `abort`: after `after_tokens` tokens, finish with the engine's abort finish reason
    carrying `status` (0 = none) and `message`.
- `POST /testkit/config` `{"token_delay_ms"?, "healthy"?}` changes the per-token delay, or
  makes `/health` fail (a down engine).
- `GET /testkit/state`: `{"received", "completed", "running": [ids], "aborted": [ids],
  "disconnected": [ids], "abort_calls", "faults_pending"}`: what a test asserts on.
  `abort_calls` lists every abort call (SGLang `/abort_request`, vLLM `/abort_requests`) as
  `{"ids": [...] ("*" for SGLang's abort_all), "at": <Unix time it arrived>}`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import asdict

from aiohttp import web

from genmesh.engines.faults import Fault, ServerState

STATE = web.AppKey("testkit_state", ServerState)


def add_admin_routes(app: web.Application, state: ServerState) -> None:
    app[STATE] = state
    app.router.add_post("/testkit/faults", _add_fault)
    app.router.add_delete("/testkit/faults", _clear_faults)
    app.router.add_post("/testkit/config", _config)
    app.router.add_get("/testkit/state", _state)


async def _add_fault(request: web.Request) -> web.Response:
    try:
        fault = Fault.from_json(await request.json())
    except ValueError as exc:
        return web.json_response({"error": str(exc)}, status=400)
    request.app[STATE].faults.append(fault)
    return web.json_response(asdict(fault))


async def _clear_faults(request: web.Request) -> web.Response:
    request.app[STATE].faults.clear()
    return web.Response()


async def _config(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        body = await request.json()
    except ValueError:
        return web.json_response({"error": "send a JSON object"}, status=400)
    if not isinstance(body, dict):
        return web.json_response({"error": "send a JSON object"}, status=400)
    if "token_delay_ms" in body:
        state.token_delay_s = float(body["token_delay_ms"]) / 1000
    if "healthy" in body:
        state.healthy = bool(body["healthy"])
    return web.json_response(state.snapshot())


async def _state(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE].snapshot())


@contextlib.asynccontextmanager
async def serving(
    app: web.Application, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[str]:
    """Serve `app` in this event loop (port 0 = any free port); yields its base URL."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_port = runner.addresses[0][1]
        yield f"http://{host}:{bound_port}"
    finally:
        await runner.cleanup()

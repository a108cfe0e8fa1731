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

from dataclasses import asdict, dataclass

from aiohttp import web

from genmesh.engines.faults import Fault, ServerState
from genmesh.shared.connection import LOG_LEVELS
from genmesh.shared.settings import group, non_negative_float, option, positive_int


@dataclass(frozen=True, slots=True)
class MockServerConfig:
    """Settings of a mock engine server (`genmesh testkit sglang|vllm --help`)."""

    # Own variables: a mock engine beside a frontend must not take the frontend's model.
    model: str = option("genmesh-mock", env="GENMESH_TESTKIT_MODEL", help="served model name")
    vocab_size: int = option(151_936, parse=positive_int, help="vocabulary")
    eos_token_id: int = option(151_645, help="EOS token id")
    max_model_len: int = option(32_768, parse=positive_int, help="context length")
    token_delay_ms: float = option(0.0, parse=non_negative_float, help="per token")
    # SGLang: --incremental-streaming-output (deltas) instead of cumulative chunks.
    incremental: bool = option(False, help="SGLang: incremental (delta) streaming output")
    # vLLM: --tokens-only, which also registers POST /abort_requests.
    tokens_only: bool = option(
        True, flag="--no-tokens-only", help="vLLM: without --tokens-only (no /abort_requests)"
    )


@dataclass(frozen=True, slots=True)
class TestkitConfig:
    """`genmesh testkit`: which engine to mock, where, and how it behaves."""

    __test__ = False  # not a pytest test class, whatever its name

    engine: str = option(
        positional=True, env=None, choices=("sglang", "vllm"), help="which engine to mock"
    )
    # Own variables: a mock engine beside a frontend must not take the frontend's address.
    host: str = option("127.0.0.1", env="GENMESH_TESTKIT_HOST", help="listen address")
    port: int = option(30000, env="GENMESH_TESTKIT_PORT", help="HTTP port")
    server: MockServerConfig = group(MockServerConfig())
    log_level: str = option("warning", choices=LOG_LEVELS, help="log level")


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

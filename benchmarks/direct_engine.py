"""The direct-engine baseline: SGLang /generate served by genmesh's MockEngine in-process.

    python benchmarks/direct_engine.py --port 8100 [--host 127.0.0.1] [--speedup 0]

One aiohttp server, no NATS, no router, no worker process. It reuses the project's own
pieces, so that comparing it with the mesh isolates what the mesh adds (NATS hops, msgpack,
two extra processes):

- the request is bound by `SglangFormat.bind(...)` and gets a private ID, as in the frontend;
- `MockEngine.generate(envelope)` runs in this process; each `EngineOutput` becomes a frame
  shaped like the worker's (`Worker._output_frame`);
- frames are rendered by the format's exchange, written as SSE events with the frontend's
  own `dumps`/`sse_event`, or folded into a unary body with `Merger(merge_rules)`.

The mesh-only parts are left out on purpose: readiness checks, the `ack` frame, keep-alives.
`GET /health` answers 200 so that the benchmark can wait for the server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator

from aiohttp import web

from genmesh.formats.base import Exchange, RequestRejected
from genmesh.formats.merge import Merger
from genmesh.formats.sglang import SglangFormat
from genmesh.services.frontend.generate import SSE_DONE, SSE_HEADERS, dumps, sse_event
from genmesh.services.worker.engines.base import EngineOutput
from genmesh.services.worker.engines.mock import MockConfig, MockEngine
from genmesh.shared import frames
from genmesh.shared.errors import ErrorCode, MeshError, http_status
from genmesh.shared.ids import new_public_id, new_request_id

log = logging.getLogger("direct_engine")

BODY_LIMIT_BYTES = 32 * 1024 * 1024  # the frontend's default --body-limit-mb


def output_frame(rid: str, seq: int, out: EngineOutput) -> frames.Frame:
    """The frame a worker would send for `out` (mirrors `Worker._output_frame` and `_send`)."""
    frame: frames.Frame = {
        "t": frames.END if out.finish is not None else frames.OUT,
        "id": rid,
        "tokens": out.tokens,
    }
    if out.logprobs is not None:
        frame["logprobs"] = out.logprobs
    if out.top_logprobs is not None:
        frame["top_logprobs"] = out.top_logprobs
    if out.prompt_logprobs is not None:
        frame["prompt_logprobs"] = out.prompt_logprobs
    if out.prompt_top_logprobs is not None:
        frame["prompt_top_logprobs"] = out.prompt_top_logprobs
    if out.cached_tokens is not None:
        frame["cached_tokens"] = out.cached_tokens
    if out.engine:
        frame["engine"] = out.engine
    if out.finish is not None:
        frame["finish"] = out.finish
        frame["usage"] = out.usage or {}
    frame["seq"] = seq
    return frame


class DirectGenerate:
    def __init__(self, engine: MockEngine) -> None:
        # As `load_generate_formats` builds it (the constructor takes the routes).
        self.format = SglangFormat(SglangFormat.default_routes())
        self.engine = engine

    async def __call__(self, request: web.Request) -> web.StreamResponse:
        received_at = time.monotonic()
        body = await request.read()
        try:
            bound = self.format.bind(body, request.headers)
        except RequestRejected as rejected:
            return web.json_response(rejected.body, status=rejected.status, dumps=dumps)
        public_id = bound.client_id or new_public_id()
        headers = {"x-request-id": public_id}
        envelope = bound.envelope
        envelope.id = new_request_id()
        exchange = self.format.exchange(bound, public_id, received_at)
        outputs = self.engine.generate(envelope)
        # Closed on every way out, as the frontend closes its reply stream: the engine's
        # generator is cancelled with the handler when the client disconnects.
        async with contextlib.aclosing(outputs):  # type: ignore[type-var]
            try:
                if bound.stream:
                    return await self._stream(request, outputs, exchange, headers, envelope.id)
                return await self._unary(outputs, exchange, headers, envelope.id)
            except MeshError as exc:
                # Raised before any output (the engine's checks): a plain JSON error.
                status = http_status(exc.code)
                return web.json_response(
                    exchange.error(exc, status), status=status, headers=headers, dumps=dumps
                )

    async def _unary(
        self,
        outputs: AsyncIterator[EngineOutput],
        exchange: Exchange,
        headers: dict[str, str],
        rid: str,
    ) -> web.StreamResponse:
        merger = Merger(self.format.merge_rules)
        seq = 1  # seq 0 would be the worker's ack
        async for out in outputs:
            for chunk in exchange.render(output_frame(rid, seq, out)):
                merger.add(chunk)
            seq += 1
            if out.finish is not None:
                return web.json_response(merger.result(), headers=headers, dumps=dumps)
        raise MeshError(ErrorCode.INTERNAL, "engine ended without a finish reason")

    async def _stream(
        self,
        request: web.Request,
        outputs: AsyncIterator[EngineOutput],
        exchange: Exchange,
        headers: dict[str, str],
        rid: str,
    ) -> web.StreamResponse:
        response: web.StreamResponse | None = None
        seq = 1
        try:
            async for out in outputs:
                frame = output_frame(rid, seq, out)
                seq += 1
                if response is None:
                    # The status is committed only now, so errors before any output keep theirs.
                    response = web.StreamResponse(headers={**SSE_HEADERS, **headers})
                    await response.prepare(request)
                data = sse_event(exchange.render(frame))
                if out.finish is not None:
                    await response.write(data + SSE_DONE)
                    break
                await response.write(data)
            else:
                raise MeshError(ErrorCode.INTERNAL, "engine ended without a finish reason")
        except MeshError as exc:
            if response is None:
                raise
            error = exchange.error(exc, http_status(exc.code))
            await response.write(sse_event([error]) + SSE_DONE)
        assert response is not None
        await response.write_eof()
        return response


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


def build_app(engine: MockEngine) -> web.Application:
    app = web.Application(client_max_size=BODY_LIMIT_BYTES)
    handler = DirectGenerate(engine)
    for route in handler.format.routes:
        app.router.add_route(route.method, route.path, handler)
    app.router.add_get("/health", health)
    return app


async def wait_for_stop_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def serve(host: str, port: int, speedup: float) -> None:
    engine = MockEngine(MockConfig(speedup=speedup))
    await engine.start()
    # As in the frontend: a client that disconnects cancels its handler (and the generation).
    runner = web.AppRunner(build_app(engine), handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        log.info("direct engine listening on http://%s:%d (speedup %g)", host, port, speedup)
        await wait_for_stop_signal()
    finally:
        await runner.cleanup()
        await engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--speedup", type=float, default=0.0, help="mock speed-up; 0 = instant")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s direct %(levelname)s %(name)s: %(message)s",
    )
    try:
        asyncio.run(serve(args.host, args.port, args.speedup))
    except OSError as exc:
        print(f"direct_engine: {exc.strerror or exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

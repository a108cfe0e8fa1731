"""The direct-engine baseline: genmesh's own frontend with the mock engine in-process.

    python benchmarks/direct_engine.py --port 8100 [--host 127.0.0.1] [--speedup 0]
        [--format sglang]

The same aiohttp app, format, handler and engine as the mesh, but the handler's backend is
`LocalBackend`, which runs the engine in this process instead of dispatching over NATS to
a router and a worker. The difference between this and the mesh is therefore exactly what
the mesh adds: NATS hops, msgpack, the router and the worker process.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from aiohttp import web

from genmesh.engines.mock import MockConfig, MockEngine
from genmesh.formats.catalog import load_generate_formats
from genmesh.services.frontend.app import build_app
from genmesh.services.frontend.local import LocalBackend
from genmesh.services.frontend.state import FrontendState
from genmesh.shared.connection import EVENT_LOOPS
from genmesh.shared.lifecycle import stop_signals
from genmesh.shared.loop import run

BODY_LIMIT_BYTES = 32 * 1024 * 1024  # the frontend's default --body-limit-mb


async def serve(host: str, port: int, speedup: float, fmt: str) -> None:
    engine = MockEngine(MockConfig(speedup=speedup))
    state = FrontendState(
        backend=LocalBackend(engine),
        namespace="direct",
        default_model=engine.config.model,
        started=time.time(),
    )
    app = build_app(state, load_generate_formats(fmt), body_limit_bytes=BODY_LIMIT_BYTES)
    # As the frontend does: a disconnect cancels the handler, and with it the engine.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    async with stop_signals() as stop:
        try:
            await web.TCPSite(runner, host, port).start()
            logging.getLogger("direct_engine").info("listening on http://%s:%d", host, port)
            await stop.wait()
        finally:
            await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--speedup", type=float, default=0.0, help="mock speed-up; 0 = instant")
    parser.add_argument("--format", default="sglang", help="the generate format to serve")
    parser.add_argument("--log-level", default="warning")
    # The mesh's services run on uvloop unless told otherwise; so does their baseline.
    parser.add_argument("--event-loop", default="uvloop", choices=EVENT_LOOPS)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s direct %(levelname)s %(name)s: %(message)s",
    )
    run(serve(args.host, args.port, args.speedup, args.format), args.event_loop)
    return 0


if __name__ == "__main__":
    sys.exit(main())

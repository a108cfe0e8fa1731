"""Faithful mock engine servers (SGLang, vLLM) for tests and demos without a GPU.

    genmesh testkit sglang --port 30000 [--incremental] [--token-delay-ms 5]
    genmesh testkit vllm --port 8100 [--no-tokens-only]

Both generate with genmesh's deterministic token model (the same tokens the mock worker
engine produces) and take injected faults through `/testkit/...` admin routes
(`genmesh.testkit.common`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web


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

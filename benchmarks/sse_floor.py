"""The HTTP floor: an aiohttp server on uvloop that answers `/generate` at once with the
SSE stream genmesh sends for 16 tokens, in the writes genmesh makes (headers with the
first event, then the last event with `[DONE]` and the chunked body's end).

    python benchmarks/sse_floor.py --port 8101

Driven at c=1 next to `direct_engine.py` (genmesh's frontend, engine in-process) and a
mesh, it says what the load generator and the HTTP edge cost on their own
(docs/performance.md, "c=1: where the time goes").
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from aiohttp import web

from genmesh.shared.loop import run

FIRST = (
    b'data: {"output_ids":[11755],"meta_info":{"id":"738ba1ae75509c543a6ff4f45b4c99b2",'
    b'"finish_reason":null,"prompt_tokens":6,"completion_tokens":1,"cached_tokens":0}}\n\n'
)
LAST = (
    b'data: {"output_ids":[62782,136445,146676,125090,12793,136388,130560,96677,103909,'
    b'59345,69972,94702,101827,146477,89182],"meta_info":{"id":"738ba1ae75509c543a6ff4f45b4c99b2",'
    b'"finish_reason":{"type":"length","length":16},"prompt_tokens":6,"completion_tokens":16,'
    b'"cached_tokens":0,"e2e_latency":0.002971}}\n\ndata: [DONE]\n\n'
)


class _HeadersWithFirstWrite(web.StreamResponse):
    _send_headers_immediately = False  # as genmesh's SseResponse


async def generate(request: web.Request) -> web.StreamResponse:
    await request.read()
    response = _HeadersWithFirstWrite(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    await response.write(FIRST)
    await response.write_eof(LAST)
    return response


async def serve(host: str, port: int) -> None:
    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        await asyncio.Event().wait()  # until interrupted
    finally:
        await runner.cleanup()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    a = parser.parse_args()
    try:
        run(serve(a.host, a.port), "uvloop")
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

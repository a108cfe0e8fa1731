"""What tracing costs per request, the mesh's own work left out: the frontend's, router's
and worker's tracing hooks for one 16-token request, and the export of their spans.

    .venv/bin/python benchmarks/bench_tracing_hooks.py [--requests 3000] [--repeats 5]
    .venv/bin/python benchmarks/bench_tracing_hooks.py --lag 10 [--rate 1000]

`bench_tracing.py` measures the whole mesh, where a request costs ~1.5 ms of CPU and a
shared machine moves that by more than the tracing costs; this runs, in one process, only
the calls the three services make into tracing for a request (the frontend's observer with
17 frames, its dispatch's headers (or attempt span, in a tree that has one per attempt),
the router's span, the worker's span over 17 frames), with the real SDK, batch span
processor and OTLP/HTTP exporter (`OTEL_*` as the services read them) sending to a
receiver in another process, in an event loop that gets a turn every 16 requests. The
figure is this process's CPU (all threads: the export thread too, after a flush) per
request, median of the repeats. `--lag S` measures instead, for S seconds, how late a
1 ms timer fires in that loop while `--rate` such requests a second make and export their
spans: the wait tracing's encoding and export put on every request a loop serves. It
imports whichever genmesh the interpreter has, so running it with another checkout's
interpreter measures that tree (the A/B).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from typing import Any

RECEIVER = """
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *a):
        pass
s = ThreadingHTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"""


def main(args: argparse.Namespace) -> None:
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER], stdout=subprocess.PIPE, text=True)
    assert receiver.stdout is not None
    port = receiver.stdout.readline().strip()
    os.environ.update(
        {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
            "OTEL_BSP_SCHEDULE_DELAY": str(args.bsp_delay_ms),
        }
    )
    try:
        run(args)
    finally:
        receiver.kill()


def run(args: argparse.Namespace) -> None:
    from genmesh.client import tracing as client_tracing
    from genmesh.client.tracing import attempt_span
    from genmesh.services.frontend.observers import RequestInfo
    from genmesh.services.frontend.traces import TraceObserver
    from genmesh.services.router.tracing import routed, router_span
    from genmesh.services.worker.tracing import worker_span
    from genmesh.shared import frames, tracing
    from genmesh.shared.discovery import WorkerInfo
    from genmesh.shared.envelope import Envelope

    assert tracing.configure("bench")
    tracer = tracing.tracer()
    assert tracer is not None
    # The frontend of this tree: one span per attempt, or only failed ones.
    per_attempt = not hasattr(client_tracing, "failed_attempt_span")
    # The worker of this tree: its span sees every frame, or only the first token and the end.
    counted_by_worker = hasattr(tracing.FrameSpan, "first_token")
    worker = WorkerInfo("w-bench", "genmesh.bench.worker.w-bench.generate", {}, 0.0, 0, 1)
    subject_router = "genmesh.bench.router.generate"
    subject_worker = "genmesh.bench.worker.w-bench.generate"
    reply = [{"t": "ack", "id": "x", "seq": 0, "worker": "w-bench", "dispatch": "d-1"}]
    reply += [{"t": "out", "id": "x", "seq": i + 1, "tokens": [i]} for i in range(15)]
    reply += [{"t": "end", "id": "x", "seq": 16, "tokens": [15], "finish": {"reason": "length"}}]
    parsed = [frames.parse(dict(f))[1] for f in reply]
    observer = TraceObserver(tracer)

    def one(n: int) -> None:
        envelope = Envelope(id=f"{n:032x}", token_ids=list(range(32)), format="sglang")
        # Frontend: the server span, current in the handler's task.
        info = RequestInfo("sglang", "POST", "/generate", time.monotonic(), time.time())
        info.items = [envelope]
        info.public_id = f"p{n}"
        request = observer.request(info)
        request.dispatched(info)
        attempt = attempt_span(envelope, subject_router) if per_attempt else None
        if attempt is not None:
            headers = tracing.inject({}, attempt.span)
        else:
            headers = tracing.inject_current({})
        # Router: a span from the request's headers, ended with the forward.
        hop = router_span(headers, subject_router, envelope, "round_robin", "r-bench")
        assert hop is not None
        forwarded = routed(hop, worker, [worker], headers)
        # Worker: its span, under the context its request carried; 17 frames.
        with tracing.remote_parent(forwarded):
            span = worker_span(subject_worker, envelope, "w-bench", "mock", "d-1")
        assert span is not None
        if counted_by_worker:  # the worker counts the tokens; its span sees no frame
            span.first_token()
            span.end(parsed[-1], tokens=16)
        else:
            for frame in parsed:
                span.frame(frame)
        # Back at the frontend: the frames, then the request's end.
        for frame in parsed:
            if attempt is not None:
                attempt.frame(frame)
            request.frame(0, frame)  # type: ignore[arg-type]
        request.finished(200, None)

    provider = tracing._provider
    assert provider is not None

    async def requests(count: int) -> None:
        """`count` requests in an event loop that gets a turn every 16 (a service's loop
        turns between requests: a tree whose spans the loop encodes does it there)."""
        for n in range(count):
            one(n)
            if n % 16 == 15:
                await asyncio.sleep(0)

    async def measure() -> list[float]:
        await requests(300)  # warm-up
        provider.force_flush()
        figures = []
        for repeat in range(args.repeats):
            started = time.process_time()
            await requests(args.requests)
            provider.force_flush()
            figures.append((time.process_time() - started) / args.requests * 1e6)
            print(f"  run {repeat + 1}: {figures[-1]:.1f} us CPU/request", file=sys.stderr)
        return figures

    tree = os.path.dirname(os.path.dirname(os.path.dirname(tracing.__file__)))
    if args.lag:
        asyncio.run(lag(requests, args.lag, args.rate, tree))
        tracing.shutdown()
        return
    figures = asyncio.run(measure())
    print(
        f"tracing hooks + export per request ({tree}; "
        f"{'an attempt span per attempt' if per_attempt else 'no attempt span'}): "
        f"{statistics.median(figures):.1f} us CPU (median of {args.repeats}, "
        f"min {min(figures):.1f})"
    )
    tracing.shutdown()


async def lag(requests: Any, seconds: float, rate: int, tree: str) -> None:
    """How late a 1 ms timer fires in the loop while `rate` requests a second make their
    spans and have them exported: what tracing's encoding and export make the event
    loop, and so every request it serves, wait."""
    stop = asyncio.Event()

    async def produce() -> None:
        while not stop.is_set():
            await requests(rate // 100)  # a hundredth of a second's requests
            await asyncio.sleep(0.01)

    producer = asyncio.create_task(produce())
    late: list[float] = []
    ends = time.monotonic() + seconds
    while time.monotonic() < ends:
        started = time.perf_counter()
        await asyncio.sleep(0.001)
        late.append((time.perf_counter() - started - 0.001) * 1e3)
    stop.set()
    await producer
    late.sort()

    def at(q: float) -> float:
        return late[min(len(late) - 1, int(len(late) * q))]

    print(
        f"event loop lateness with {rate} traced requests/s ({tree}), {len(late)} ticks: "
        f"p50 {at(0.5):.2f} ms, p99 {at(0.99):.2f}, p99.9 {at(0.999):.2f}, max {late[-1]:.2f}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bsp-delay-ms", type=int, default=5000)
    parser.add_argument(
        "--lag",
        type=float,
        default=0,
        help="seconds: measure instead how late a 1 ms timer fires in the event loop while "
        "--rate requests a second make and export their spans",
    )
    parser.add_argument("--rate", type=int, default=1000, help="requests a second (--lag)")
    main(parser.parse_args())

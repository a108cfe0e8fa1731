"""One span's CPU, the SDK's against genmesh's own (shared/spans.py), same work.

    .venv/bin/python benchmarks/bench_spans.py [--spans 20000] [--repeats 5]

Each span is what a worker span does for a request: `start_span` (CONSUMER, a remote
parent, ten attributes), a `first_token` event, two `set_attributes`, a `finish` event
with two attributes, `end` into the batch queue. Then, separately, the OTLP encoding of
the ended spans (`otlp.encode_spans`, what the export thread does). The batch thread is
kept idle (a one-hour delay, a queue bigger than the run) so that only the event loop's
side is timed; the figures are CPU (process_time) per span, medians of the repeats,
alternating SDK and light in one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

os.environ.update({"OTEL_BSP_SCHEDULE_DELAY": "3600000", "OTEL_BSP_MAX_QUEUE_SIZE": "1000000"})

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import _get_from_env_or_default
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags

from genmesh.shared.otlp import encode_spans
from genmesh.shared.spans import LightTracerProvider


class Keep:
    """An exporter that keeps what it is given (never called while timing)."""

    def __init__(self) -> None:
        self.spans: list[Any] = []

    def export(self, spans: Any) -> None:
        self.spans.extend(spans)

    def shutdown(self) -> None:
        pass


PARENT = trace.set_span_in_context(
    NonRecordingSpan(
        SpanContext(1 << 100, 1 << 60, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    )
)


def one(tracer: Any, n: int) -> None:
    span = tracer.start_span(
        "process genmesh.bench.worker.w-1.generate",
        PARENT,
        kind=SpanKind.CONSUMER,
        attributes={
            "messaging.system": "nats",
            "messaging.destination.name": "genmesh.bench.worker.w-1.generate",
            "messaging.operation.name": "process",
            "messaging.operation.type": "process",
            "genmesh.worker": "w-1",
            "genmesh.engine": "mock",
            "genmesh.request_id": f"{n:032x}",
            "genmesh.dispatch_id": "d-1",
            "genmesh.attempt": 1,
            "genmesh.format": "sglang",
        },
    )
    span.add_event("first_token")
    finish = {"genmesh.tokens.output": 16, "genmesh.finish_reason": "length"}
    span.add_event("finish", finish)
    span.set_attributes(finish)
    span.set_attributes({"genmesh.worker": "w-1", "genmesh.dispatch_id": "d-1"})
    span.end()


def main(args: argparse.Namespace) -> None:
    resource = Resource.create({"service.name": "bench"})
    sdk_keep, light_keep = Keep(), Keep()
    sdk = TracerProvider(resource=resource)
    sdk_processor = BatchSpanProcessor(sdk_keep)  # type: ignore[arg-type]
    sdk.add_span_processor(sdk_processor)
    light = LightTracerProvider(_get_from_env_or_default(), resource, [light_keep])
    tracers = {"sdk": sdk.get_tracer("genmesh", "0"), "light": light.get_tracer("genmesh", "0")}
    flush = {"sdk": sdk.force_flush, "light": light.force_flush}
    keeps = {"sdk": sdk_keep, "light": light_keep}
    spans: dict[str, list[float]] = {k: [] for k in tracers}
    encode: dict[str, list[float]] = {k: [] for k in tracers}
    for name in tracers:  # warm-up
        for n in range(1000):
            one(tracers[name], n)
        flush[name]()
        keeps[name].spans.clear()
    for repeat in range(args.repeats):
        for name in tracers if repeat % 2 == 0 else reversed(list(tracers)):
            tracer = tracers[name]
            started = time.process_time()
            for n in range(args.spans):
                one(tracer, n)
            spans[name].append((time.process_time() - started) / args.spans * 1e6)
            flush[name]()
            ended = keeps[name].spans
            started = time.process_time()
            for i in range(0, len(ended), 512):
                encode_spans(ended[i : i + 512])
            encode[name].append((time.process_time() - started) / len(ended) * 1e6)
            ended.clear()
    print(f"per span, CPU, median of {args.repeats} x {args.spans} spans ({sys.executable})")
    for name in tracers:
        print(
            f"  {name:<5} lifecycle {statistics.median(spans[name]):5.1f} us"
            f"   OTLP encoding {statistics.median(encode[name]):5.1f} us"
        )
    sdk.shutdown()
    light.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spans", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    main(parser.parse_args())

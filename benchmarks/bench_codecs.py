"""Wire bytes and encode + decode time of the bus codecs, and of the SGLang client codec.

    .venv/bin/python benchmarks/bench_codecs.py [--tokens 4096] [--layers 48] [--top-k 8]

Two payloads, made by genmesh's own mock engine so that token ids and expert ids look
like an engine's:

- a request: the envelope of a `--tokens`-token prompt, as a router or worker receives it;
- a response: the `--tokens` reply frames of a generation with routed experts (one token
  and one row of `--layers` x `--top-k` expert ids per frame, as workers stream them),
  and the unary SGLang body a client receives (`output_ids` + `meta_info.routed_experts`).

Every figure is the median of `--repeats` runs, measured side by side in one process.
Requires the b64zstd package (installed by `python3 dev.py ...`).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

import orjson

from genmesh.client import request
from genmesh.codecs import get_codec
from genmesh.engines.execute import execute
from genmesh.engines.mock import MockConfig, MockEngine
from genmesh.formats.catalog import load_generate_formats
from genmesh.formats.merge import Merger


def median_us(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


async def make_frames(
    tokens: int, layers: int, top_k: int
) -> tuple[list[int], list[dict[str, Any]]]:
    engine = MockEngine(MockConfig(moe_layers=layers, moe_top_k=top_k, moe_experts=128))
    prompt = [(i * 7919) % 150_000 for i in range(1, tokens + 1)]
    envelope = request(prompt, max_tokens=tokens, ignore_eos=True)
    envelope.id = "0" * 32
    envelope.output.routed_experts_start = len(prompt) - 1  # only the generated positions
    frames = []
    async for frame in execute(engine, envelope):
        frame["seq"] = len(frames) + 1
        frames.append(frame)
    return prompt, frames


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()

    prompt, frames = asyncio.run(make_frames(args.tokens, args.layers, args.top_k))
    envelope = request(prompt, max_tokens=args.tokens).to_wire()
    wire = {name: get_codec(name) for name in ("msgpack", "json", "b64zstd")}

    print(
        f"bus codecs: a {args.tokens}-token request envelope, and a {args.tokens}-token "
        f"response streamed as {len(frames)} frames with routed experts "
        f"({args.layers} layers x top-{args.top_k}); median of {args.repeats}"
    )
    print(f"{'payload':<34}{'codec':<9}{'bytes':>11}{'encode us':>12}{'decode us':>12}")
    for name, codec in wire.items():
        data = codec.encode(envelope)
        enc = median_us(lambda c=codec: c.encode(envelope), args.repeats)
        dec = median_us(lambda c=codec, d=data: c.decode(d), args.repeats)
        print(f"{'request envelope':<34}{name:<9}{len(data):>11,}{enc:>12,.0f}{dec:>12,.0f}")
    for name, codec in wire.items():
        blobs = [codec.encode(f) for f in frames]
        enc = median_us(lambda c=codec: [c.encode(f) for f in frames], args.repeats)
        dec = median_us(lambda c=codec, b=blobs: [c.decode(x) for x in b], args.repeats)
        size = sum(len(b) for b in blobs)
        print(f"{'response frames (sum)':<34}{name:<9}{size:>11,}{enc:>12,.0f}{dec:>12,.0f}")

    print()
    print("SGLang HTTP bodies: plain sglang vs the sglang+b64zstd client codec")
    print(f"{'payload':<34}{'format':<16}{'bytes':>11}{'render+fold us':>16}")
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": args.tokens}}
    for fmt in (load_generate_formats("sglang")[0], load_generate_formats("sglang+b64zstd")[0]):
        request_body = orjson.dumps(body)
        if fmt.name.endswith("b64zstd"):
            from genmesh_b64zstd.client import encode_int32

            request_body = orjson.dumps({**body, "input_ids": encode_int32(prompt)})
        print(f"{'request body':<34}{fmt.name:<16}{len(request_body):>11,}{'':>16}")

        def render_and_fold(fmt: Any = fmt) -> bytes:
            raw = orjson.dumps({**body, "return_routed_experts": True,
                                "routed_experts_start_len": len(prompt) - 1})  # fmt: skip
            bound = fmt.bind(fmt.parse(raw), {})
            exchange = fmt.exchange(bound, "public-id", time.monotonic())
            merger = Merger(fmt.merge_rules, fmt.joiners)
            for frame in frames:
                merger.add(exchange.render(0, frame))
            return orjson.dumps(exchange.body([merger.result()]))

        response_body = render_and_fold()
        cost = median_us(render_and_fold, args.repeats)
        print(f"{'unary response body':<34}{fmt.name:<16}{len(response_body):>11,}{cost:>16,.0f}")


if __name__ == "__main__":
    main()

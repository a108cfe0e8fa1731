"""What a worker's ZMQ subscription to a real engine's KV events costs, per batch.

    .venv/bin/python benchmarks/bench_kv_zmq.py [--batches 20000] [--blocks 4] [--block-size 16]

The testkit's `ZmqEventPublisher` (the engines' PUB framing) sends `--batches` batches,
each one `BlockStored` of `--blocks` blocks of `--block-size` tokens, in each engine's
encoding (SGLang: a page per event; vLLM 0.20: one positional event with medium,
lora_name and extra_keys); the worker's `ZmqKvEvents` (engines/zmq_events.py) receives,
checks the seq of and decodes every one. Both run in this process, over TCP on loopback,
so the figure is the whole CPU of both sides: an upper bound of the worker's share.
Printed: batches per second and µs per batch (median of `--repeats` runs), and the decode
alone (`decode_engine_batch`) for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import statistics
import time

from genmesh.engines.zmq_events import ZmqEventsConfig, ZmqKvEvents
from genmesh.shared.envelope import TokenIds
from genmesh.shared.kv_events import (
    BlockStored,
    KvEventBatch,
    decode_engine_batch,
    encode_engine_batch,
)
from genmesh.testkit.kv_cache import sglang_events
from genmesh.testkit.kv_events import SglangKvEventsConfig, ZmqEventPublisher


def make_batch(n: int, blocks: int, size: int, engine: str) -> KvEventBatch:
    tokens = TokenIds((n * 7919 + i) % 150_000 for i in range(blocks * size))
    hashes: list[int | bytes] = [(n * blocks + i) & ((1 << 63) - 1) for i in range(blocks)]
    stored = BlockStored(hashes, None, tokens, size, medium="GPU")
    if engine == "sglang":
        return KvEventBatch(time.time(), sglang_events([stored]))
    return KvEventBatch(time.time(), [stored], 0)


async def run_once(batches: list[KvEventBatch], engine: str) -> float:
    """Seconds from the first publish until the subscriber has decoded every batch."""
    encode = (
        encode_engine_batch
        if engine == "sglang"
        else functools.partial(encode_engine_batch, array_like=True, vllm=True)
    )
    config = SglangKvEventsConfig(publisher="zmq", endpoint="tcp://127.0.0.1:*")
    publisher = ZmqEventPublisher(config, encode)
    publisher.start()
    events = ZmqKvEvents(ZmqEventsConfig(endpoint=publisher.endpoint))
    got = 0
    first = asyncio.Event()
    done = asyncio.Event()

    async def consume() -> None:
        nonlocal got
        async for _ in events.batches():
            got += 1
            first.set()
            if got == len(batches) + 1:
                done.set()

    task = asyncio.create_task(consume())
    try:
        while not first.is_set():  # the SUB socket has joined (ZMQ's slow joiner)
            publisher.publish(batches[0])
            await asyncio.sleep(0.01)
        got = 1  # the clear for what it missed while joining, if any, is not counted
        started = time.perf_counter()
        for i, batch in enumerate(batches):
            publisher.publish(batch)
            if i % 256 == 255:
                await asyncio.sleep(0)  # let the subscriber run, as a real engine's steps do
        await done.wait()
        return time.perf_counter() - started
    finally:
        events.close()
        await asyncio.wait_for(task, 5)
        await publisher.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    # Joining without a replay socket reports the batches it missed as lost: expected here.
    logging.getLogger("genmesh.engines.zmq_events").setLevel(logging.ERROR)
    print(
        f"{args.batches} batches of one BlockStored of {args.blocks} x {args.block_size} "
        f"tokens, median of {args.repeats} runs"
    )
    for engine in ("sglang", "vllm"):
        batches = [make_batch(n, args.blocks, args.block_size, engine) for n in range(args.batches)]
        runs = [asyncio.run(run_once(batches, engine)) for _ in range(args.repeats)]
        seconds = statistics.median(runs)
        encode = (
            encode_engine_batch
            if engine == "sglang"
            else functools.partial(encode_engine_batch, array_like=True, vllm=True)
        )
        payloads = [encode(b) for b in batches[-2000:]]
        started = time.perf_counter()
        for payload in payloads:
            decode_engine_batch(payload)
        decode_us = (time.perf_counter() - started) / len(payloads) * 1e6
        print(
            f"{engine:7s} relay in: {args.batches / seconds:9.0f} batches/s "
            f"{seconds / args.batches * 1e6:6.1f} µs/batch (both sides); "
            f"decode alone {decode_us:5.1f} µs/batch; payload {len(payloads[0])} bytes"
        )


if __name__ == "__main__":
    main()

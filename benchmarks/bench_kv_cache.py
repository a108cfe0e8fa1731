"""What the mock's prefix cache and the worker's KV event relay cost, per request and per
snapshot.

    .venv/bin/python benchmarks/bench_kv_cache.py [--blocks 512] [--block-size 16]

The workload is issue 13's: prompts of a 1,024-token group prefix plus a unique 32-token
suffix, 32 new tokens, groups drawn uniformly. Figures (medians of `--repeats` runs, in
one process):

- **pool**: one request's cache work in the mock (`BlockPool.open`, `prefilled`, one
  `extend` per generated token as at speed-up > 0, `release`), in µs, and the hit ratio;
- **relay**: per engine batch, the worker's mirror update, its `KvEventsMessage` and the
  msgpack encoding, in µs, with the message's bytes;
- **snapshot**: freezing a full cache of `--blocks` blocks and of 65,536 blocks into
  pages (the worker does it in a thread), in ms, with the pages and their encoded bytes.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from genmesh.codecs import get_codec
from genmesh.engines.prefix_cache import BlockPool
from genmesh.services.worker.kv_mirror import KvMirror
from genmesh.services.worker.kv_relay import PAGE_BYTES
from genmesh.shared.kv_events import KvEventsMessage, KvSnapshotPage

PREFIX, SUFFIX, OUTPUT = 1024, 32, 32


def median(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def prompts(groups: int, count: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(150_000) for _ in range(PREFIX)] for _ in range(groups)]
    return [
        rng.choice(prefixes) + [rng.randrange(150_000) for _ in range(SUFFIX)] for _ in range(count)
    ]


def full_mirror(blocks: int, block_size: int) -> KvMirror:
    """The mirror of a pool of `blocks` blocks that unique prompts filled up."""
    pool = BlockPool(blocks, block_size)
    mirror = KvMirror()
    count = blocks * block_size // PREFIX * 2
    for prompt in prompts(count, count, seed=2):
        request = pool.open(prompt)
        request.prefilled()
        request.release()
        mirror.apply(pool.take_events())
    return mirror


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=512, help="blocks per worker's pool")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--groups", type=int, default=8, help="prefix groups in one worker")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    codec = get_codec(None)
    sample = prompts(args.groups, args.requests)

    batches: list[list[Any]] = []
    hits = [0, 0]

    def run_pool() -> None:
        pool = BlockPool(args.blocks, args.block_size)
        batches.clear()
        hits[:] = [0, 0]
        for prompt in sample:
            request = pool.open(prompt)
            request.prefilled()
            for token in range(OUTPUT):
                request.extend([token])
            request.release()
            hits[0] += request.cached_tokens
            hits[1] += len(prompt)
            batches.append(pool.take_events())

    per_request = median(run_pool, args.repeats) / len(sample) * 1e6
    print(
        f"pool     {per_request:8.1f} µs/request  (hit ratio {hits[0] / hits[1]:.2f}, "
        f"{args.blocks} blocks of {args.block_size}, {args.groups} groups, "
        f"{PREFIX}+{SUFFIX} prompt tokens, {OUTPUT} out)"
    )

    sizes: list[int] = []

    def run_relay() -> None:
        mirror = KvMirror()
        sizes.clear()
        for seq, events in enumerate(batches, start=1):
            mirror.apply(events)
            data = codec.encode(KvEventsMessage("w1", seq, 0.0, events).to_wire())
            sizes.append(len(data))

    per_batch = median(run_relay, args.repeats) / len(batches) * 1e6
    print(
        f"relay    {per_batch:8.1f} µs/batch    (median message {statistics.median(sizes):.0f} "
        f"bytes, largest {max(sizes)})"
    )

    for blocks in (args.blocks, 65_536):
        mirror = full_mirror(blocks, args.block_size)
        ms = median(lambda m=mirror: m.copy().pages(PAGE_BYTES), args.repeats) * 1e3
        pages = mirror.pages(PAGE_BYTES)
        encoded = [
            len(codec.encode(KvSnapshotPage("w1", "s", 1, i, len(pages), p).to_wire()))
            for i, p in enumerate(pages)
        ]
        print(
            f"snapshot {ms:8.1f} ms          ({len(mirror)} blocks: {len(pages)} pages, "
            f"largest {max(encoded)} bytes, {sum(encoded)} in all)"
        )


if __name__ == "__main__":
    main()

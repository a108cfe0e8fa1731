"""What the `kv` policy's index costs: memory, and the time of one routing decision,
against the number of cached blocks and of workers.

    .venv/bin/python benchmarks/bench_kv_index.py [--blocks 10000,100000,1000000]
        [--workers 4,16,64,256] [--lookups N]

For each combination it fills a `KvIndex` with that many distinct blocks spread evenly
over the workers, as the engines' KV events would (chains of 64 blocks of 16 tokens: a
1,024-token prompt each), then times, for a 1,056-token request whose 1,024-token prefix
one worker holds (the walk goes 64 blocks deep):

- `keys`: the request's 66 block keys (`request_block_keys`, XXH3 over the tokens);
- `walk`: `KvIndex.overlaps` over those keys;
- `choose`: all of `KvPolicy.choose` (keys, walk, costs, the pick) among every worker;
- `events`: what one request's KV events cost the router in this workload: a message as
  it comes off NATS (msgpack) storing 4 blocks (its 32-token suffix and 32 output tokens)
  chained to a held prefix, and one removing 4 blocks, decoded and applied.

Memory is what `tracemalloc` sees allocated by the index (its Python objects), in MB and
bytes per block. Prints a table; times are medians of 5 runs of `--lookups` decisions.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from genmesh.client import request
from genmesh.codecs import get_codec
from genmesh.routing.kv_policy import KvPolicy
from genmesh.routing.policies import KvConfig
from genmesh.shared.discovery import WorkerInfo
from genmesh.shared.engine_info import EngineInfo
from genmesh.shared.envelope import TokenIds
from genmesh.shared.kv_events import BlockRemoved, BlockStored, KvEventsMessage, request_block_keys

BLOCK = 16
CHAIN = 64  # blocks per stored prompt


def fill(policy: KvPolicy, blocks: int, workers: int) -> None:
    """`blocks` distinct blocks, `blocks // workers` per worker, in chains of `CHAIN`."""
    token = 0
    engine_hash = 0
    for w in range(workers):
        left = blocks // workers
        while left:
            n = min(CHAIN, left)
            tokens = TokenIds(range(token, token + n * BLOCK))
            hashes: list[int | bytes] = list(range(engine_hash, engine_hash + n))
            policy.index.apply(f"w{w:03d}", [BlockStored(hashes, None, tokens, BLOCK)])
            token += n * BLOCK
            engine_hash += n
            left -= n


def worker_infos(count: int) -> list[WorkerInfo]:
    infos = []
    for w in range(count):
        wid = f"w{w:03d}"
        card = {"id": wid, "kv_events": True}
        info = WorkerInfo(wid, f"genmesh.bench.worker.{wid}.generate", card, 0.0, w % 3, 256)
        info.engine_info = EngineInfo(model="m", block_size=BLOCK)
        infos.append(info)
    return infos


def per_call_us(call: Callable[[], Any], lookups: int) -> float:
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(lookups):
            call()
        runs.append((time.perf_counter() - start) / lookups * 1e6)
    return statistics.median(runs)


def measure(blocks: int, workers: int, lookups: int) -> dict[str, float]:
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    policy = KvPolicy(KvConfig())
    fill(policy, blocks, workers)
    size = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    # The last worker's first chain, plus a 32-token suffix nobody holds.
    first = (workers - 1) * (blocks // workers) * BLOCK
    held = min(CHAIN, blocks // workers) * BLOCK
    envelope = request([*range(first, first + held), *range(2**30, 2**30 + 32)])
    keys = request_block_keys(envelope, BLOCK)
    assert policy.index.overlaps(keys)[f"w{workers - 1:03d}"] == held // BLOCK
    infos = worker_infos(workers)
    codec = get_codec(None)
    last = f"w{workers - 1:03d}"
    parent = (workers - 1) * (blocks // workers) + held // BLOCK - 1  # engine hash
    new = BlockStored(list(range(-4, 0)), parent, TokenIds(range(4 * BLOCK)), BLOCK)
    store = codec.encode(KvEventsMessage(last, 1, 0.0, [new]).to_wire())
    remove = codec.encode(KvEventsMessage(last, 2, 0.0, [BlockRemoved([-4, -3, -2, -1])]).to_wire())

    def events() -> None:
        for payload in (store, remove):
            message = KvEventsMessage.from_wire(codec.decode(payload))
            policy.index.apply(message.worker, message.events)

    return {
        "mb": size / 1e6,
        "bytes_per_block": size / blocks,
        "keys_us": per_call_us(lambda: request_block_keys(envelope, BLOCK), lookups),
        "walk_us": per_call_us(lambda: policy.index.overlaps(keys), lookups),
        "choose_us": per_call_us(lambda: policy.choose(infos, envelope), lookups),
        "events_us": per_call_us(events, lookups),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", default="10000,100000,1000000")
    parser.add_argument("--workers", default="4,16,64,256")
    parser.add_argument("--lookups", type=int, default=2000)
    args = parser.parse_args()
    print(
        f"{'blocks':>9} {'workers':>7} {'MB':>8} {'B/block':>8} "
        f"{'keys us':>8} {'walk us':>8} {'choose us':>9} {'events us':>9}"
    )
    for blocks in (int(b) for b in args.blocks.split(",")):
        for workers in (int(w) for w in args.workers.split(",")):
            row = measure(blocks, workers, args.lookups)
            print(
                f"{blocks:>9} {workers:>7} {row['mb']:>8.1f} {row['bytes_per_block']:>8.0f} "
                f"{row['keys_us']:>8.1f} {row['walk_us']:>8.1f} {row['choose_us']:>9.1f} "
                f"{row['events_us']:>9.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()

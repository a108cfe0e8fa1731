"""A mock server's prefix cache and the KV events it publishes (with `--kv-events-config`).

The cache is the mock engine's `BlockPool` (engines/prefix_cache.py), sized as the server
reports itself: `max_total_num_tokens` tokens in blocks of `block_size` (SGLang's page
size, 1 by default; vLLM's 16). Its events leave once per scheduler step (a turn of the
event loop, as in the mock engine) through the engines' `ZmqEventPublisher`
(`testkit/kv_events.py`), in each engine's own form:

- **SGLang** (sglang/srt/mem_cache/radix_cache.py `_record_store_event`, and
  sglang/srt/disaggregation/kv_events.py): one `BlockStored` per page, its hash a signed
  64-bit int, its parent the previous page's; positional structs ending at `lora_id`
  (`BlockRemoved` at its hashes); a batch `[ts, events]`.
- **vLLM** (vllm/v1/core/block_pool.py, vllm/distributed/kv_events.py): one `BlockStored`
  per run of newly cached blocks, hashes as ints (the low 64 bits of the block's hash:
  `maybe_convert_block_hash` with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, the default),
  `medium` "GPU" and per-block `extra_keys`; positional structs, as the v0.20 server the
  testkit imitates sends them (vLLM switched the events to maps after v0.23, PR #42892);
  a batch `[ts, events, data_parallel_rank]`, the rank 0 that the publisher stamps.

Without `--kv-events-config` a mock server keeps no cache and reports `cached_tokens` 0,
as before.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

from genmesh.engines.prefix_cache import BlockPool, ExtraKeys, RequestBlocks
from genmesh.shared.envelope import TokenIds
from genmesh.shared.kv_events import (
    BlockRemoved,
    BlockStored,
    EngineHash,
    KvEvent,
    KvEventBatch,
    encode_engine_batch,
)
from genmesh.testkit.config import MockServerConfig
from genmesh.testkit.kv_events import ZmqEventPublisher, parse_kv_events_config

_U64 = (1 << 64) - 1


def vllm_hash(h: EngineHash) -> int:
    """vLLM's `maybe_convert_block_hash`: the hash's low 64 bits as an unsigned int."""
    return int.from_bytes(h, "big") & _U64 if isinstance(h, bytes) else h


def sglang_hash(h: EngineHash) -> int:
    """A signed 64-bit int, as SGLang's page hashes are."""
    return int.from_bytes(h[:8], "big", signed=True) if isinstance(h, bytes) else h


def vllm_events(events: list[KvEvent]) -> list[KvEvent]:
    out: list[KvEvent] = []
    for e in events:
        if isinstance(e, BlockStored):
            parent = None if e.parent_hash is None else vllm_hash(e.parent_hash)
            hashes: list[EngineHash] = [vllm_hash(h) for h in e.block_hashes]
            out.append(
                BlockStored(hashes, parent, e.token_ids, e.block_size, e.extra_keys, None, e.medium)
            )
        elif isinstance(e, BlockRemoved):
            out.append(BlockRemoved([vllm_hash(h) for h in e.block_hashes], e.medium))
        else:
            out.append(e)
    return out


def sglang_events(events: list[KvEvent]) -> list[KvEvent]:
    out: list[KvEvent] = []
    for e in events:
        if isinstance(e, BlockStored):
            parent = None if e.parent_hash is None else sglang_hash(e.parent_hash)
            size = e.block_size
            for i, h in enumerate(e.block_hashes):
                page = TokenIds(e.token_ids[i * size : (i + 1) * size])
                out.append(BlockStored([sglang_hash(h)], parent, page, size))
                parent = sglang_hash(h)
        elif isinstance(e, BlockRemoved):
            out.extend(BlockRemoved([sglang_hash(h)]) for h in e.block_hashes)
        else:
            out.append(e)
    return out


class ServerCache:
    """The prefix cache of one mock server, publishing its events."""

    def __init__(
        self,
        pool_size: tuple[int, int],
        publisher: ZmqEventPublisher,
        convert: Callable[[list[KvEvent]], list[KvEvent]],
        rank: int | None,
    ) -> None:
        blocks, block_size = pool_size
        self.pool = BlockPool(blocks, block_size, on_step=self._publish)
        self.publisher = publisher
        self._convert = convert
        self._rank = rank

    def open(self, prompt: Sequence[int], extra: ExtraKeys = None) -> RequestBlocks:
        return self.pool.open(prompt, extra)

    def clear(self) -> bool:
        return self.pool.clear()

    def _publish(self, events: list[KvEvent]) -> None:
        self.publisher.publish(KvEventBatch(time.time(), self._convert(events), self._rank))


def server_cache(engine: str, config: MockServerConfig, block_size: int) -> ServerCache | None:
    """`engine`'s cache and publisher when `config.kv_events_config` publishes; None
    otherwise. Raises ValueError for a config the engine would refuse."""
    if config.kv_events_config is None:
        return None
    settings = parse_kv_events_config(engine, config.kv_events_config)
    if not settings.publishes:
        return None
    encode: Callable[[KvEventBatch], bytes]
    if engine == "sglang":
        encode, convert, rank = encode_engine_batch, sglang_events, None
    else:
        encode = functools.partial(encode_engine_batch, array_like=True, vllm=True)
        convert, rank = vllm_events, 0
    blocks = max(config.max_total_num_tokens // block_size, 1)
    publisher = ZmqEventPublisher(settings, encode)
    return ServerCache((blocks, block_size), publisher, convert, rank)

"""KV cache events: what an engine stored in and evicted from its prefix cache.

Three shapes of the same facts live here, each with its codec:

- **The engine's**, as vLLM and SGLang publish them with `--kv-events-config` (ZMQ multipart
  `[topic, seq (8-byte big-endian), payload]`; the payload a msgpack `KVEventBatch`). Older
  vLLM and SGLang encode the batch and its events `array_like` (positional arrays, each
  event's first element its tag: `["BlockStored", hashes, parent, token_ids, block_size,
  lora_id, ...]`); vLLM after 0.23 (#42892) encodes the events as maps
  (`{"type": "BlockStored", "block_hashes": ...}`) in a batch that stays positional.
  `decode_engine_batch` reads both; trailing fields a version added are optional.
  (vllm/distributed/kv_events.py; sglang/srt/disaggregation/kv_events.py.)
- **genmesh's on NATS** (`genmesh.<ns>.kv.<wid>`, docs/protocol.md "KV events"): one
  message per engine batch, numbered per worker (`seq` 1, 2, ...), with the events in a
  fixed map form whatever the engine's version; and the snapshot pages a router asks for
  when it misses a message.
- **The router's block keys** (`block_keys`): its own chained 64-bit hashes of block
  contents. Engines hash blocks their own way (vLLM: sha256 or a salted hash; SGLang: its
  own), so a router can never recompute an engine's hash from a prompt; it keys its index
  on the token contents the stored events carry, hashed the same way it hashes a
  request's prompt, and maps the engine's hashes to its keys only to apply removals.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import xxhash

from genmesh.codecs.int32 import from_le_bytes, to_le_bytes
from genmesh.shared.envelope import Envelope, TokenIds
from genmesh.shared.multimodal import FeaturesError, MmItem, envelope_items

log = logging.getLogger(__name__)

# The card key of a worker that relays its engine's KV events (docs/protocol.md §13).
KV_EVENTS_CARD_KEY = "kv_events"

# An engine's block hash: an int (older vLLM, SGLang) or bytes (newer vLLM's sha256).
EngineHash = int | bytes


@dataclass(slots=True)
class BlockStored:
    """Consecutive full blocks stored, each the child of the one before; the first the
    child of `parent_hash` (None: it starts a sequence). `token_ids` holds every block's
    tokens, `block_size` each."""

    block_hashes: list[EngineHash]
    parent_hash: EngineHash | None
    token_ids: TokenIds
    block_size: int
    # Per block, what besides its tokens went into its hash (vLLM's `extra_keys`:
    # multimodal item hashes, LoRA name, cache salt); None: nothing, or not reported.
    extra_keys: list[tuple[Any, ...] | None] | None = None
    lora_id: int | None = None
    # Where the blocks live: None or "GPU" is the device cache; vLLM's offloading
    # connectors report "CPU" and others, which routing does not count.
    medium: str | None = None


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[EngineHash]
    medium: str | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KvEventBatch:
    ts: float
    events: list[KvEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None


class KvEventError(ValueError):
    """A payload that is not a KV event batch (the message says what is wrong)."""


# -- the engine's encoding (vLLM / SGLang msgpack) ------------------------------------------

_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
)
_REMOVED_FIELDS = ("block_hashes", "medium")


def _hash(value: Any, where: str) -> EngineHash:
    if isinstance(value, bool) or not isinstance(value, int | bytes):
        raise KvEventError(f"{where}: a block hash is an integer or bytes, got {value!r}")
    return value


_HASH_TYPES = frozenset((int, bytes))


def _hashes(value: Any, where: str) -> list[EngineHash]:
    if not isinstance(value, list):
        raise KvEventError(f"{where}: block_hashes must be a list")
    # The types checked in one C pass (a stored prompt is ~66 hashes, every router
    # decodes every message); `bool`, an int subclass, is not among them.
    if not _HASH_TYPES.issuperset(map(type, value)):
        for h in value:
            _hash(h, where)
    return value


def _engine_event(raw: Any) -> KvEvent:
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag, values = raw[0], raw[1:]
        names = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS
        fields = dict(zip(names, values, strict=False))
    elif isinstance(raw, dict) and isinstance(raw.get("type"), str):
        tag, fields = raw["type"], raw
    else:
        raise KvEventError(f"not a tagged KV cache event: {raw!r:.80}")
    if tag == "BlockStored":
        size = fields.get("block_size")
        tokens = fields.get("token_ids")
        if not isinstance(size, int) or size < 1:
            raise KvEventError(f"BlockStored: block_size must be a positive integer: {size!r}")
        if not isinstance(tokens, list):
            raise KvEventError("BlockStored: token_ids must be a list")
        hashes = _hashes(fields.get("block_hashes"), tag)
        if len(tokens) != len(hashes) * size:
            raise KvEventError(
                f"BlockStored: {len(tokens)} token ids for {len(hashes)} blocks of {size}"
            )
        parent = fields.get("parent_block_hash")
        extra = fields.get("extra_keys")
        return BlockStored(
            block_hashes=hashes,
            parent_hash=None if parent is None else _hash(parent, tag),
            token_ids=TokenIds(tokens),
            block_size=size,
            extra_keys=[None if k is None else tuple(k) for k in extra] if extra else None,
            lora_id=fields.get("lora_id"),
            medium=fields.get("medium"),
        )
    if tag == "BlockRemoved":
        return BlockRemoved(_hashes(fields.get("block_hashes"), tag), fields.get("medium"))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise KvEventError(f"unknown KV cache event {tag!r}")


def decode_engine_batch(payload: bytes) -> KvEventBatch:
    """An engine's `KVEventBatch` (either encoding) as events."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise KvEventError(f"KV event batch is not msgpack: {exc}") from None
    if isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    else:
        raise KvEventError("KV event batch must be an array or a map")
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise KvEventError("KV event batch needs ts (a number) and events (a list)")
    return KvEventBatch(float(ts), [_engine_event(e) for e in events], rank)


def encode_engine_batch(
    batch: KvEventBatch, *, array_like: bool = True, vllm: bool = False
) -> bytes:
    """`batch` as an engine publishes it: events `array_like` as SGLang and vLLM up to
    0.23 do, else as newer vLLM's maps (with `medium`, `lora_name` and `extra_keys`).
    Arrays end where SGLang's do (`BlockStored` at `lora_id`, `BlockRemoved` at its
    hashes) unless `vllm`: vLLM's positional structs go on with `medium` and `lora_name`
    (no defaults, always sent) and `extra_keys` (one entry per block, None for a plain
    block), msgspec omitting only trailing defaults (vllm/distributed/kv_events.py, v0.11
    to v0.23; `group_idx` and the cache-spec fields after it are left at their defaults)."""
    events: list[Any] = []
    for e in batch.events:
        if isinstance(e, BlockStored):
            values: list[Any] = [
                e.block_hashes,
                e.parent_hash,
                list(e.token_ids),
                e.block_size,
                e.lora_id,
            ]
            extra = [list(k) if k is not None else None for k in e.extra_keys or ()]
            if array_like and vllm:
                per_block = extra or [None] * len(e.block_hashes)
                events.append(["BlockStored", *values, e.medium, None, per_block])
            elif array_like:
                events.append(["BlockStored", *values])
            else:
                fields = dict(zip(_STORED_FIELDS, values, strict=False))
                fields.update(medium=e.medium, lora_name=None, extra_keys=extra or None)
                events.append({"type": "BlockStored", **fields})
        elif isinstance(e, BlockRemoved):
            if array_like:
                removed: Any = ["BlockRemoved", e.block_hashes]
                if vllm:
                    removed.append(e.medium)
                events.append(removed)
            else:
                events.append(
                    {"type": "BlockRemoved", "block_hashes": e.block_hashes, "medium": e.medium}
                )
        else:
            events.append(["AllBlocksCleared"] if array_like else {"type": "AllBlocksCleared"})
    # The batch itself stays positional in every version: vLLM's #42892 made only the
    # events maps (its EventBatch keeps array_like; captured from v0.26:
    # `[ts, [{"type": "BlockStored", ...}], 0]`).
    body: list[Any] = [batch.ts, events]
    if batch.data_parallel_rank is not None:
        body.append(batch.data_parallel_rank)
    payload: bytes = msgpack.packb(body, use_bin_type=True)
    return payload


# -- genmesh's form on NATS (docs/protocol.md, "KV events") ----------------------------------


def event_to_wire(event: KvEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        obj: dict[str, Any] = {
            "type": "stored",
            "hashes": event.block_hashes,
            "parent": event.parent_hash,
            # Packed as the prompt is (docs/protocol.md §5.1): little-endian int32.
            "tokens": to_le_bytes(event.token_ids),
            "block_size": event.block_size,
        }
        if event.extra_keys is not None:
            obj["extra"] = [list(k) if k is not None else None for k in event.extra_keys]
        if event.lora_id is not None:
            obj["lora_id"] = event.lora_id
        if event.medium is not None:
            obj["medium"] = event.medium
        return obj
    if isinstance(event, BlockRemoved):
        removed: dict[str, Any] = {"type": "removed", "hashes": event.block_hashes}
        if event.medium is not None:
            removed["medium"] = event.medium
        return removed
    return {"type": "cleared"}


def event_from_wire(obj: Any) -> KvEvent:
    if not isinstance(obj, dict):
        raise KvEventError("a KV event is a map")
    kind = obj.get("type")
    if kind == "stored":
        raw = obj.get("tokens")
        if isinstance(raw, bytes):
            if len(raw) % 4:
                raise KvEventError("stored.tokens: packed tokens are 4 bytes each")
            tokens = from_le_bytes(raw, TokenIds())
        elif isinstance(raw, list):
            tokens = TokenIds(raw)
        else:
            raise KvEventError("stored.tokens must be bytes (int32 LE) or a list")
        size = obj.get("block_size")
        hashes = _hashes(obj.get("hashes"), "stored")
        if not isinstance(size, int) or size < 1 or len(tokens) != len(hashes) * size:
            raise KvEventError(f"stored: {len(tokens)} tokens for {len(hashes)} blocks of {size}")
        parent = obj.get("parent")
        extra = obj.get("extra")
        return BlockStored(
            block_hashes=hashes,
            parent_hash=None if parent is None else _hash(parent, "stored"),
            token_ids=tokens,
            block_size=size,
            extra_keys=[None if k is None else tuple(k) for k in extra] if extra else None,
            lora_id=obj.get("lora_id"),
            medium=obj.get("medium"),
        )
    if kind == "removed":
        return BlockRemoved(_hashes(obj.get("hashes"), "removed"), obj.get("medium"))
    if kind == "cleared":
        return AllBlocksCleared()
    raise KvEventError(f"unknown KV event type {kind!r}")


@dataclass(slots=True)
class KvEventsMessage:
    """One message on `genmesh.<ns>.kv.<wid>`: an engine batch, numbered. `seq` counts
    from 1 per worker process; a router that sees any other number than the last plus
    one resyncs from the worker's snapshot."""

    worker: str
    seq: int
    ts: float
    events: list[KvEvent]

    def to_wire(self) -> dict[str, Any]:
        return {
            "worker": self.worker,
            "seq": self.seq,
            "ts": self.ts,
            "events": [event_to_wire(e) for e in self.events],
        }

    @classmethod
    def from_wire(cls, obj: Any) -> KvEventsMessage:
        if not isinstance(obj, dict):
            raise KvEventError("a KV events message is a map")
        worker, seq, ts, events = (
            obj.get("worker"),
            obj.get("seq"),
            obj.get("ts"),
            obj.get("events"),
        )
        if not isinstance(worker, str) or not isinstance(seq, int) or seq < 1:
            raise KvEventError("a KV events message needs worker (a string) and seq (>= 1)")
        if not isinstance(ts, int | float) or not isinstance(events, list):
            raise KvEventError("a KV events message needs ts (a number) and events (a list)")
        return cls(worker, seq, float(ts), [event_from_wire(e) for e in events])


@dataclass(slots=True)
class KvSnapshotPage:
    """One page of a worker's answer on `genmesh.<ns>.worker.<wid>.kv_snapshot`: its cache
    as `stored` events that rebuild it in order (parents first), as of message `seq` (0:
    none sent yet). A request `{"snapshot": null, "page": 0}` freezes a snapshot and
    answers its first page with its `snapshot` id; `{"snapshot": id, "page": k}` asks for
    page k of that same snapshot, so a cache that changes between pages cannot tear it.
    Events after `seq` apply on top of it."""

    worker: str
    snapshot: str
    seq: int
    page: int
    pages: int
    events: list[BlockStored]

    def to_wire(self) -> dict[str, Any]:
        return {
            "worker": self.worker,
            "snapshot": self.snapshot,
            "seq": self.seq,
            "page": self.page,
            "pages": self.pages,
            "events": [event_to_wire(e) for e in self.events],
        }

    @classmethod
    def from_wire(cls, obj: Any) -> KvSnapshotPage:
        if not isinstance(obj, dict):
            raise KvEventError("a KV snapshot page is a map")
        worker, snapshot = obj.get("worker"), obj.get("snapshot")
        seq, page, pages = obj.get("seq"), obj.get("page"), obj.get("pages")
        if not isinstance(worker, str) or not isinstance(snapshot, str):
            raise KvEventError("a KV snapshot page needs worker and snapshot (strings)")
        if not all(isinstance(v, int) and v >= 0 for v in (seq, page, pages)):
            raise KvEventError("a KV snapshot page needs seq, page and pages (integers >= 0)")
        events = [event_from_wire(e) for e in obj.get("events") or ()]
        if not all(isinstance(e, BlockStored) for e in events):
            raise KvEventError("a KV snapshot page holds only stored events")
        return cls(worker, snapshot, seq, page, pages, events)  # type: ignore[arg-type]


# -- the router's block keys ----------------------------------------------------------------

# Dynamo's seed for its token-block hash (lib/kv-router: XXH3 with seed 1337): the first
# block of every sequence is hashed with it, each next block with its parent's key.
ROOT_SEED = 1337


def extra_bytes(keys: Sequence[Any] | None) -> bytes:
    """A block's extra keys as bytes that enter its key: the same on both sides (a
    request's multimodal items and cache salt, and a stored event's `extra_keys`). A key
    may itself be a sequence (vLLM's multimodal `(hash, offset)`), which the engine's
    msgpack and the bus deliver as a list: a tuple and a list of the same keys are the
    same bytes. (vLLM's keys nest no deeper.)"""
    if not keys:
        return b""
    return b"\x1f".join(
        [b"(" + b"\x1f".join([str(x).encode() for x in k]) + b")"
         if isinstance(k, list | tuple) else str(k).encode()
         for k in keys]
    )  # fmt: skip


def block_keys(
    tokens: array[int],
    block_size: int,
    extra: Sequence[tuple[Any, ...] | None] | None = None,
    parent: int = ROOT_SEED,
) -> list[int]:
    """The router's key of every full block of `tokens`, chained: block i's key hashes
    its tokens (and extra keys) seeded with block i-1's key (`parent` for the first), so a
    key stands for the whole prefix up to its block's end. XXH3-64 over the int32 bytes
    (~0.2 µs a block; blake2b costs 4x, Python's salted `hash` differs per process)."""
    data = memoryview(tokens).cast("B")
    step = block_size * 4
    keys: list[int] = []
    hash64 = xxhash.xxh3_64_intdigest
    for i, start in enumerate(range(0, len(data) - step + 1, step)):
        block = data[start : start + step]
        if extra is not None and i < len(extra) and extra[i]:
            block = bytes(block) + b"\x1e" + extra_bytes(extra[i])  # type: ignore[assignment]
        parent = hash64(block, parent)
        keys.append(parent)
    return keys


def stored_keys(event: BlockStored, parent: int = ROOT_SEED) -> list[int]:
    """The router's keys of a stored event's blocks, given its parent block's key."""
    return block_keys(event.token_ids, event.block_size, event.extra_keys, parent)


def mm_block_keys(items: Sequence[MmItem], block_size: int, blocks: int) -> list[list[Any]]:
    """Per block (of `blocks`), the multimodal extra keys vLLM gives it
    (`_gen_mm_extra_hash_keys`, vllm/v1/core/kv_cache_utils.py): for each item the block
    touches, in prompt order, `(item hash, item offset - block start)` (negative for an
    item that began in an earlier block). vLLM walks every block past the items; this
    walks each item's blocks, which gives the same keys for the blocks items touch only."""
    keys: list[list[Any]] = [[] for _ in range(blocks)]
    for item in items:
        last = min((item.offset + item.length - 1) // block_size, blocks - 1)
        for block in range(item.offset // block_size, last + 1):
            keys[block].append((item.identifier, item.offset - block * block_size))
    return keys


def request_extra_keys(
    envelope: Envelope, block_size: int, length: int | None = None
) -> list[tuple[Any, ...] | None] | None:
    """Per block of a request, what besides its tokens goes into its key, as vLLM's
    `generate_block_hash_extra_keys` (vllm/v1/core/kv_cache_utils.py) makes it and newer
    vLLM's `BlockStored.extra_keys` report it: the multimodal items the block touches
    (`mm_block_keys`), then the cache salt, which only the first block carries (LoRA
    names would come first; the mesh routes none). `length` tokens are covered (default
    the prompt; an engine caching prompt and output passes their length); entries past
    the end of the list are None, and None is nothing at all.

    Features vLLM would refuse (a client speaking the envelope is not checked by the
    vLLM format) leave the text-only keys: the engine refuses the request anyway."""
    try:
        items = envelope_items(envelope)
    except FeaturesError as exc:
        log.warning("request %s: routed on its tokens alone: %s", envelope.id, exc)
        items = []
    covered = len(envelope.token_ids) if length is None else length
    return block_extra_keys(items, envelope.routing.cache_salt, block_size, covered)


def block_extra_keys(
    items: Sequence[MmItem], salt: str | None, block_size: int, length: int
) -> list[tuple[Any, ...] | None] | None:
    """`request_extra_keys` from a request's parts: its multimodal items (in prompt
    order) and cache salt, over `length` tokens; for an engine that has no envelope (the
    testkit's vLLM server)."""
    if not items:
        return [(salt,)] if salt else None
    per_block = mm_block_keys(items, block_size, length // block_size)
    if salt and per_block:
        per_block[0].append(salt)
    return [tuple(keys) if keys else None for keys in per_block]


def request_block_keys(envelope: Envelope, block_size: int) -> list[int]:
    """The router's keys of the full blocks of a request's prompt."""
    return block_keys(envelope.token_ids, block_size, request_extra_keys(envelope, block_size))

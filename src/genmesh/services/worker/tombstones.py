"""Cancel tombstones: the IDs of cancels that found no running request here.

A cancel may overtake its request (it takes one hop, the request two), so a worker
remembers it a while and refuses the request when it arrives (docs/protocol.md §8).
Anyone who may cancel can fill this store, so it is bounded three ways: by age, by count
and by the bytes of the IDs it holds; the oldest go first. Cancel IDs are themselves
bounded (`MAX_ID_BYTES`), so no single one can be large.
"""

from __future__ import annotations

import time
from collections import OrderedDict

TOMBSTONE_TTL_S = 60.0
TOMBSTONE_MAX = 100_000
# The bytes of IDs kept at most: 100,000 of genmesh's 32-digit IDs fit (3.2 MB), and
# cancels with IDs of the longest kind (256 bytes) cannot hold more than this.
TOMBSTONE_MAX_BYTES = 4 * 1024 * 1024


class Tombstones:
    def __init__(
        self,
        *,
        ttl_s: float = TOMBSTONE_TTL_S,
        max_count: int = TOMBSTONE_MAX,
        max_bytes: int = TOMBSTONE_MAX_BYTES,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_count = max_count
        self.max_bytes = max_bytes
        # ID -> when it was recorded; oldest first, so pruning can stop at the first one
        # that stays. (Sizes are measured again on the way out: one float an entry.)
        self._ids: OrderedDict[str, float] = OrderedDict()
        self._bytes = 0

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    @property
    def bytes(self) -> int:
        """The UTF-8 bytes of the IDs held now."""
        return self._bytes

    def add(self, request_id: str) -> None:
        if self._ids.pop(request_id, None) is None:
            self._bytes += len(request_id.encode())
        self._ids[request_id] = time.monotonic()
        self.prune()

    def prune(self) -> None:
        """Drop what expired, then the oldest until both bounds hold."""
        now = time.monotonic()
        ids = self._ids
        dropped = False
        while ids:
            oldest, at = next(iter(ids.items()))
            within = len(ids) <= self.max_count and self._bytes <= self.max_bytes
            if within and now - at < self.ttl_s:
                break
            del ids[oldest]
            self._bytes -= len(oldest.encode())
            dropped = True
        if dropped and not ids:
            # A dict never shrinks its table on deletions: once a burst has expired, a
            # fresh one gives that memory back.
            self._ids = OrderedDict()

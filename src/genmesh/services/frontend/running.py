"""The client IDs of the requests running through one frontend that their real server
refuses to see twice while they run (`Bound.running_ids`: SGLang's rids).

Exact within one frontend only: two frontends do not see each other's requests, so a
duplicate sent through each is served twice (docs/formats.md §2.8).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator


class RunningIds:
    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: set[str] = set()

    def __contains__(self, client_id: str) -> bool:
        return client_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def duplicate(self, ids: Iterable[str]) -> str | None:
        """The first of `ids` already running, if any."""
        return next((i for i in ids if i in self._held), None)

    @contextlib.contextmanager
    def hold(self, ids: Iterable[str]) -> Iterator[None]:
        """Hold `ids` until the block ends, however it ends (answer, error, client gone).
        Only the IDs not already held are taken, and only they are released, so a caller
        that skipped `duplicate` cannot free another request's IDs. With no await between
        `duplicate` and `hold`, no other request can slip in between."""
        taken = set(ids) - self._held
        self._held |= taken
        try:
            yield
        finally:
            self._held -= taken

"""One generation's records across its attempts: what makes a migration invisible to HTTP.

Each `out`/`end` frame of item `i` is rendered by the format's exchange into a native
record. When `MeshClient` moves the generation to another worker (a `mig` frame), the new
attempt's counters start over; the format's merge rules make every record, or the unary
fold, say what an uninterrupted run would have said (`formats/merge.py`, docs/formats.md
§1.4).
"""

from __future__ import annotations

from genmesh.formats.base import Exchange, GenerateFormat, Record
from genmesh.formats.merge import Merger, Rebaser
from genmesh.shared.frames import OutputFrame


class ItemRecords:
    """The records of item `index`: rebased one by one for a stream (`record`), or folded
    into the unary body (`add`, then `result`)."""

    __slots__ = ("_merger", "_rebaser", "attempt", "exchange", "index")

    def __init__(
        self, fmt: GenerateFormat, exchange: Exchange, index: int, *, stream: bool
    ) -> None:
        self.exchange = exchange
        self.index = index
        self.attempt = 0
        self._rebaser = Rebaser(fmt.merge_rules) if stream else None
        joiners = fmt.joiners if exchange.joiners is None else exchange.joiners
        self._merger = None if stream else Merger(fmt.merge_rules, joiners)

    def migrated(self) -> None:
        """The generation continues in a new attempt (a `mig` frame)."""
        self.attempt += 1
        self.exchange.new_attempt(self.index)

    def record(self, frame: OutputFrame) -> Record:
        """The frame as a record of an uninterrupted run (a stream's, sent one by one)."""
        assert self._rebaser is not None, "record() is for streams"
        return self._rebaser.rebase(self.exchange.render(self.index, frame), self.attempt)

    def add(self, frame: OutputFrame) -> None:
        """Fold the frame's record into the unary body."""
        assert self._merger is not None, "add() is for unary responses"
        self._merger.add(self.exchange.render(self.index, frame), self.attempt)

    def result(self) -> Record:
        assert self._merger is not None, "result() is for unary responses"
        return self._merger.result()

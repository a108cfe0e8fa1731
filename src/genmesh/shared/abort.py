"""Abort by client ID: the order a frontend broadcasts and every worker applies
(`docs/protocol.md` §8.1).

Client IDs never address anything in the mesh (private IDs do), but every envelope carries
its `client_id`, so an abort reaches the request whichever frontend and worker it went
through: each worker matches the order against the requests it has admitted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from genmesh.shared.envelope import Envelope

Match = Literal["exact", "prefix", "all"]
MATCHES: tuple[str, ...] = ("exact", "prefix", "all")
ABORT_VERSION = 1


@dataclass(frozen=True, slots=True)
class AbortOrder:
    """Which admitted requests to abort.

    - `exact`: those whose client ID is one of `ids` (vLLM's rule; SGLang's first stage,
      the tokenizer manager's check that it knows the rid);
    - `prefix`: those whose client ID starts with one of `ids` (SGLang's second stage, its
      scheduler's match, sent only once the first found the rid);
    - `all`: every admitted request (`abort_all`), whatever `format` says.

    `format`, when set, narrows the order to requests of that format: an SGLang rid never
    aborts a vLLM request that happens to share its ID.
    """

    ids: tuple[str, ...] = ()
    match: Match = "exact"
    format: str | None = None

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"v": ABORT_VERSION, "ids": list(self.ids), "match": self.match}
        if self.format is not None:
            wire["format"] = self.format
        return wire

    @classmethod
    def from_wire(cls, obj: Any) -> AbortOrder:
        """Raises ValueError for anything that is not an abort order."""
        if not isinstance(obj, dict):
            raise ValueError("an abort order is a map")
        match = obj.get("match")
        if match not in MATCHES:
            raise ValueError(f"abort match must be one of {', '.join(MATCHES)}, got {match!r}")
        ids = obj.get("ids", [])
        if not isinstance(ids, list) or not all(isinstance(i, str) and i for i in ids):
            raise ValueError("abort ids must be a list of non-empty strings")
        fmt = obj.get("format")
        if fmt is not None and not isinstance(fmt, str):
            raise ValueError("abort format must be a string")
        return cls(tuple(ids), match, fmt)

    def hits(self, envelope: Envelope) -> bool:
        """Whether this order aborts `envelope` on the worker that admitted it."""
        if self.match == "all":
            return True
        if self.format is not None and envelope.format != self.format:
            return False
        cid = envelope.client_id
        if not cid:
            return False
        if self.match == "prefix":
            return cid.startswith(self.ids)
        return cid in self.ids

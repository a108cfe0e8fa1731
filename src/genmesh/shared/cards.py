"""What a discovery message must hold to be believed (docs/protocol.md §9.1, §9.4).

Anyone who may publish on the discovery subjects can say anything there, so a directory
checks every worker card and router presence before it acts on one, whatever the NATS
permissions allow: ids must be subject tokens, counts and intervals numbers in range, the
P/D fields one of the known roles and a map. A worker's generate subject is never read
from its card (`Subjects.worker_generate` derives it from the id): a card naming the
router subject would have a router forward to itself.

Cheap by design: a directory checks a card per worker per heartbeat and per load change,
so these are a handful of type and range tests, no schema library.
"""

from __future__ import annotations

from typing import Any

from genmesh.shared.ids import is_subject_token
from genmesh.shared.settings import InvalidText

# A worker's part in prefill/decode disaggregation (`--role`, docs/disaggregation.md).
ROLE_BOTH, ROLE_PREFILL, ROLE_DECODE = "both", "prefill", "decode"
ROLES = (ROLE_BOTH, ROLE_PREFILL, ROLE_DECODE)

DEFAULT_HEARTBEAT_S = 1.0
# A heartbeat interval is a positive number of seconds up to an hour: a directory keeps a
# silent peer for 3 of them, so an unbounded (or NaN, or infinite) one would keep a peer
# that is gone, or never was, for ever.
MAX_HEARTBEAT_S = 3600.0
# Counts (capacity, inflight, KV blocks) are integers below 2^53, which a JSON reader in
# any language holds exactly.
MAX_COUNT = 2**53 - 1
# A discovery message's most bytes, checked before it is decoded: a card is about 1 KB
# (protocol.md §9.1), and the NATS max payload (8 MB in deploy/nats/) would let one forged
# card cost every directory the time to decode it and the memory to keep it.
MAX_MESSAGE_BYTES = 64 * 1024
# The most workers and routers a directory keeps: past them, new ids are somebody's flood
# (each would stay up to 3 heartbeats), and the ones it knows keep being heard.
MAX_WORKERS = 4096
MAX_ROUTERS = 256


def heartbeat_fault(value: object) -> str | None:
    """Why `value` is not a heartbeat interval (None: it is one)."""
    if type(value) is not float and type(value) is not int:  # bool is not a number here
        return "heartbeat_s is not a number"
    if not 0 < value <= MAX_HEARTBEAT_S:  # False for NaN too
        return f"heartbeat_s is not in (0, {MAX_HEARTBEAT_S:g}]"
    return None


def heartbeat_interval(text: str) -> float:
    """A heartbeat interval from the command line: what a directory will believe."""
    number = float(text)
    if heartbeat_fault(number) is not None:
        raise InvalidText(f"must be a number above 0 and at most {MAX_HEARTBEAT_S:g}")
    return number


def _id_fault(message: dict[str, Any]) -> str | None:
    wid = message.get("id")
    if type(wid) is not str or not is_subject_token(wid):
        return "id is not a subject token (1-64 of A-Z a-z 0-9 _ -)"
    return None


def card_fault(card: dict[str, Any]) -> str | None:
    """Why worker card `card` cannot be believed, or None if it can (§9.1: what a
    directory reads of a card, checked; the other fields are informational, or read
    tolerantly where they are used)."""
    fault = _id_fault(card)
    if fault is not None:
        return fault
    inflight = card.get("inflight", 0)
    if type(inflight) is not int or not 0 <= inflight <= MAX_COUNT:
        return "inflight is not an int in [0, 2^53)"
    capacity = card.get("capacity", 1)
    if type(capacity) is not int or not 1 <= capacity <= MAX_COUNT:
        return "capacity is not an int in [1, 2^53)"
    fault = heartbeat_fault(card.get("heartbeat_s", DEFAULT_HEARTBEAT_S))
    if fault is not None:
        return fault
    role = card.get("role", ROLE_BOTH)
    disagg = card.get("disagg")
    if role == ROLE_BOTH and disagg is None:  # most cards: no P/D
        return None
    if role not in ROLES:  # a tuple: compared, never hashed (a list would not hash)
        return "role is not one of both, prefill, decode"
    return _disagg_fault(disagg, required=role != ROLE_BOTH)


def _disagg_fault(disagg: object, *, required: bool) -> str | None:
    """A prefill or decode worker's `disagg` is a map whose `kind` is a string (the
    worker announces `{"kind": pd_kind, **pd_card()}`); a `both` worker's, if any, a map."""
    if disagg is None and not required:
        return None
    if type(disagg) is not dict:
        return "disagg is not a map"
    kind = disagg.get("kind")
    if type(kind) is not str and (required or kind is not None):
        return "disagg.kind is not a string"
    local = disagg.get("local_prefill")
    if local is not None and type(local) is not bool:
        return "disagg.local_prefill is not a bool"
    return None


def presence_fault(presence: dict[str, Any]) -> str | None:
    """Why router presence `presence` cannot be believed, or None if it can (§9.4)."""
    fault = _id_fault(presence)
    if fault is not None:
        return fault
    if presence.get("leaving") is True:  # the interval no longer matters
        return None
    return heartbeat_fault(presence.get("heartbeat_s", DEFAULT_HEARTBEAT_S))

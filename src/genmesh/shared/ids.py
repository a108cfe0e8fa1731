"""Identifiers. Private IDs address state inside the mesh; clients never see them."""

from __future__ import annotations

import secrets
import string

_TOKEN_CHARS = frozenset(string.ascii_letters + string.digits + "_-")
SUBJECT_TOKEN_RULE = "1-64 characters of A-Z a-z 0-9 _ -"

# The longest request ID the mesh takes, in UTF-8 bytes: an envelope's `id` (echoed in
# every frame, so its `ack` always fits NATS's max_payload), a cancel's (kept as a
# tombstone) and a ping's (docs/protocol.md §5.1, §8; docs/limits.md). The IDs the mesh
# derives count too: a migration's `<id>~<n>`, a prefill stage's `<id>~p`.
MAX_ID_BYTES = 256
# The longest client ID an envelope carries (`client_id`: the end client's rid or
# request_id, which formats echo), in UTF-8 bytes.
MAX_CLIENT_ID_BYTES = 1024


def new_request_id() -> str:
    """A 128-bit random private request ID (32 hex digits)."""
    return secrets.token_hex(16)


def new_public_id() -> str:
    """An ID shown to a client that sent none of its own; unrelated to the private ID."""
    return secrets.token_hex(16)


def new_worker_id() -> str:
    return "w" + secrets.token_hex(4)


def new_router_id() -> str:
    return "r" + secrets.token_hex(4)


def is_subject_token(value: str) -> bool:
    """True if `value` can stand as one NATS subject token (namespaces, worker IDs): 1-64
    of A-Z a-z 0-9 _ -. (A set, not the regex `^[A-Za-z0-9_-]{1,64}$`, whose `$` also
    matched before a final newline; and a few times faster, for every card discovery
    checks.)"""
    return 0 < len(value) <= 64 and _TOKEN_CHARS.issuperset(value)


def id_problem(value: str, limit: int) -> str | None:
    """Why `value` cannot serve as an ID of at most `limit` UTF-8 bytes, or None if it
    can. A string longer than `limit` characters is judged without encoding it (a
    megabyte-long ID costs nothing); one that cannot be encoded (a lone surrogate, which
    JSON can carry) could never be echoed in a frame."""
    if len(value) > limit:
        return f"at most {limit} bytes, got {len(value)} characters"
    try:
        size = len(value.encode())
    except UnicodeEncodeError:
        return "must be valid Unicode (it holds a lone surrogate)"
    return f"at most {limit} bytes, got {size}" if size > limit else None

"""Identifiers. Private IDs address state inside the mesh; clients never see them."""

from __future__ import annotations

import secrets
import string

_TOKEN_CHARS = frozenset(string.ascii_letters + string.digits + "_-")


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

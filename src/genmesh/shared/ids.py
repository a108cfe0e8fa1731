"""Identifiers. Private IDs address state inside the mesh; clients never see them."""

from __future__ import annotations

import re
import secrets

_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,64}")
SUBJECT_TOKEN_RULE = "1-64 characters of A-Z a-z 0-9 _ -"


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
    """True if `value` can stand as one NATS subject token (namespaces, worker IDs)."""
    return bool(_TOKEN.fullmatch(value))  # `$` would let "a\n" through

"""Codec registry: name -> codec, built-ins plus the `genmesh.codecs` entry-point group.

A codec turns one envelope or frame (plain maps, lists, strings, numbers, booleans, null)
into bytes and back. The NATS header `genmesh-codec` names the codec of a message; no
header means msgpack. Replies use the codec of their request.
"""

from __future__ import annotations

import logging
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "genmesh.codecs"
DEFAULT_CODEC = "msgpack"


@runtime_checkable
class Codec(Protocol):
    name: str

    def encode(self, obj: Any) -> bytes: ...

    def decode(self, data: bytes) -> Any: ...


class UnknownCodecError(LookupError):
    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(f"unknown codec {name!r}; installed codecs: {', '.join(known)}")
        self.name = name


class CodecError(ValueError):
    """Bytes that the named codec cannot decode (or an object it cannot encode)."""


_registry: dict[str, Codec] | None = None


def _load() -> dict[str, Codec]:
    from genmesh.codecs.builtin import JsonCodec, MsgpackCodec

    found: dict[str, Codec] = {"msgpack": MsgpackCodec(), "json": JsonCodec()}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in found and ep.value.startswith("genmesh.codecs.builtin:"):
            continue
        try:
            obj = ep.load()
            codec = obj() if isinstance(obj, type) else obj
        except Exception:
            log.exception("codec entry point %s (%s) failed to load; skipped", ep.name, ep.value)
            continue
        if not isinstance(codec, Codec):
            log.error("codec entry point %s does not provide name/encode/decode; skipped", ep.name)
            continue
        found[ep.name] = codec
    return found


def _codecs() -> dict[str, Codec]:
    global _registry
    if _registry is None:
        _registry = _load()
    return _registry


def get_codec(name: str | None) -> Codec:
    """The codec called `name` (None or empty: the default)."""
    codecs = _codecs()
    try:
        return codecs[name or DEFAULT_CODEC]
    except KeyError:
        raise UnknownCodecError(name or "", sorted(codecs)) from None


def available_codecs() -> list[str]:
    return sorted(_codecs())


def register_codec(codec: Codec) -> None:
    """Register a codec at run time (tests, embedding); entry points are the normal way."""
    _codecs()[codec.name] = codec

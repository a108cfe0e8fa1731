"""The format catalog: formats and client codecs installed through entry points.

- Formats: group `genmesh.formats`; each serves its native routes (SGLang `/generate`,
  vLLM `/inference/v1/generate`). `GENMESH_<NAME>_PATH` moves a format's path.
- `GENMESH_GENERATE_FORMAT=<format>[+<client codec>]` names the format that serves
  `/generate` (default `sglang`). Another format whose native path is `/generate` then
  steps aside (logged); any other clash of (method, path) is a configuration error.
- Client codecs: group `genmesh.client_codecs`.

Start-up fails with a one-line `ConfigError`, not a traceback, on an unknown name, an
invalid path, or two formats claiming one (method, path).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import replace
from importlib.metadata import entry_points

from genmesh.formats.base import GenerateFormat, Route
from genmesh.formats.client_codec import ENTRY_POINT_GROUP as CLIENT_CODEC_GROUP
from genmesh.formats.client_codec import ClientCodec, CodecFormat

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "genmesh.formats"
DEFAULT_GENERATE_FORMAT = "sglang"
GENERATE_PATH = "/generate"


class ConfigError(ValueError):
    """A configuration mistake, reported to the operator in one line."""


def installed_formats() -> dict[str, type[GenerateFormat]]:
    found: dict[str, type[GenerateFormat]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            cls = ep.load()
        except Exception as exc:
            log.error("format entry point %s (%s) failed to load: %s", ep.name, ep.value, exc)
            continue
        if not (isinstance(cls, type) and issubclass(cls, GenerateFormat)):
            log.error("format entry point %s is not a GenerateFormat subclass; skipped", ep.name)
            continue
        found[ep.name] = cls
    return found


def installed_client_codecs() -> dict[str, ClientCodec]:
    found: dict[str, ClientCodec] = {}
    for ep in entry_points(group=CLIENT_CODEC_GROUP):
        try:
            obj = ep.load()
            codec = obj() if isinstance(obj, type) else obj
        except Exception as exc:
            log.error("client codec %s (%s) failed to load: %s", ep.name, ep.value, exc)
            continue
        if not isinstance(codec, ClientCodec):
            log.error(
                "client codec %s lacks decode_request/encodes_answer/encode_record; skipped",
                ep.name,
            )
            continue
        found[ep.name] = codec
    return found


def validate_path(path: str) -> None:
    if not path.startswith("/"):
        raise ConfigError(f"route path must start with '/': {path!r}")
    if any(segment.startswith((":", "*", "{")) for segment in path.split("/")):
        raise ConfigError(f"route path segments must not be patterns: {path!r}")


def check_routes(formats: list[GenerateFormat]) -> None:
    owner: dict[Route, str] = {}
    for fmt in formats:
        for route in fmt.routes:
            validate_path(route.path)
            if route in owner:
                raise ConfigError(
                    f"formats {owner[route]!r} and {fmt.name!r} both claim "
                    f"{route.method} {route.path}"
                )
            owner[route] = fmt.name


def path_variable(name: str) -> str:
    return f"GENMESH_{name.upper().replace('-', '_')}_PATH"


def _path_override(name: str, env: Mapping[str, str]) -> str | None:
    return env.get(path_variable(name)) or None


def _routes(cls: type[GenerateFormat], path: str | None) -> tuple[Route, ...]:
    native = cls.default_routes()
    return native if path is None else tuple(replace(r, path=path) for r in native)


def _with_codec(fmt: GenerateFormat, codec_name: str) -> GenerateFormat:
    codecs = installed_client_codecs()
    codec = codecs.get(codec_name)
    if codec is None:
        names = ", ".join(sorted(codecs)) or "none"
        raise ConfigError(f"unknown client codec {codec_name!r}; installed client codecs: {names}")
    if fmt.name not in codec.formats:
        raise ConfigError(
            f"client codec {codec_name!r} does not know the {fmt.name!r} format "
            f"(it knows: {', '.join(sorted(codec.formats))})"
        )
    return CodecFormat(fmt, codec)


def load_generate_formats(
    generate_format: str = DEFAULT_GENERATE_FORMAT, env: Mapping[str, str] | None = None
) -> list[GenerateFormat]:
    """The formats to serve, with their routes checked."""
    env = os.environ if env is None else env
    installed = installed_formats()
    base_name, _, codec_name = generate_format.partition("+")
    if base_name not in installed:
        names = ", ".join(sorted(installed)) or "none"
        raise ConfigError(
            f"unknown generate format {generate_format!r}; installed formats: {names}"
        )
    formats: list[GenerateFormat] = []
    # The /generate format: on /generate, and on its own native path if that differs.
    cls = installed[base_name]
    own_path = _path_override(base_name, env)
    routes = _routes(cls, GENERATE_PATH)
    native = _routes(cls, own_path)
    routes += tuple(r for r in native if r not in routes)
    generate: GenerateFormat = cls(routes)
    formats.append(_with_codec(generate, codec_name) if codec_name else generate)
    for name, other in sorted(installed.items()):
        if name == base_name:
            continue
        path = _path_override(name, env)
        other_routes = _routes(other, path)
        if path is None and any(r.path == GENERATE_PATH for r in other_routes):
            log.info(
                "format %r not served: %s belongs to %r (set %s to serve it)",
                name,
                GENERATE_PATH,
                generate_format,
                path_variable(name),
            )
            continue
        formats.append(other(other_routes))
    check_routes(formats)
    return formats

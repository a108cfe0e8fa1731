"""The format catalog: formats installed through the `genmesh.formats` entry-point group.

`GENMESH_GENERATE_FORMAT` names the format that serves `/generate` (default `sglang`).
Start-up fails with a `ConfigError`, not a traceback, on an unknown name, an invalid route
path, or two formats claiming one (method, path).
"""

from __future__ import annotations

import logging
from importlib.metadata import entry_points

from genmesh.formats.base import GenerateFormat, Route

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "genmesh.formats"
DEFAULT_GENERATE_FORMAT = "sglang"


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


def load_generate_formats(generate_format: str = DEFAULT_GENERATE_FORMAT) -> list[GenerateFormat]:
    """The active formats, their routes checked."""
    installed = installed_formats()
    cls = installed.get(generate_format)
    if cls is None:
        names = ", ".join(sorted(installed)) or "none"
        raise ConfigError(
            f"unknown generate format {generate_format!r}; installed formats: {names}"
        )
    formats: list[GenerateFormat] = [cls(cls.default_routes())]
    check_routes(formats)
    return formats

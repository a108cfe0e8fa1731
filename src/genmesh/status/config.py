"""`genmesh status`'s options. A module of its own that imports no NATS library, so that
parsing the command line (and its --help) stays quick."""

from __future__ import annotations

from dataclasses import dataclass

from genmesh.shared.connection import MeshConnection
from genmesh.shared.credentials import NatsAuth, nats_auth_group
from genmesh.shared.settings import group, option, positive_float

# `--watch` alone: a redraw every 2 s, as `watch(1)` does.
DEFAULT_WATCH_S = 2.0


@dataclass(frozen=True, slots=True)
class StatusConfig:
    # Which mesh; not the services' log level or event loop, which a one-shot command has
    # no use for (its table says what their log lines would).
    mesh: MeshConnection = group(MeshConnection(), only=("nats_url", "namespace"))
    auth: NatsAuth = nats_auth_group()
    watch_s: float | None = option(
        None,
        flag="--watch",
        parse=positive_float,
        bare=DEFAULT_WATCH_S,
        metavar="SECONDS",
        help=f"redraw in place every SECONDS ({DEFAULT_WATCH_S:g} if not given) until "
        "Ctrl-C; a process that leaves is listed as gone",
    )
    as_json: bool = option(
        False,
        flag="--json",
        env=None,
        help="print JSON instead of tables (with --watch, one object per line)",
    )
    timeout_s: float = option(
        1.0,
        flag="--timeout",
        env=None,  # GENMESH_TIMEOUT is `genmesh request`'s idle timeout, a minute
        parse=positive_float,
        help="seconds to wait for the first $SRV answer; then answers are gathered until "
        "0.3 s pass without one, as the NATS CLI does",
    )

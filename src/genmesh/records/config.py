"""Request records' options, declared once (`shared/settings.py`): what a frontend writes
(`RecordsConfig`, `genmesh frontend --request-trace*`), and `genmesh trace check` and
`genmesh trace replay`. A module that imports nothing heavy, so --help stays quick."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from genmesh.records.hashing import DEFAULT_BLOCK_SIZE
from genmesh.shared.settings import (
    from_env,
    non_negative_float,
    option,
    positive_float,
    positive_int,
)

DEFAULT_ROLL_MB = 256.0


@dataclass(frozen=True, slots=True)
class RecordsConfig:
    """`genmesh frontend --request-trace*` / `GENMESH_REQUEST_TRACE*`."""

    path: str | None = option(
        None,
        flag="--request-trace",
        help="write one trace record per request to this file: PATH.jsonl (appended) or "
        "PATH.jsonl.gz (segments PATH.<n>.jsonl.gz that roll)",
    )
    payload: bool = option(
        False,
        flag="--request-trace-payload",
        help="records also hold the request body and the prompt and output token ids",
    )
    nats: bool = option(
        False, flag="--request-trace-nats", help="publish each record on genmesh.<ns>.trace"
    )
    roll_mb: float = option(
        DEFAULT_ROLL_MB,
        flag="--request-trace-roll-mb",
        parse=non_negative_float,
        help=".jsonl.gz: start a new segment after this many MiB of JSON; 0 = no limit",
    )
    roll_lines: int = option(
        0,
        flag="--request-trace-roll-lines",
        help=".jsonl.gz: start a new segment after this many records; 0 = no limit",
    )
    block_size: int = option(
        DEFAULT_BLOCK_SIZE,
        flag="--request-trace-block-size",
        parse=positive_int,
        help="tokens per prompt block hash in the records",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.path) or self.nats


def config_from_env(environ: Mapping[str, str] | None = None) -> RecordsConfig:
    """The configuration from GENMESH_REQUEST_TRACE* (for embedders): the same
    declarations `genmesh frontend --request-trace*` reads."""
    return from_env(RecordsConfig, environ)


@dataclass(frozen=True, slots=True)
class TraceCheckConfig:
    """`genmesh trace check` (no variables: a check is a one-off)."""

    files: tuple[str, ...] = option(
        positional=True, repeat=True, env=None, metavar="FILE", help="record files or segments"
    )
    expect: int | None = option(
        None, env=None, help="fail unless there are exactly this many records"
    )
    as_json: bool = option(False, flag="--json", env=None, help="print the summary as JSON")


@dataclass(frozen=True, slots=True)
class TraceReplayConfig:
    """`genmesh trace replay` (no variables: a replay is a one-off)."""

    files: tuple[str, ...] = option(
        positional=True, repeat=True, env=None, metavar="FILE", help="record files or segments"
    )
    url: str = option(env=None, help="frontend address, e.g. http://127.0.0.1:8000")
    concurrency: int = option(8, env=None, parse=positive_int, help="requests in flight at once")
    timeout_s: float = option(
        120.0,
        flag="--timeout",
        env=None,
        parse=positive_float,
        help="seconds one replayed request may take",
    )
    as_json: bool = option(False, flag="--json", env=None, help="print the summary as JSON")
    progress: bool = option(True, flag="--no-progress", env=None, help="no progress bar on stderr")

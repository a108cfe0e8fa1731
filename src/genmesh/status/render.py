"""The mesh view as tables (rich), for a terminal; `--json` prints `MeshView.to_json`."""

from __future__ import annotations

import time

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from genmesh.status.view import (
    FRONTEND,
    GONE,
    ROUTER,
    UP,
    WORKER,
    MeshView,
    Row,
)

_STYLE = {UP: "green", GONE: "red"}  # every other health is a flag: yellow


def render(view: MeshView) -> RenderableType:
    clock = time.strftime("%H:%M:%S", time.localtime(view.taken_at))
    parts: list[RenderableType] = [
        Text.assemble(
            ("genmesh status", "bold"),
            f"  namespace {view.namespace}  {view.nats_url}  {clock}",
        )
    ]
    if view.rows[ROUTER]:
        parts.append(_routers(view.rows[ROUTER]))
    if view.rows[WORKER]:
        parts.append(_workers(view.rows[WORKER]))
    if view.rows[FRONTEND]:
        parts.append(_frontends(view.rows[FRONTEND]))
    parts += [Text(line, style="dim") for line in view.notes()]
    return Group(*parts)


def _table(title: str, *columns: str) -> Table:
    table = Table(title=title, title_justify="left", title_style="bold")
    for i, name in enumerate(columns):
        numeric = name in ("load", "in flight", "queued", "requests", "errors", "card age")
        # On a narrow terminal the other cells fold onto more lines: the id (first) stays
        # whole on one, and no cell is cut short.
        table.add_column(
            name, justify="right" if numeric else "left", overflow="fold", no_wrap=i == 0
        )
    return table


def _routers(rows: list[Row]) -> Table:
    table = _table("routers", "router", "health", "in flight", "requests", "errors", "card age")
    for row in rows:
        table.add_row(row.id, _health(row), _num(row.load[0]), *_counts(row), _age(row))
    return table


def _workers(rows: list[Row]) -> Table:
    table = _table(
        "workers",
        "worker",
        "health",
        "engine",
        "role",
        "model",
        "load",
        "queued",
        "requests",
        "errors",
        "card age",
    )
    for row in rows:
        inflight, capacity = row.load
        load = "-" if inflight is None else f"{inflight}/{_num(capacity)}"
        queued = row.card.get("queued") if row.card else None
        table.add_row(
            row.id,
            _health(row),
            row.fact("engine") or "-",
            row.fact("role") or "-",
            row.fact("model") or "-",
            load,
            _num(queued if type(queued) is int else None),
            *_counts(row),
            _age(row),
        )
    return table


def _frontends(rows: list[Row]) -> Table:
    table = _table("frontends", "frontend", "health", "http", "in flight", "requests", "errors")
    for row in rows:
        http = row.srv.metadata.get("http", "-") if row.srv else "-"
        table.add_row(row.id, _health(row), http, _num(row.load[0]), *_counts(row))
    return table


def _health(row: Row) -> Text:
    return Text(row.health, style=_STYLE.get(row.health, "yellow"))


def _counts(row: Row) -> tuple[str, str]:
    counts = row.srv_counts()
    return (f"{counts[0]:,}", f"{counts[1]:,}") if counts else ("-", "-")


def _age(row: Row) -> str:
    """How old its card (or presence) is; for a gone process, since when it is gone."""
    if row.gone_for_s is not None:
        return f"gone {row.gone_for_s:.0f}s"
    return "-" if row.card_age_s is None else f"{row.card_age_s:.1f}s"


def _num(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"

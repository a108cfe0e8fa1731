"""`genmesh status`: look at the mesh once, or every `--watch` seconds until Ctrl-C.

One NATS connection; a discovery directory (`shared/discovery.py`, the one routers and
frontends keep) whose start-up query makes every worker and router announce at once, and
which then follows their heartbeats, leaves and expiry; and a `$SRV` survey per look
(`status/srv.py`). A look waits for both: the survey's answers, and `QUIET_S` for the
announces that answer the query (they come within a round trip).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from typing import TextIO

from rich.console import Console
from rich.live import Live

from genmesh.shared.bus import connect, drain_or_close, redact
from genmesh.shared.discovery import WorkerDirectory, WorkerInfo
from genmesh.shared.lifecycle import stop_signals
from genmesh.shared.subjects import Subjects
from genmesh.shared.tasks import wait_event
from genmesh.status.config import StatusConfig
from genmesh.status.render import render
from genmesh.status.srv import QUIET_S, survey
from genmesh.status.view import DRAINING, WORKER, Departures, MeshView, build

# Exit status of a look at which nothing answered (2 is a bad option or NATS unreachable).
NOTHING_ANSWERS = 1

Look = Callable[[], Awaitable[MeshView]]


async def run_status(config: StatusConfig, out: TextIO = sys.stdout) -> int:
    """Show the mesh; 0 if anything answered (at the last look), else `NOTHING_ANSWERS`.
    Raises `NatsUnreachable`, `NatsAuthError` or `NatsPermissionDenied`."""
    nc = await connect(config.mesh.nats_url, name="genmesh-status", auth=config.auth)
    directory = WorkerDirectory(nc, Subjects(config.mesh.namespace))
    draining: set[str] = set()

    def on_change(event: str, worker: WorkerInfo) -> None:
        (draining.add if event == "draining" else draining.discard)(worker.id)

    directory.on_change(on_change)
    try:
        await directory.start()

        async def look() -> MeshView:
            found, _ = await asyncio.gather(survey(nc, config.timeout_s), asyncio.sleep(QUIET_S))
            view = build(
                directory,
                found,
                namespace=config.mesh.namespace,
                nats_url=redact(config.mesh.nats_url),
                draining=draining,
            )
            # Only those still draining are remembered: a long --watch keeps no more.
            draining.intersection_update(r.id for r in view.rows[WORKER] if r.health == DRAINING)
            return view

        if config.watch_s is None:
            view = await look()
            _show_once(view, config.as_json, out)
        else:
            view = await _watch(look, config, out)
        return 0 if view.answered else NOTHING_ANSWERS
    finally:
        await directory.close()
        await drain_or_close(nc)


def _show_once(view: MeshView, as_json: bool, out: TextIO) -> None:
    if as_json:
        print(json.dumps(view.to_json()), file=out, flush=True)
        if not view.answered:  # a script's reader sees stderr; stdout stays JSON
            print(f"genmesh status: {view.notes()[0]}", file=sys.stderr)
        return
    _console(out).print(render(view))


def _console(out: TextIO) -> Console:
    """A terminal's width; anything else (a pipe, a file) gets whole rows, not 80 columns
    of cut ones."""
    return Console(file=out, width=None if out.isatty() else 240)


async def _watch(look: Look, config: StatusConfig, out: TextIO) -> MeshView:
    """Look every `--watch` seconds until a stop signal: redraw the tables in place on a
    terminal, else print each look's (or its JSON object, one a line). Returns the last
    view."""
    assert config.watch_s is not None
    departures = Departures()
    console = _console(out)
    live: Live | None = None
    async with stop_signals() as stop:
        try:
            while True:
                view = await look()
                departures.add_to(view)
                if config.as_json:
                    print(json.dumps(view.to_json()), file=out, flush=True)
                elif not console.is_terminal:  # a pipe or a file: one frame after another
                    console.print(render(view), "")
                elif live is None:
                    live = Live(render(view), console=console, auto_refresh=False)
                    live.start()
                else:
                    live.update(render(view), refresh=True)
                if stop.is_set() or await wait_event(stop, config.watch_s):
                    return view
        finally:
            if live is not None:
                live.stop()

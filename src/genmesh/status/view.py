"""The mesh as `genmesh status` shows it: the workers and routers of the discovery
directory and the `$SRV` services of the namespace, matched by id, each with its health.

A process is `up` when discovery and `$SRV` both know it. One known to only one of them is
flagged: `no_srv` (its card is fresh, yet it does not answer `$SRV`: hung, its NATS user
may not answer `$SRV`, or a genmesh without it), `no_card` (it answers `$SRV` but
announces nothing: a worker whose engine is down, or a process starting or stopping) or
`draining` (a worker that left discovery to drain: it finishes what it runs and takes
nothing new). Frontends announce no card: `$SRV`
alone lists them, `up` while they answer. With `--watch`, a process that was listed and is
no longer known to either (it left, or its card expired) is `gone`, for `GONE_KEPT_S`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from nats.micro.service import EndpointStats

from genmesh.shared.discovery import WorkerDirectory
from genmesh.status.srv import SrvService, SrvSurvey

UP, NO_SRV, NO_CARD, DRAINING, GONE = "up", "no_srv", "no_card", "draining", "gone"
WORKER, ROUTER, FRONTEND = "worker", "router", "frontend"
KINDS = (ROUTER, WORKER, FRONTEND)

# What each health but `up` means, for the notes under the tables.
HEALTH_NOTES = {
    NO_SRV: "in discovery, but does not answer $SRV (hung, its NATS user may not answer "
    "$SRV, or a genmesh without it)",
    NO_CARD: "answers $SRV, but announces no card (engine down, or starting or stopping)",
    DRAINING: "left discovery to drain: finishes what it runs, takes nothing new",
    GONE: "left, or its card expired, and no longer answers $SRV",
}
# How long `--watch` lists a process that has gone.
GONE_KEPT_S = 60.0


@dataclass(slots=True)
class Row:
    """One process: what discovery says of it (`card`, a worker's; `card_age_s`, seconds
    since its last card or presence) and what `$SRV` says (`srv`)."""

    kind: str
    id: str  # worker id, router id, or a frontend's $SRV id
    health: str
    card: dict[str, Any] | None = None
    card_age_s: float | None = None
    srv: SrvService | None = None
    gone_for_s: float | None = None

    def fact(self, name: str) -> str | None:
        """A worker's `engine`, `model`, ...: from its card, else its `$SRV` metadata
        (where `role` is `worker_role`)."""
        value = self.card.get(name) if self.card else None
        if isinstance(value, str):
            return value
        if self.srv is not None:
            meta = "worker_role" if name == "role" else name
            return self.srv.metadata.get(meta)
        return None

    @property
    def load(self) -> tuple[int | None, int | None]:
        """(inflight, capacity): the card's load report, else the `generate` endpoint's
        `$SRV` data (a frontend's: its `inflight` alone)."""
        if self.card is not None:
            return _int(self.card.get("inflight")), _int(self.card.get("capacity"))
        data = self.srv_data()
        return _int(data.get("inflight")), _int(data.get("max_concurrency"))

    def srv_data(self) -> dict[str, Any]:
        """The `data` of the endpoint that carries this process's load (docs/protocol.md,
        "$SRV"): `generate` for workers and routers, `http` for a frontend."""
        endpoint = self._served()
        data = endpoint.data if endpoint is not None else None
        return data if isinstance(data, dict) else {}

    def srv_counts(self) -> tuple[int, int] | None:
        """(requests, errors) of that endpoint (its pings and cancels are not requests a
        reader counts); None without `$SRV`."""
        endpoint = self._served()
        return None if endpoint is None else (endpoint.num_requests, endpoint.num_errors)

    def _served(self) -> EndpointStats | None:
        if self.srv is None:
            return None
        return self.srv.endpoints.get("http" if self.kind == FRONTEND else "generate")

    def to_json(self) -> dict[str, Any]:
        inflight, capacity = self.load
        obj: dict[str, Any] = {"id": self.id, "health": self.health}
        if self.kind == WORKER:
            obj |= {name: self.fact(name) for name in ("engine", "role", "model")}
            obj |= {"inflight": inflight, "capacity": capacity}
            if self.card is not None:
                obj |= {"queued": _int(self.card.get("queued"))}
                obj |= {"host": self.card.get("host"), "pid": _int(self.card.get("pid"))}
        elif self.kind == ROUTER:
            obj["inflight"] = inflight
        else:
            obj |= {"http": self.srv.metadata.get("http") if self.srv else None}
            obj["inflight"] = inflight
        counts = self.srv_counts()
        obj["card_age_s"] = _round(self.card_age_s)
        obj["requests"], obj["errors"] = counts if counts else (None, None)
        obj["srv"] = self.srv.to_json() if self.srv else None
        if self.gone_for_s is not None:
            obj["gone_for_s"] = _round(self.gone_for_s)
        return obj


@dataclass(slots=True)
class MeshView:
    namespace: str
    nats_url: str
    taken_at: float  # Unix time
    rows: dict[str, list[Row]] = field(default_factory=lambda: {k: [] for k in KINDS})
    # `$SRV` answers that could not be read (of any namespace: which one is unknown), and
    # services of this namespace whose role is none of the three or that lack its id.
    unreadable: int = 0

    @property
    def answered(self) -> bool:
        """Whether anything of the mesh answered (gone processes do not count)."""
        return any(r.health != GONE for rows in self.rows.values() for r in rows)

    def flagged(self) -> list[Row]:
        return [r for rows in self.rows.values() for r in rows if r.health != UP]

    def notes(self) -> list[str]:
        """What a reader needs besides the rows: why there are none, what each flag shown
        means, and what could not be read."""
        lines = []
        if not self.answered:
            lines.append(
                f"nothing answers in namespace {self.namespace!r}: no worker card, router "
                "presence or $SRV reply"
            )
        for health in sorted({r.health for r in self.flagged()}):
            lines.append(f"{health}: {HEALTH_NOTES[health]}")
        if self.unreadable:
            lines.append(
                f"{self.unreadable} $SRV answer(s) could not be read or matched to a process"
            )
        return lines

    def to_json(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace,
            "nats_url": self.nats_url,
            "taken_at": self.taken_at,
            **{f"{kind}s": [r.to_json() for r in self.rows[kind]] for kind in KINDS},
            "unreadable_srv_answers": self.unreadable,
            "notes": self.notes(),
        }


def build(
    directory: WorkerDirectory,
    survey: SrvSurvey,
    *,
    namespace: str,
    nats_url: str,
    draining: set[str],
) -> MeshView:
    """The view of the mesh now: the directory's workers and routers, matched with the
    `$SRV` services of `namespace` by their `worker_id` / `router_id` metadata. `draining`:
    the workers that last left discovery to drain."""
    view = MeshView(namespace, nats_url, time.time(), unreadable=survey.unreadable)
    by_role: dict[str, dict[str, SrvService]] = {k: {} for k in KINDS}
    for service in survey.services.values():
        if service.namespace != namespace:
            continue
        role = service.role or ""
        key = {WORKER: "worker_id", ROUTER: "router_id"}.get(role)
        pid = service.metadata.get(key) if key else service.id
        if role not in by_role or not pid:  # not a role we know, or no id to match
            view.unreadable += 1
            continue
        by_role[role][pid] = service
    now = time.monotonic()
    cards = {w.id: (w.card, now - w.last_seen) for w in directory.live()}
    presences = {rid: (None, now - seen) for rid, (seen, _) in directory.routers.items()}
    for kind, seen in ((WORKER, cards), (ROUTER, presences)):
        services = by_role[kind]
        for pid in sorted(seen.keys() | services.keys()):
            card, age = seen.get(pid, (None, None))
            answering = services.get(pid)
            if pid not in seen:
                health = DRAINING if pid in draining else NO_CARD
            else:
                health = UP if answering is not None else NO_SRV
            view.rows[kind].append(Row(kind, pid, health, card, age, answering))
    for sid, service in sorted(by_role[FRONTEND].items()):
        view.rows[FRONTEND].append(Row(FRONTEND, sid, UP, srv=service))
    return view


class Departures:
    """What `--watch` showed before, so that a process no longer known to discovery or
    `$SRV` is listed as `gone` (for `GONE_KEPT_S`) instead of vanishing between frames."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], Row] = {}
        self._gone: dict[tuple[str, str], tuple[Row, float]] = {}

    def add_to(self, view: MeshView) -> None:
        now = time.monotonic()
        current = {(r.kind, r.id): r for rows in view.rows.values() for r in rows}
        for key, row in self._last.items():
            if key not in current and key not in self._gone:
                self._gone[key] = (row, now)
        for key in list(self._gone):
            if key in current or now - self._gone[key][1] > GONE_KEPT_S:
                del self._gone[key]
        self._last = current
        for (kind, pid), (row, since) in sorted(self._gone.items()):
            view.rows[kind].append(
                Row(kind, pid, GONE, row.card, None, row.srv, gone_for_s=now - since)
            )


def _int(value: object) -> int | None:
    return value if type(value) is int else None


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)

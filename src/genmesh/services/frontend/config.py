"""`genmesh frontend`: everything a frontend is configured with, declared once
(`shared/settings.py` derives the flags, variables and --help from it)."""

from __future__ import annotations

from dataclasses import dataclass

from genmesh.client.mesh_client import DEFAULT_RECONNECT_HOLD_S
from genmesh.formats.catalog import DEFAULT_GENERATE_FORMAT
from genmesh.records.config import RecordsConfig
from genmesh.routing.busy import AdmissionConfig
from genmesh.routing.pairing import PdConfig
from genmesh.routing.policies import POLICY_OPTION, KvConfig
from genmesh.shared.connection import MeshConnection
from genmesh.shared.credentials import NatsAuth, nats_auth_group
from genmesh.shared.settings import group, non_negative_float, option, positive_float, reuse

ROUTING_MODES = ("frontend", "routers")


@dataclass(frozen=True, slots=True)
class FrontendConfig:
    mesh: MeshConnection = group(MeshConnection())
    auth: NatsAuth = nats_auth_group()
    host: str = option("127.0.0.1", help="HTTP listen address")
    port: int = option(8000, help="HTTP port")
    reuse_port: bool = option(
        False,
        help="share --port with other frontends (SO_REUSEPORT; the kernel spreads connections "
        "over them); genmesh up --frontends sets it",
    )
    generate_format: str = option(
        DEFAULT_GENERATE_FORMAT,
        help="format that serves /generate (entry-point group genmesh.formats)",
    )
    codec: str = option("msgpack", help="codec for requests on the bus")
    # Routing here saves a process hop and a NATS message per request; routers stay for
    # NATS-level clients, and as an option.
    routing: str = option(
        "frontend",
        choices=ROUTING_MODES,
        help="who picks each request's worker: this frontend (routing core, no router "
        "needed), or the router processes",
    )
    router_policy: str = reuse(POLICY_OPTION)
    kv: KvConfig = group(KvConfig(), title="kv policy (with --routing frontend)")
    # The routers' own options too (`--routing frontend` only): `genmesh up` hands both
    # the same values.
    admission: AdmissionConfig = group(
        AdmissionConfig(), title="admission control (busy workers, the wait queue)"
    )
    pd: PdConfig = group(PdConfig(), title="prefill/decode pairs (with --routing frontend)")
    model: str = option("genmesh-mock", help="model name reported before any worker is known")
    body_limit_mb: float = option(32.0, help="largest request body")
    # Bounds on what one HTTP client holds (docs/limits.md, "Items 3-7"): a slow-loris
    # connection is closed, a slow body answered 408, connections past the bound 503.
    http_idle_timeout_s: float = option(
        75.0,
        flag="--http-idle-timeout",
        parse=positive_float,
        help="seconds a connection may go without sending a request's complete headers "
        "(idle between requests, or sending them slowly) before it is closed",
    )
    http_body_timeout_s: float = option(
        60.0,
        flag="--http-body-timeout",
        parse=positive_float,
        help="seconds a generate request's body may take to arrive (HTTP 408 after)",
    )
    max_connections: int = option(
        4096,
        help="open HTTP connections at most; one more is answered 503 and closed; 0 = no bound",
    )
    ack_timeout_s: float = option(
        2.0,
        flag="--ack-timeout",
        parse=non_negative_float,
        help="seconds to wait for a worker to acknowledge a request",
    )
    idle_timeout_s: float = option(
        60.0,
        flag="--idle-timeout",
        parse=non_negative_float,
        help="seconds a live worker may stay silent before a request fails (or migrates)",
    )
    ping_after_s: float = option(
        0.5,
        flag="--ping-after",
        parse=non_negative_float,
        help="seconds of silence after which a worker is pinged (no answer: it died, migrate)",
    )
    reconnect_hold_s: float = option(
        DEFAULT_RECONNECT_HOLD_S,
        flag="--reconnect-hold",
        parse=non_negative_float,
        help="seconds a request waits for NATS while the connection is re-established, "
        "then 503; 0 = refuse at once",
    )
    migration_limit: int = option(
        3,
        help="how many times a request may move to another worker after a failure; 0 = never",
    )
    request_timeout_s: float = option(
        0.0,
        flag="--request-timeout",
        parse=non_negative_float,
        help="seconds a request may take in all (HTTP 504 after); 0 = no limit; a request's "
        "X-Request-Timeout header may set a shorter one",
    )
    # Keys as SGLang's --api-key and --admin-api-key guard routes (admin.py): the API key
    # every route but health and metrics; the admin routes (aborts, flush) need the admin
    # key when one is set, else the API key when that is set.
    api_key: str | None = option(
        None,
        secret=True,
        help="require 'Authorization: Bearer <key>' on every route but health/metrics",
    )
    admin_api_key: str | None = option(
        None, secret=True, help="require this key instead on the admin routes (abort, flush_cache)"
    )
    admin_timeout_s: float = option(
        5.0,
        flag="--admin-timeout",
        parse=non_negative_float,
        help="seconds an abort or /flush_cache waits for every worker to answer",
    )
    records: RecordsConfig = group(RecordsConfig(), title="request trace records")


def format_variables_help() -> str:
    """The GENMESH_<NAME>_PATH variable of every installed format (read by the catalog,
    `formats/catalog.py`), for `genmesh frontend --help`."""
    from genmesh.formats.catalog import installed_formats, path_variable

    lines = ["variables of the installed formats:"]
    for name, cls in sorted(installed_formats().items()):
        routes = ", ".join(f"{r.method} {r.path}" for r in cls.default_routes())
        lines.append(f"  {path_variable(name)}")
        lines.append(f"      serve the {name} format on this path instead of {routes}")
    return "\n".join(lines)

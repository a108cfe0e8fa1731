"""`genmesh up`: its options, declared once (`shared/settings.py`), re-using the
declarations of the services it starts. A module that imports nothing heavy, so --help
stays quick."""

from __future__ import annotations

from dataclasses import dataclass

from genmesh.services.frontend.config import FrontendConfig
from genmesh.services.router.config import RouterConfig
from genmesh.services.worker.config import WorkerProcessConfig
from genmesh.shared.connection import MeshConnection, MetricsConfig
from genmesh.shared.credentials import NatsAuth, nats_auth_group
from genmesh.shared.settings import group, non_negative_int, option, positive_int


@dataclass(frozen=True, slots=True)
class UpConfig:
    """`genmesh up`: the options of the services it starts, re-used from their own
    declarations, and its own: how many of each, engine URLs, the first metrics port.
    `records.path` is here, not left to the frontends' environment, because several
    frontends must not write one file (`up.run.frontend_configs`)."""

    mesh: MeshConnection = group(MeshConnection(nats_url=""))  # "": start an embedded one
    auth: NatsAuth = nats_auth_group()
    frontend: FrontendConfig = group(
        FrontendConfig(),
        only=(
            "host",
            "port",
            "routing",
            "api_key",
            "admin_api_key",
            "admin_timeout_s",
            "records.path",
        ),
    )
    frontends: int = option(
        1,
        parse=positive_int,
        help="number of frontend processes, all on --port (SO_REUSEPORT: the kernel spreads "
        "connections over them); with more than one, each writes its own --request-trace "
        "file, PATH-f<n>",
    )
    # None: 2, or none beside prefill/decode workers (a P/D mesh is one by default).
    workers: int | None = option(
        None,
        parse=non_negative_int,
        help="number of mock worker processes running whole requests (role both); "
        "default 2, or 0 when --prefill-workers or --decode-workers is given",
    )
    prefill_workers: int = option(
        0,
        parse=non_negative_int,
        help="number of mock workers with --role prefill: they run the prefill of the "
        "requests routed to decode workers (docs/disaggregation.md); needs --decode-workers",
    )
    decode_workers: int = option(
        0,
        parse=non_negative_int,
        help="number of mock workers with --role decode: each request routed to one is "
        "paired with a prefill worker, or runs there alone (--pd-local-prefill-tokens)",
    )
    # Routers serve NATS-level clients (and the frontend with --routing routers); the
    # frontend routes its own requests by default, so a mesh for HTTP clients needs none.
    routers: int = option(
        1, parse=non_negative_int, help="number of router processes (0: none; HTTP only)"
    )
    router: RouterConfig = group(RouterConfig(), only=("policy", "kv", "admission", "pd"))
    worker: WorkerProcessConfig = group(
        WorkerProcessConfig(),
        only=("engine", "service.max_concurrency", "service.drain_timeout_s", "mock"),
    )
    engine_urls: tuple[str, ...] = option(
        (),
        flag="--engine-url",
        repeat=True,
        help="HTTP address of an SGLang/vLLM server; repeat for several, one worker each",
    )
    prefill_urls: tuple[str, ...] = option(
        (),
        flag="--prefill-url",
        repeat=True,
        help="HTTP address of an SGLang/vLLM server that prefills for decode servers "
        "(SGLang's --disaggregation-mode prefill; vLLM with a KV connector); one worker "
        "with --role prefill each",
    )
    decode_urls: tuple[str, ...] = option(
        (),
        flag="--decode-url",
        repeat=True,
        help="HTTP address of an SGLang/vLLM server in decode mode; one worker with "
        "--role decode each",
    )
    metrics_port: int = option(
        0,
        flag="--metrics-port",
        help="first Prometheus metrics port: routers, then workers, get one each from it; 0 = off",
    )
    metrics: MetricsConfig = group(MetricsConfig(), only=("host",))

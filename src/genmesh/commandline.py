"""The `genmesh` commands: each one's name, help and typed config.

Configs are named by reference ("module:Class"), so listing the commands imports none of
them: `genmesh --help` stays as quick as Python's start-up. `genmesh.cli` builds the
parsers from this table; `command_argv` goes the other way, from a config to the command
line that runs it, for the process supervisor (`genmesh up`, the tests' meshes, the
benchmarks).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, NamedTuple


class Command(NamedTuple):  # not a dataclass: `dataclasses` would double --help's imports
    help: str
    config: str = ""  # "module:Class" of its typed config
    description: str | None = None
    epilog: str | None = None  # more help text
    epilog_from: str | None = None  # "module:function" returning more help text
    actions: Mapping[str, Command] = {}  # `trace check`, ... (never changed)

    def full_epilog(self) -> str | None:
        parts = [self.epilog, load(self.epilog_from)() if self.epilog_from else None]
        return "\n\n".join(p for p in parts if p) or None


# Read by the OpenTelemetry SDK (shared/tracing.py), not declared as options.
TRACING = (
    "traces: the standard OTEL_* variables, e.g. OTEL_TRACES_EXPORTER=otlp|console and\n"
    "OTEL_EXPORTER_OTLP_ENDPOINT (docs/observability.md)"
)


COMMANDS: dict[str, Command] = {
    "up": Command(
        "run NATS, routers, workers and the HTTP frontend as separate processes",
        "genmesh.up.config:UpConfig",
        "Run a whole mesh on this machine: a NATS server (unless --nats-url is given), "
        "routers, mock workers and the HTTP frontend, each its own process so they can be "
        "killed one by one. Ctrl-C or SIGTERM stops everything. Each service also reads its "
        "own variables (genmesh frontend|router|worker --help).",
        epilog=TRACING,
    ),
    "frontend": Command(
        "run the HTTP frontend",
        "genmesh.services.frontend.config:FrontendConfig",
        epilog=TRACING,
        epilog_from="genmesh.services.frontend.config:format_variables_help",
    ),
    "router": Command(
        "run a router", "genmesh.services.router.config:RouterConfig", epilog=TRACING
    ),
    "worker": Command(
        "run a worker in front of an engine",
        "genmesh.services.worker.config:WorkerProcessConfig",
        epilog=TRACING,
    ),
    "nats": Command("run the bundled NATS server", "genmesh.shared.natsserver:NatsServerConfig"),
    "testkit": Command(
        "run a mock SGLang or vLLM server (no GPU), for tests and demos",
        "genmesh.testkit.config:TestkitConfig",
        "Run a mock engine server that speaks SGLang's /generate or vLLM's "
        "/inference/v1/generate with deterministic tokens, and takes injected faults "
        "through /testkit/ admin routes (see genmesh.testkit.common).",
    ),
    "trace": Command(
        "check or replay request trace records",
        description="Work with the request trace records a frontend writes "
        "(--request-trace / GENMESH_REQUEST_TRACE; see docs/observability.md).",
        actions={
            "check": Command(
                "verify record files: schema, unique IDs, counts and hashes",
                "genmesh.records.config:TraceCheckConfig",
                "Read .jsonl and .jsonl.gz record files (a PATH.jsonl.gz that does not "
                "exist stands for its segments PATH.<n>.jsonl.gz), check every record, and "
                "print counts by status and error type. Exits 0 if all is well, 1 if not.",
            ),
            "replay": Command(
                "send recorded requests again and compare the outputs",
                "genmesh.records.config:TraceReplayConfig",
                "Send the request body of every payload record (--request-trace-payload) "
                "to the same method and endpoint of URL, and compare each generation's "
                "output hash with the recorded one. Exits 0 if nothing mismatched or "
                "failed, 1 if not.",
            ),
        },
    ),
    "bench": Command(
        "load-test a native generate endpoint: latency percentiles, throughput, plots",
        "genmesh.bench.config:BenchConfig",
        "Send generate requests to any server of the native token-in/token-out APIs "
        "(genmesh, SGLang /generate, vLLM /inference/v1/generate, Dynamo) and measure "
        "time to first token, inter-token latency, end to end, throughput and errors. "
        "Closed loop (--concurrency) or open loop (--request-rate, Poisson), prompt and "
        "output lengths fixed or sampled, shared-prefix groups, SSE (--stream) or unary. "
        "Exits 0 when every measured request succeeded, 1 when some failed, 130 when "
        "Ctrl-C or SIGTERM stopped it: the requests in flight are cut off, and the table, "
        "--json-out and --plot show those that completed (a second Ctrl-C exits at once; "
        "docs/bench.md).",
        epilog="examples:\n"
        "  genmesh bench --url http://127.0.0.1:8000 --stream -n 2000 -c 32\n"
        "  genmesh bench --url http://127.0.0.1:8000 --format vllm --request-rate 50 "
        "--duration 60\n"
        "  genmesh bench --url http://gpu1:30000 --input-len 1024 --input-len-range 0.5 "
        "--prefix-groups 8 --prefix-len 512 --stream --json-out run.json --plot run.html",
    ),
    "status": Command(
        "show the mesh: routers, workers (engine, role, load, health) and frontends",
        "genmesh.status.config:StatusConfig",
        "Show the mesh of a namespace as it is, from discovery (worker cards, router "
        "presence) and from the NATS micro services every genmesh process runs ($SRV): "
        "each process with its health, load and card age. Once, or redrawn with --watch. "
        "Exits 0 if anything answered, 1 if nothing did, 2 if NATS cannot be reached.",
    ),
    "request": Command(
        "send one request over NATS and print the reply frames as JSON lines",
        "genmesh.commands:RequestConfig",
        "Send one request envelope to the routers (or, with --worker, pinned to a worker) "
        "and print every reply frame as a JSON line. Exits 0 on `end`, 1 on `err`.",
        epilog=TRACING,
    ),
}


def load(ref: str) -> Any:
    """What "module:name" names (the module imported now)."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def command_argv(config: Any) -> list[str]:
    """The `genmesh` arguments that run the command `config` configures, with that config
    (secrets excluded: see `settings.to_argv`)."""
    from genmesh.shared.settings import to_argv

    ref = f"{type(config).__module__}:{type(config).__qualname__}"
    for name, command in COMMANDS.items():
        if command.config == ref:
            return [name, *to_argv(config)]
    raise LookupError(f"no genmesh command takes a {type(config).__qualname__}")

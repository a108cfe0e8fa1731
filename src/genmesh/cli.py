"""The `genmesh` command. Every option can also be set as an environment variable
GENMESH_<NAME> (e.g. --nats-url / GENMESH_NATS_URL); a flag wins over the variable.

Each command's options are the declarations of its typed config (`shared/settings.py`),
which lives next to the code it configures; this module only lists the commands. A
command's config module is imported only when that command runs, so `genmesh --help`
stays as quick as Python's start-up.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from genmesh import __version__


class _Formatter(argparse.RawDescriptionHelpFormatter):
    pass


class Command(NamedTuple):  # not a dataclass: `dataclasses` would double --help's imports
    help: str
    config: str = ""  # "module:Class" of its typed config
    description: str | None = None
    epilog: str | None = None  # more help text
    epilog_from: str | None = None  # "module:function" returning more help text
    actions: Mapping[str, Command] = {}  # `trace check`, ... (never changed)

    def full_epilog(self) -> str | None:
        parts = [self.epilog, _load(self.epilog_from)() if self.epilog_from else None]
        return "\n\n".join(p for p in parts if p) or None


# Read by the OpenTelemetry SDK (shared/tracing.py), not declared as options.
TRACING = (
    "traces: the standard OTEL_* variables, e.g. OTEL_TRACES_EXPORTER=otlp|console and\n"
    "OTEL_EXPORTER_OTLP_ENDPOINT (docs/observability.md)"
)


COMMANDS: dict[str, Command] = {
    "up": Command(
        "run NATS, routers, workers and the HTTP frontend as separate processes",
        "genmesh.up:UpConfig",
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
        "genmesh.testkit.common:TestkitConfig",
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
                "genmesh.records.check:TraceCheckConfig",
                "Read .jsonl and .jsonl.gz record files (a PATH.jsonl.gz that does not "
                "exist stands for its segments PATH.<n>.jsonl.gz), check every record, and "
                "print counts by status and error type. Exits 0 if all is well, 1 if not.",
            ),
            "replay": Command(
                "send recorded requests again and compare the outputs",
                "genmesh.records.replay:TraceReplayConfig",
                "Send the request body of every payload record (--request-trace-payload) "
                "to the same method and endpoint of URL, and compare each generation's "
                "output hash with the recorded one. Exits 0 if nothing mismatched or "
                "failed, 1 if not.",
            ),
        },
    ),
    "request": Command(
        "send one request over NATS and print the reply frames as JSON lines",
        "genmesh.commands:RequestConfig",
        "Send one request envelope to the routers (or, with --worker, pinned to a worker) "
        "and print every reply frame as a JSON line. Exits 0 on `end`, 1 on `err`.",
        epilog=TRACING,
    ),
}


def _load(ref: str) -> Any:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def load_config_class(command: Command) -> type:
    """The config class of `command` (imported now)."""
    config: type = _load(command.config)
    return config


def _top_parser() -> argparse.ArgumentParser:
    """`genmesh --help`: the commands and what they do, without loading any of them."""
    parser = argparse.ArgumentParser(
        prog="genmesh",
        description=(
            "genmesh: a serving mesh over NATS for the native token-in/token-out generate "
            "APIs of LLM engines (SGLang /generate).\n\n"
            "  genmesh up        run a whole mesh on this machine (start here)\n"
            "  genmesh request   send one request over NATS and print the reply frames"
        ),
        epilog="Every option can also be set as the environment variable shown beside it.",
        formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=f"genmesh {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        sub.add_parser(name, help=command.help, add_help=False)
    return parser


def _command_parser(
    prog: str, command: Command, environ: Mapping[str, str], parser: Any = None
) -> tuple[argparse.ArgumentParser, Callable[[argparse.Namespace], tuple[str, Any]]]:
    """The full parser of one command, and how to read its namespace back as
    (handler name, typed config)."""
    from genmesh.shared.settings import ConfigOptions

    if parser is None:
        parser = argparse.ArgumentParser(
            prog=prog,
            description=command.description,
            epilog=command.full_epilog(),
            formatter_class=_Formatter,
        )
    name = prog.removeprefix("genmesh ").replace(" ", "_")
    if command.actions:
        readers: dict[str, Callable[[argparse.Namespace], tuple[str, Any]]] = {}
        actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
        for action, sub in command.actions.items():
            sub_parser = actions.add_parser(
                action, help=sub.help, description=sub.description, formatter_class=_Formatter
            )
            _, readers[action] = _command_parser(f"{prog} {action}", sub, environ, sub_parser)
        return parser, lambda ns: readers[ns.action](ns)
    options = ConfigOptions(load_config_class(command))
    options.add_to(parser, environ)
    return parser, lambda ns: (name, options.config(ns))


def parse_command(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> tuple[str, Any]:
    """(handler name, typed config) for a `genmesh` command line, e.g.
    ("worker", WorkerProcessConfig(...)) or ("trace_check", TraceCheckConfig(...)).
    --help, --version and mistakes exit, as argparse does."""
    argv = list(argv)
    if argv and argv[0] in COMMANDS:
        env = os.environ if environ is None else environ
        parser, read = _command_parser(f"genmesh {argv[0]}", COMMANDS[argv[0]], env)
        return read(parser.parse_args(argv[1:]))
    _top_parser().parse_args(argv)  # exits: help, version, or no such command
    raise SystemExit(2)  # pragma: no cover (the top parser needs a command)


def command_argv(config: Any) -> list[str]:
    """The `genmesh` arguments that run the command `config` configures, with that config
    (secrets excluded: see `settings.to_argv`)."""
    from genmesh.shared.settings import to_argv

    ref = f"{type(config).__module__}:{type(config).__qualname__}"
    for name, command in COMMANDS.items():
        if command.config == ref:
            return [name, *to_argv(config)]
    raise LookupError(f"no genmesh command takes a {type(config).__qualname__}")


def main(argv: Sequence[str] | None = None) -> int:
    name, config = parse_command(sys.argv[1:] if argv is None else argv)
    from genmesh import commands

    handler: Callable[[Any], int] = getattr(commands, f"cmd_{name}")
    try:
        return handler(config)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""The `genmesh` command. Every option can also be set as an environment variable
GENMESH_<NAME> (e.g. --nats-url / GENMESH_NATS_URL); a flag wins over the variable.

Each command's options are the declarations of its typed config (`shared/settings.py`),
which lives next to the code it configures; the commands are listed in
`genmesh.commandline`, and this module builds their parsers. A command's config module is
imported only when that command runs, so `genmesh --help` stays as quick as Python's
start-up.
"""

from __future__ import annotations

import argparse
import os
import sys
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from genmesh import __version__
from genmesh.commandline import COMMANDS, Command, load


class _Formatter(argparse.RawDescriptionHelpFormatter):
    pass


class _Parser(argparse.ArgumentParser):
    """A mistake is one line (argparse would print the whole usage first, which for a
    command of 60 options buries the line that matters)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def load_config_class(command: Command) -> type:
    """The config class of `command` (imported now)."""
    config: type = load(command.config)
    return config


def _top_parser() -> argparse.ArgumentParser:
    """`genmesh --help`: the commands and what they do, without loading any of them."""
    parser = _Parser(
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
        parser = _Parser(
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


def main(argv: Sequence[str] | None = None) -> int:
    name, config = parse_command(sys.argv[1:] if argv is None else argv)
    from genmesh import commands
    from genmesh.shared.lifecycle import STOPPED_BY_SIGNAL

    handler: Callable[[Any], int] = getattr(commands, f"cmd_{name}")
    try:
        return handler(config)
    except KeyboardInterrupt:
        return STOPPED_BY_SIGNAL


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

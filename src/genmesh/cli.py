"""The `genmesh` command. Every option can also be set as an environment variable
GENMESH_<NAME> (e.g. --nats-url / GENMESH_NATS_URL); a flag wins over the variable."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from genmesh import __version__

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


class _Formatter(argparse.RawDescriptionHelpFormatter):
    pass


def _env_name(flag: str) -> str:
    return "GENMESH_" + flag.lstrip("-").replace("-", "_").upper()


# A parser, or a titled group of its options in --help.
_Options = argparse.ArgumentParser | argparse._ArgumentGroup


def option(
    parser: _Options,
    flag: str,
    *,
    help: str,
    type: Callable[[str], Any] = str,
    default: Any = None,
    choices: Sequence[str] | None = None,
    required: bool = False,
    env: str | None = None,
    secret: bool = False,
) -> None:
    """An option that falls back to its GENMESH_ variable (`env`, or one named after the
    flag), then to `default`. A `secret`'s value is never shown in --help."""
    env = env or _env_name(flag)
    raw = os.environ.get(env)
    if raw is not None and raw != "":
        try:
            default = type(raw)
        except (TypeError, ValueError):
            message = f"{env}={raw!r} is not a valid value for {flag}"
            if isinstance(parser, argparse.ArgumentParser):
                parser.error(message)
            sys.exit(f"genmesh: error: {message}")
        required = False
    shown = "" if default is None else "; set" if secret else f"; default: {default}"
    parser.add_argument(
        flag,
        type=type,
        default=default,
        choices=choices,
        required=required,
        help=f"{help} [env {env}{shown}]",
    )


def flag(parser: _Options, name: str, *, help: str) -> None:
    env = _env_name(name)
    default = os.environ.get(env, "").lower() in ("1", "true", "yes", "on")
    parser.add_argument(name, action="store_true", default=default, help=f"{help} [env {env}]")


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise ValueError(value)
    return number


def _non_negative_float(value: str) -> float:
    number = float(value)
    if number < 0:
        raise ValueError(value)
    return number


def _token_ids(value: str) -> list[int]:
    return [int(part) for part in value.replace(" ", "").split(",") if part]


def _nats_auth_options(parser: argparse.ArgumentParser) -> None:
    """Credentials and TLS for the NATS connection (docs/deploy.md, "Credentials")."""
    group = parser.add_argument_group(
        "NATS credentials and TLS",
        "Give one way to authenticate: a user and password, a token, an nkey seed or a "
        "creds file. Secrets are best given as files (--nats-password-file, ...).",
    )
    option(group, "--nats-user", help="NATS user name")
    option(
        group,
        "--nats-password",
        help="NATS password (prefer --nats-password-file)",
        secret=True,
    )
    option(group, "--nats-password-file", help="file holding the NATS password")
    option(group, "--nats-token", help="NATS token (prefer --nats-token-file)", secret=True)
    option(group, "--nats-token-file", help="file holding the NATS token")
    option(
        group,
        "--nats-nkey-seed",
        help="nkey user seed file (or the seed itself, SU...)",
        secret=True,
    )
    option(group, "--nats-creds", help="NATS JWT credentials file (operator mode)")
    option(group, "--nats-tls-ca", help="CA certificate(s) to verify the NATS server with")
    option(group, "--nats-tls-cert", help="client certificate for NATS (mutual TLS)")
    option(group, "--nats-tls-key", help="private key of --nats-tls-cert")
    flag(
        group,
        "--nats-tls-handshake-first",
        help="start TLS before the NATS greeting (server tls { handshake_first: true })",
    )
    option(
        group,
        "--nats-inbox-prefix",
        help="subject prefix of this connection's reply inboxes, where the NATS user may "
        "subscribe (default: the role's, e.g. _INBOX_client; see docs/deploy.md)",
    )


def _common(
    parser: argparse.ArgumentParser, *, nats_default: str | None = DEFAULT_NATS_URL
) -> None:
    option(
        parser,
        "--nats-url",
        default=nats_default,
        help="NATS server URL; several, comma-separated, for a cluster",
    )
    option(parser, "--namespace", default="default", help="mesh namespace (a subject token)")
    option(
        parser,
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level",
    )
    _nats_auth_options(parser)


def _mock_options(parser: argparse.ArgumentParser) -> None:
    option(
        parser,
        "--mock-speedup",
        type=_non_negative_float,
        default=1.0,
        help="mock engine speed-up over its timing model; 0 = instant",
    )
    option(parser, "--mock-model", default="genmesh-mock", help="model name the mock serves")
    option(parser, "--mock-vocab-size", type=_positive_int, default=151_936, help="mock vocabulary")
    option(parser, "--mock-eos-token-id", type=int, default=151_645, help="mock EOS token id")
    option(
        parser,
        "--mock-max-model-len",
        type=_positive_int,
        default=32_768,
        help="mock context length (prompt + output)",
    )


def _metrics_options(parser: argparse.ArgumentParser, *, base: bool = False) -> None:
    what = (
        "first Prometheus metrics port: routers, then workers, get one each from it"
        if base
        else "HTTP port serving Prometheus metrics on /metrics"
    )
    option(parser, "--metrics-port", type=int, default=0, help=f"{what}; 0 = off")
    option(parser, "--metrics-host", default="127.0.0.1", help="metrics listen address")


def _request_trace_options(parser: argparse.ArgumentParser) -> None:
    option(
        parser,
        "--request-trace",
        default=None,
        help="write one trace record per request to this file: PATH.jsonl (appended) or "
        "PATH.jsonl.gz (segments PATH.<n>.jsonl.gz that roll)",
    )
    flag(parser, "--request-trace-nats", help="publish each record on genmesh.<ns>.trace")
    flag(
        parser,
        "--request-trace-payload",
        help="records also hold the request body and the prompt and output token ids",
    )
    option(
        parser,
        "--request-trace-roll-mb",
        type=_non_negative_float,
        default=256.0,
        help=".jsonl.gz: start a new segment after this many MiB of JSON; 0 = no limit",
    )
    option(
        parser,
        "--request-trace-roll-lines",
        type=int,
        default=0,
        help=".jsonl.gz: start a new segment after this many records; 0 = no limit",
    )
    option(
        parser,
        "--request-trace-block-size",
        type=_positive_int,
        default=64,
        help="tokens per prompt block hash in the records",
    )


def _trace_command(sub: Any) -> None:
    trace = sub.add_parser(
        "trace",
        help="check or replay request trace records",
        description=(
            "Work with the request trace records a frontend writes "
            "(--request-trace / GENMESH_REQUEST_TRACE; see docs/observability.md)."
        ),
        formatter_class=_Formatter,
    )
    actions = trace.add_subparsers(dest="trace_command", metavar="ACTION", required=True)
    check = actions.add_parser(
        "check",
        help="verify record files: schema, unique IDs, counts and hashes",
        description=(
            "Read .jsonl and .jsonl.gz record files (a PATH.jsonl.gz that does not exist "
            "stands for its segments PATH.<n>.jsonl.gz), check every record, and print "
            "counts by status and error type. Exits 0 if all is well, 1 if not."
        ),
        formatter_class=_Formatter,
    )
    check.add_argument("files", nargs="+", metavar="FILE", help="record files or segments")
    check.add_argument(
        "--expect", type=int, default=None, help="fail unless there are exactly this many records"
    )
    check.add_argument("--json", action="store_true", help="print the summary as JSON")
    replay = actions.add_parser(
        "replay",
        help="send recorded requests again and compare the outputs",
        description=(
            "Send the request body of every payload record (--request-trace-payload) to "
            "the same method and endpoint of URL, and compare each generation's output hash "
            "with the recorded one. Exits 0 if nothing mismatched or failed, 1 if not."
        ),
        formatter_class=_Formatter,
    )
    replay.add_argument("files", nargs="+", metavar="FILE", help="record files or segments")
    replay.add_argument("--url", required=True, help="frontend address, e.g. http://127.0.0.1:8000")
    replay.add_argument(
        "--concurrency", type=_positive_int, default=8, help="requests in flight at once"
    )
    replay.add_argument(
        "--timeout", type=float, default=120.0, help="seconds one replayed request may take"
    )
    replay.add_argument("--json", action="store_true", help="print the summary as JSON")
    replay.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _worker_options(parser: argparse.ArgumentParser, *, many_urls: bool = False) -> None:
    option(
        parser,
        "--engine",
        default="mock",
        choices=["mock", "sglang", "vllm"],
        help="engine adapter: the in-process mock, or a client of a real SGLang/vLLM server",
    )
    if many_urls:
        env = os.environ.get("GENMESH_ENGINE_URL", "")
        parser.add_argument(
            "--engine-url",
            action="append",
            default=None,
            help="HTTP address of an SGLang/vLLM server; repeat for several, one worker each "
            "[env GENMESH_ENGINE_URL, comma-separated]",
        )
        parser.set_defaults(engine_url_env=[u for u in env.split(",") if u])
    else:
        option(parser, "--engine-url", default=None, help="HTTP address of the SGLang/vLLM server")
    option(
        parser,
        "--max-concurrency",
        type=_positive_int,
        default=256,
        help="requests a worker runs at once; more are refused as overloaded (HTTP 503)",
    )
    _mock_options(parser)


def build_parser() -> argparse.ArgumentParser:
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

    up = sub.add_parser(
        "up",
        help="run NATS, routers, workers and the HTTP frontend as separate processes",
        description=(
            "Run a whole mesh on this machine: a NATS server (unless --nats-url is given), "
            "routers, mock workers and the HTTP frontend, each its own process so they can be "
            "killed one by one. Ctrl-C or SIGTERM stops everything."
        ),
        formatter_class=_Formatter,
    )
    _common(up, nats_default=None)
    option(up, "--host", default="127.0.0.1", help="HTTP listen address")
    option(up, "--port", type=int, default=8000, help="HTTP port")
    option(up, "--workers", type=int, default=2, help="number of worker processes")
    option(up, "--routers", type=_positive_int, default=1, help="number of router processes")
    option(
        up,
        "--router-policy",
        default="round_robin",
        choices=["round_robin", "random", "least_loaded"],
        help="how routers pick a worker",
    )
    _worker_options(up, many_urls=True)
    option(
        up,
        "--drain-timeout",
        type=_non_negative_float,
        default=30.0,
        help="on Ctrl-C, seconds workers let in-flight requests finish",
    )
    _metrics_options(up, base=True)

    frontend = sub.add_parser("frontend", help="run the HTTP frontend", formatter_class=_Formatter)
    _common(frontend)
    option(frontend, "--host", default="127.0.0.1", help="HTTP listen address")
    option(frontend, "--port", type=int, default=8000, help="HTTP port")
    option(
        frontend,
        "--generate-format",
        default="sglang",
        help="format that serves /generate (entry-point group genmesh.formats)",
    )
    option(frontend, "--codec", default="msgpack", help="codec for requests on the bus")
    option(
        frontend,
        "--model",
        default="genmesh-mock",
        help="model name reported before any worker is known",
    )
    option(frontend, "--body-limit-mb", type=float, default=32.0, help="largest request body")
    option(
        frontend,
        "--ack-timeout",
        type=_non_negative_float,
        default=2.0,
        help="seconds to wait for a worker to acknowledge a request",
    )
    option(
        frontend,
        "--idle-timeout",
        type=_non_negative_float,
        default=60.0,
        help="seconds a live worker may stay silent before a request fails (or migrates)",
    )
    option(
        frontend,
        "--ping-after",
        type=_non_negative_float,
        default=0.5,
        help="seconds of silence after which a worker is pinged (no answer: it died, migrate)",
    )
    option(
        frontend,
        "--migration-limit",
        type=int,
        default=3,
        help="how many times a request may move to another worker after a failure; 0 = never",
    )
    option(
        frontend,
        "--request-timeout",
        type=_non_negative_float,
        default=0.0,
        help="seconds a request may take in all (HTTP 504 after); 0 = no limit; a request's "
        "X-Request-Timeout header may set a shorter one",
    )
    _request_trace_options(frontend)

    router = sub.add_parser("router", help="run a router", formatter_class=_Formatter)
    _common(router)
    option(
        router,
        "--router-policy",
        default="round_robin",
        choices=["round_robin", "random", "least_loaded"],
        help="how to pick a worker",
    )
    _metrics_options(router)

    worker = sub.add_parser(
        "worker", help="run a worker in front of an engine", formatter_class=_Formatter
    )
    _common(worker)
    option(worker, "--worker-id", default=None, help="worker id (a subject token); random if unset")
    _worker_options(worker)
    flag(
        worker,
        "--testkit-faults",
        help="tests only: let genmesh.<ns>.testkit.<worker id> requests inject engine faults",
    )
    option(
        worker,
        "--drain-timeout",
        type=_non_negative_float,
        default=30.0,
        help="on SIGTERM, seconds in-flight requests may take before they migrate elsewhere",
    )
    option(
        worker,
        "--heartbeat-interval",
        type=float,
        default=1.0,
        help="seconds between announcements; routers drop a worker after 3 missed",
    )
    _metrics_options(worker)

    nats_cmd = sub.add_parser(
        "nats", help="run the bundled NATS server", formatter_class=_Formatter
    )
    option(nats_cmd, "--host", default="127.0.0.1", help="listen address")
    option(nats_cmd, "--nats-port", type=int, default=4222, help="client port (-1 = any free port)")

    testkit = sub.add_parser(
        "testkit",
        help="run a mock SGLang or vLLM server (no GPU), for tests and demos",
        description=(
            "Run a mock engine server that speaks SGLang's /generate or vLLM's "
            "/inference/v1/generate with deterministic tokens, and takes injected faults "
            "through /testkit/ admin routes (see genmesh.testkit.common)."
        ),
        formatter_class=_Formatter,
    )
    testkit.add_argument("engine", choices=["sglang", "vllm"], help="which engine to mock")
    # Own variables: a mock engine beside a frontend must not take the frontend's settings.
    option(
        testkit, "--host", default="127.0.0.1", help="listen address", env="GENMESH_TESTKIT_HOST"
    )
    option(testkit, "--port", type=int, default=30000, help="HTTP port", env="GENMESH_TESTKIT_PORT")
    option(
        testkit,
        "--model",
        default="genmesh-mock",
        help="served model name",
        env="GENMESH_TESTKIT_MODEL",
    )
    option(testkit, "--vocab-size", type=_positive_int, default=151_936, help="vocabulary")
    option(testkit, "--eos-token-id", type=int, default=151_645, help="EOS token id")
    option(testkit, "--max-model-len", type=_positive_int, default=32_768, help="context length")
    option(testkit, "--token-delay-ms", type=_non_negative_float, default=0.0, help="per token")
    flag(testkit, "--incremental", help="SGLang: incremental (delta) streaming output")
    flag(testkit, "--no-tokens-only", help="vLLM: without --tokens-only (no /abort_requests)")
    option(
        testkit,
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="log level",
    )

    _trace_command(sub)

    req = sub.add_parser(
        "request",
        help="send one request over NATS and print the reply frames as JSON lines",
        description=(
            "Send one request envelope to the routers (or, with --worker, pinned to a worker) "
            "and print every reply frame as a JSON line. Exits 0 on `end`, 1 on `err`."
        ),
        formatter_class=_Formatter,
    )
    _common(req)
    option(req, "--input-ids", type=_token_ids, default=None, help="prompt, e.g. 1,2,3")
    option(req, "--envelope", default=None, help="a JSON envelope file ('-' = stdin) instead")
    option(req, "--max-tokens", type=int, default=16, help="generation budget")
    option(req, "--min-tokens", type=int, default=0, help="tokens before a stop may happen")
    option(req, "--seed", type=int, default=None, help="sampling seed")
    option(req, "--stop-token-ids", type=_token_ids, default=None, help="e.g. 7,9")
    flag(req, "--ignore-eos", help="do not stop at EOS")
    flag(req, "--logprobs", help="return output logprobs")
    option(req, "--top-logprobs", type=int, default=0, help="alternatives per position")
    option(req, "--worker", default=None, help="pin the request to this worker id")
    option(req, "--codec", default="msgpack", help="codec of the request (replies match it)")
    option(req, "--timeout", type=float, default=60.0, help="seconds of silence before giving up")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from genmesh import commands

    handler: Callable[[argparse.Namespace], int] = getattr(commands, f"cmd_{args.command}")
    try:
        return handler(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

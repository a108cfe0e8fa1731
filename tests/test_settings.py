"""Options declared once (`genmesh.shared.settings`): the flags, variables and --help of
every command are derived from its typed config, and `to_argv` gives the config back."""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import dataclass, replace
from typing import Any

import pytest

from genmesh.bench.config import BenchConfig
from genmesh.cli import parse_command
from genmesh.commandline import COMMANDS, command_argv
from genmesh.commands import RequestConfig
from genmesh.engines.mock import MockConfig
from genmesh.records.config import (
    RecordsConfig,
    TraceCheckConfig,
    TraceReplayConfig,
    config_from_env,
)
from genmesh.routing.pairing import PdConfig
from genmesh.services.frontend.config import FrontendConfig
from genmesh.services.router.config import RouterConfig
from genmesh.services.worker.config import WorkerConfig, WorkerProcessConfig
from genmesh.shared.connection import MeshConnection, MetricsConfig
from genmesh.shared.credentials import NatsAuth
from genmesh.shared.natsserver import NatsServerConfig
from genmesh.shared.settings import (
    InvalidValue,
    from_env,
    group,
    option,
    parse,
    specs,
    to_argv,
    to_env,
    variables,
)
from genmesh.status.config import StatusConfig
from genmesh.testkit.config import MockServerConfig, TestkitConfig
from genmesh.up.config import UpConfig
from genmesh.up.run import frontend_configs, worker_configs

pytestmark = pytest.mark.unit

MESH = MeshConnection(nats_url="nats://10.0.0.1:4222,nats://10.0.0.2:4222", namespace="n1")

# One config per command, every group and most options away from their defaults.
EXAMPLES: dict[str, Any] = {
    "frontend": FrontendConfig(
        mesh=MESH,
        auth=NatsAuth(user="frontend", password_file="/run/pw", tls_handshake_first=True),
        host="0.0.0.0",
        port=0,
        generate_format="sglang+b64zstd",
        codec="json",
        body_limit_mb=0.5,
        ack_timeout_s=1.25,
        request_timeout_s=3.0,
        migration_limit=0,
        records=RecordsConfig("/tmp/t.jsonl.gz", payload=True, nats=True, roll_lines=9),
    ),
    "router": RouterConfig(
        mesh=MESH,
        router_id="r-1",
        policy="least_loaded",
        pd=PdConfig(local_prefill_tokens=64),
        metrics=MetricsConfig(9101, "0.0.0.0"),
    ),
    "worker": WorkerProcessConfig(
        mesh=MeshConnection(MESH.nats_url, MESH.namespace, log_level="debug"),
        service=WorkerConfig("w-1", max_concurrency=3, heartbeat_interval_s=0.2),
        engine="vllm",
        engine_url="http://127.0.0.1:8100",
        mock=MockConfig(vocab_size=1000, eos_token_id=7, speedup=0.0),
        testkit_faults=True,
    ),
    "up": UpConfig(
        mesh=MeshConnection(nats_url="", namespace="x", log_level="warning"),
        workers=0,
        prefill_workers=1,
        decode_workers=2,
        routers=3,
        router=replace(UpConfig().router, pd=PdConfig(local_prefill_tokens=32)),
        engine_urls=("http://a:1", "http://b:2"),
        prefill_urls=("http://p:1",),
        decode_urls=("http://d:1", "http://d:2"),
        metrics_port=9100,
    ),
    "nats": NatsServerConfig(port=-1),
    "testkit": TestkitConfig(
        engine="vllm",
        port=31000,
        server=MockServerConfig(model="m", token_delay_ms=2.5, tokens_only=False),
    ),
    "request": RequestConfig(
        mesh=MESH,
        input_ids=(1, 2, 3),
        stop_token_ids=(),
        seed=-4,
        logprobs=True,
        worker="w-1",
        timeout_s=1.5,
    ),
    "bench": BenchConfig(
        url="http://127.0.0.1:1/generate",
        format="vllm",
        model="m",
        stream=True,
        requests=5,
        duration_s=2.5,
        concurrency=3,
        request_rate=9.5,
        max_concurrency=4,
        warmup=2,
        input_len_range=0.25,
        output_len=7,
        seed=-1,
        prefix_groups=2,
        prefix_len=8,
        json_out="r.json",
        plot="r.html",
        progress=False,
    ),
    "status": StatusConfig(
        mesh=MeshConnection(MESH.nats_url, MESH.namespace),
        auth=NatsAuth(user="admin", password_file="/run/pw"),
        watch_s=0.5,
        as_json=True,
        timeout_s=2.5,
    ),
    "trace_check": TraceCheckConfig(files=("a.jsonl", "b.jsonl.gz"), expect=5, as_json=True),
    "trace_replay": TraceReplayConfig(
        files=("a.jsonl",), url="http://127.0.0.1:1", concurrency=2, progress=False
    ),
}


def command_line(name: str, config: Any) -> list[str]:
    if name.startswith("trace_"):
        return ["trace", name.removeprefix("trace_"), *to_argv(config)]
    return command_argv(config)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_config_comes_back_from_its_command_line(name: str) -> None:
    config = EXAMPLES[name]
    argv = command_line(name, config)
    assert parse_command(argv, environ={}) == (name, config)


def test_defaults_need_no_arguments() -> None:
    for config_class in (FrontendConfig, UpConfig, NatsServerConfig, RequestConfig):
        assert to_argv(config_class()) == [], config_class
    # Made-up ids are always written out: the command line names the process.
    assert to_argv(RouterConfig(router_id="r7")) == ["--router-id", "r7"]
    assert to_argv(WorkerProcessConfig(service=WorkerConfig("w7"))) == ["--worker-id", "w7"]
    # A required positional is always there.
    assert to_argv(TestkitConfig(engine="sglang")) == ["sglang"]


def test_every_command_is_listed_with_a_config() -> None:
    listed = {n for n, c in COMMANDS.items() if not c.actions} | {
        f"trace_{a}" for a in COMMANDS["trace"].actions
    }
    assert listed == set(EXAMPLES)


def help_of(argv: list[str], environ: dict[str, str] | None = None) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parse_command([*argv, "--help"], environ={} if environ is None else environ)
    return out.getvalue()


@pytest.mark.parametrize("command", ["up", "frontend", "router", "worker", "nats", "request"])
def test_every_variable_is_in_the_help(command: str) -> None:
    config_class = type(EXAMPLES[command])
    text = " ".join(help_of([command]).split())  # argparse wraps lines anywhere
    for variable in variables(config_class):
        assert f"env {variable}" in text, variable


def test_the_frontend_help_lists_the_format_path_variables() -> None:
    text = help_of(["frontend"])
    assert "GENMESH_SGLANG_PATH" in text
    assert "GENMESH_VLLM_PATH" in text


def test_help_shows_variable_and_default_from_the_environment() -> None:
    text = " ".join(help_of(["frontend"], {"GENMESH_PORT": "9123"}).split())
    assert "HTTP port [env GENMESH_PORT; default: 9123]" in text
    assert "[env GENMESH_ACK_TIMEOUT; default: 2.0]" in text
    assert "[env GENMESH_REQUEST_TRACE_NATS]" in text  # a switch has no default to show


def test_secrets_never_show_and_never_go_on_a_command_line() -> None:
    text = help_of(["router"], {"GENMESH_NATS_PASSWORD": "hunter2"})
    assert "hunter2" not in text
    assert "GENMESH_NATS_PASSWORD; set]" in " ".join(text.split())
    auth = NatsAuth(user="u", password="hunter2")
    with pytest.raises(ValueError, match="--nats-password is a secret"):
        to_argv(RouterConfig(auth=auth))
    assert to_env(auth) == {"GENMESH_NATS_USER": "u", "GENMESH_NATS_PASSWORD": "hunter2"}
    assert from_env(NatsAuth, to_env(auth)) == auth


def test_a_bad_variable_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    for environ, message in [
        ({"GENMESH_PORT": "abc"}, "GENMESH_PORT='abc' is not a valid value for --port"),
        ({"GENMESH_LOG_LEVEL": "loud"}, "GENMESH_LOG_LEVEL='loud' is not a valid value"),
        ({"GENMESH_ACK_TIMEOUT": "-1"}, "GENMESH_ACK_TIMEOUT='-1' is not a valid value"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            parse_command(["frontend"], environ=environ)
        assert exit_.value.code == 2
        assert f"genmesh frontend: error: {message}" in capsys.readouterr().err
    with pytest.raises(InvalidValue, match="GENMESH_REQUEST_TRACE_ROLL_MB='x'"):
        config_from_env({"GENMESH_REQUEST_TRACE_ROLL_MB": "x"})


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["worker", "--max-concurrency", "0"],
         "genmesh worker: error: argument --max-concurrency: '0' must be an integer above 0"),
        (["worker", "--max-concurrency", "x"],  # not a number at all: argparse's words
         "genmesh worker: error: argument --max-concurrency: invalid positive_int value: 'x'"),
        (["request", "--timeout", "-5"],
         "genmesh request: error: argument --timeout: '-5' must be a number above 0"),
        (["request", "--timeout", "nan"],
         "genmesh request: error: argument --timeout: 'nan' must be a number above 0"),
        (["request", "--max-tokens", "-1"],
         "genmesh request: error: argument --max-tokens: '-1' must be an integer of 0 or more"),
        (["request", "--namespace", "a.b"],
         "genmesh request: error: argument --namespace: 'a.b' must be 1-64 characters of "
         "A-Z a-z 0-9 _ -"),
        (["up", "--namespace", "a\n"],
         "genmesh up: error: argument --namespace: 'a\\n' must be 1-64 characters of "
         "A-Z a-z 0-9 _ -"),
        (["worker", "--worker-id", "a b"],
         "genmesh worker: error: argument --worker-id: 'a b' must be 1-64 characters of "
         "A-Z a-z 0-9 _ -"),
        (["router", "--router-id", "r>"],
         "genmesh router: error: argument --router-id: 'r>' must be 1-64 characters of "
         "A-Z a-z 0-9 _ -"),
        (["worker", "--heartbeat-interval", "0"],
         "genmesh worker: error: argument --heartbeat-interval: '0' must be a number above 0 "
         "and at most 3600"),
        (["trace", "replay", "f", "--url", "http://h", "--timeout", "0"],
         "genmesh trace replay: error: argument --timeout: '0' must be a number above 0"),
        (["status", "--watch", "0"],
         "genmesh status: error: argument --watch: '0' must be a number above 0"),
    ],
)  # fmt: skip
def test_a_bad_flag_is_one_line_naming_the_rule(
    capsys: pytest.CaptureFixture[str], argv: list[str], error: str
) -> None:
    """One line, not argparse's usage of 60 options first."""
    with pytest.raises(SystemExit) as exit_:
        parse_command(argv, environ={})
    assert exit_.value.code == 2
    prog = error.split(": error:")[0]
    assert capsys.readouterr().err == f"{error} (see {prog} --help)\n"


@pytest.mark.parametrize(
    ("argv", "environ", "watch_s"),
    [
        (["status"], {}, None),
        (["status", "--watch"], {}, 2.0),  # the flag alone: its `bare` value
        (["status", "--watch", "5"], {}, 5.0),
        (["status", "--watch", "--json"], {}, 2.0),
        (["status"], {"GENMESH_WATCH": "3"}, 3.0),
        (["status", "--watch"], {"GENMESH_WATCH": "3"}, 2.0),  # a flag wins over its variable
    ],
)
def test_an_option_may_take_its_value_optionally(
    argv: list[str], environ: dict[str, str], watch_s: float | None
) -> None:
    assert parse_command(argv, environ=environ)[1].watch_s == watch_s


def test_a_bad_variable_names_the_rule(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_command(["frontend"], environ={"GENMESH_NAMESPACE": "a.b"})
    assert capsys.readouterr().err == (
        "genmesh frontend: error: GENMESH_NAMESPACE='a.b' is not a valid value for "
        "--namespace: must be 1-64 characters of A-Z a-z 0-9 _ - (see genmesh frontend --help)\n"
    )


def test_a_flag_wins_over_its_variable_which_wins_over_the_default() -> None:
    env = {"GENMESH_PORT": "9000", "GENMESH_HOST": "0.0.0.0"}
    _, config = parse_command(["frontend", "--port", "9001"], environ=env)
    assert (config.host, config.port) == ("0.0.0.0", 9001)
    assert parse_command(["frontend"], environ={"GENMESH_PORT": ""})[1].port == 8000


@pytest.mark.parametrize(
    ("value", "on"),
    [("1", True), ("true", True), ("YES", True), ("on", True), ("0", False), ("no", False)],
)
def test_switch_variables(value: str, on: bool) -> None:
    _, worker = parse_command(["worker"], environ={"GENMESH_TESTKIT_FAULTS": value})
    assert worker.testkit_faults is on
    # A switch whose default is on is turned off: --no-tokens-only.
    _, testkit = parse_command(["testkit", "vllm"], environ={"GENMESH_NO_TOKENS_ONLY": value})
    assert testkit.server.tokens_only is not on


def test_engine_urls_repeat_and_their_variable_is_comma_separated() -> None:
    env = {"GENMESH_ENGINE_URL": "http://a:1,http://b:2"}
    assert parse_command(["up"], environ=env)[1].engine_urls == ("http://a:1", "http://b:2")
    _, config = parse_command(["up", "--engine-url", "http://c:3"], environ=env)
    assert config.engine_urls == ("http://c:3",)  # the flags replace the variable's list
    assert parse_command(["up"], environ={})[1].engine_urls == ()


def up_workers(*argv: str) -> list[tuple[str, str | None]]:
    """(role, engine URL) of each worker `genmesh up argv` starts, and each one's command
    line checked to carry its role."""
    configs = worker_configs(parse_command(["up", *argv], environ={})[1])
    for config in configs:
        line = command_argv(config)
        assert ("--role" in line) is (config.service.role != "both"), line
        if "--role" in line:
            assert line[line.index("--role") + 1] == config.service.role
    return [(c.service.role, c.engine_url) for c in configs]


def test_up_runs_prefill_and_decode_workers() -> None:
    assert up_workers("--prefill-workers", "1", "--decode-workers", "2") == [
        ("prefill", None),
        ("decode", None),
        ("decode", None),
    ]  # no role-both workers unless asked for
    assert up_workers("--decode-workers", "1", "--workers", "1") == [
        ("decode", None),
        ("both", None),
    ]
    argv = ["--engine", "sglang", "--prefill-url", "http://p:1", "--decode-url", "http://d:1"]
    assert up_workers(*argv, "--engine-url", "http://a:1") == [
        ("both", "http://a:1"),
        ("prefill", "http://p:1"),
        ("decode", "http://d:1"),
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefill-url", "http://p:1"], "--prefill-url needs --engine sglang or --engine vllm"),
        (
            ["--engine", "vllm", "--decode-workers", "1"],
            "--decode-workers runs mock workers; with --engine vllm give --decode-url "
            "(one per server)",
        ),
        (
            ["--engine", "vllm"],
            "--engine vllm needs --engine-url, or --prefill-url and --decode-url (repeat "
            "them for several)",
        ),
        (
            ["--prefill-workers", "2", "--workers", "1"],
            "prefill workers serve decode workers only: add decode workers",
        ),
    ],
)
def test_up_refuses_meshes_it_cannot_run(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        worker_configs(parse_command(["up", *argv], environ={})[1])


def test_up_hands_the_pd_threshold_to_routers_and_frontends_alike() -> None:
    _, up = parse_command(["up", "--pd-local-prefill-tokens", "48"], environ={})
    [(_, frontend)] = frontend_configs(up, MESH)
    assert up.router.pd == frontend.pd == PdConfig(local_prefill_tokens=48)
    for line in (command_argv(frontend), command_argv(up.router)):
        assert line[line.index("--pd-local-prefill-tokens") + 1] == "48"


def test_defaults_as_today() -> None:
    _, worker = parse_command(["worker"], environ={})
    assert worker.mock.speedup == 1.0  # a worker's mock runs in real time...
    assert MockConfig().speedup == 0.0  # ...while the mock itself defaults to instant
    assert worker.service.worker_id.startswith("w")
    assert worker.service.worker_id != parse_command(["worker"], environ={})[1].service.worker_id
    _, up = parse_command(["up"], environ={})
    assert (up.mesh.nats_url, up.routers, up.frontend.port) == ("", 1, 8000)
    assert [w.service.role for w in worker_configs(up)] == ["both", "both"]  # 2 workers
    assert up.worker.service.drain_timeout_s == 30.0
    _, testkit = parse_command(["testkit", "sglang"], environ={"GENMESH_PORT": "1"})
    assert (testkit.port, testkit.log_level) == (30000, "warning")  # its own variables


def test_up_takes_the_services_declarations() -> None:
    """`up` re-uses the services' declarations (the very same Option objects), except for
    the two options whose meaning is its own."""
    # Several URLs; the first of many ports; workers by role.
    own = {"--engine-url", "--metrics-port", "--prefill-url", "--decode-url"}
    taken = {s.flag: s.option for s in specs(UpConfig)}
    shared = set()
    for config_class in (FrontendConfig, RouterConfig, WorkerProcessConfig):
        for spec in specs(config_class):
            if spec.flag in taken and spec.flag not in own:
                assert taken[spec.flag] is spec.option, spec.flag
                shared.add(spec.flag)
    assert {
        "--nats-url",
        "--nats-password",
        "--host",
        "--port",
        "--router-policy",
        "--engine",
        "--max-concurrency",
        "--drain-timeout",
        "--mock-speedup",
        "--metrics-host",
    } <= shared
    assert own <= set(taken)


def test_from_env_reads_the_same_declarations() -> None:
    env = {"GENMESH_REQUEST_TRACE": "x.jsonl", "GENMESH_REQUEST_TRACE_BLOCK_SIZE": "8"}
    assert config_from_env(env) == parse_command(["frontend"], environ=env)[1].records


def test_with_defaults_given_options_not_named_keep_them() -> None:
    base = WorkerProcessConfig(mesh=MESH, service=WorkerConfig("w9"), mock=MockConfig(speedup=0))
    config = parse(WorkerProcessConfig, ["--max-concurrency", "5"], environ={}, defaults=base)
    assert config.service == WorkerConfig("w9", max_concurrency=5)
    assert (config.mesh, config.mock) == (MESH, base.mock)


@dataclass(frozen=True, slots=True)
class Inner:
    level: int = option(1, help="a level")
    hidden: int = 5  # not an option: keeps its value


@dataclass(frozen=True, slots=True)
class Outer:
    name: str = option("a", help="a name 100% plain", env="GENMESH_OUTER_NAME")
    inner: Inner = group(Inner(level=2), title="inner things")
    chosen: Inner = group(Inner(), only=())
    plain: tuple[str, ...] = option((), repeat=True, env=None, help="no variable")


def test_declarations_derive_flags_variables_and_help() -> None:
    found = [(s.flag, s.env, s.dest, s.default) for s in specs(Outer)]
    assert found == [
        ("--name", "GENMESH_OUTER_NAME", "name", "a"),
        ("--level", "GENMESH_LEVEL", "inner.level", 2),
        ("--plain", None, "plain", ()),
    ]
    parser_help = io.StringIO()
    with contextlib.redirect_stdout(parser_help), pytest.raises(SystemExit):
        parse(Outer, ["--help"], environ={})
    text = " ".join(parser_help.getvalue().split())
    assert "a name 100% plain [env GENMESH_OUTER_NAME; default: a]" in text
    assert "inner things: --level LEVEL a level [env GENMESH_LEVEL; default: 2]" in text
    assert "--plain PLAIN no variable" in text
    config = parse(Outer, ["--level", "3", "--plain", "x", "--plain", "y"], environ={})
    assert config == Outer(inner=Inner(level=3), plain=("x", "y"))
    assert to_argv(config) == ["--level", "3", "--plain", "x", "--plain", "y"]

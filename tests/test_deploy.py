"""Deployment: the compose file, the NATS server configs, NATS security and clustering.

Nothing here needs a Docker engine except the compose smoke test at the end, which skips
without one. The security tests run a real nats-server on the shipped configs
(deploy/nats/*.conf, with test ports) and a real mesh whose every process logs in as its
role; the permission matrix below is the table they check, row by row, both ways (an
allowed row must deliver, a denied row must be refused by the server and deliver nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from nats.aio.msg import Msg

from genmesh.cli import load_config_class
from genmesh.client import MeshClient, request
from genmesh.commandline import COMMANDS
from genmesh.deploy import USERS, make_env, new_password, write_nkeys
from genmesh.shared.bus import NatsPermissionDenied, NatsUnreachable, connect, flush_in_order
from genmesh.shared.credentials import NatsAuth
from genmesh.shared.natsserver import NatsServer, find_nats_server
from genmesh.shared.settings import variables
from tests.conftest import unique_namespace
from tests.mesh import Mesh, free_port, start_mesh, wait_until
from tests.srv import gather

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
NATS_DIR = DEPLOY / "nats"
CONFIGS = ("mesh.conf", "mesh-nkeys.conf", "mesh-tls.conf", "cluster.conf")

PASSWORDS = {user: new_password() for user in USERS}
# What the shipped configs read from the server's environment (compose sets the same).
SERVER_ENV = {f"NATS_{role.upper()}_PASSWORD": pw for role, pw in PASSWORDS.items()}


def role_auth(role: str) -> NatsAuth:
    return NatsAuth(user=role, password=PASSWORDS[role])


def role_env(role: str) -> dict[str, str]:
    """How a genmesh process is told its credentials: GENMESH_* variables."""
    return {"GENMESH_NATS_USER": role, "GENMESH_NATS_PASSWORD": PASSWORDS[role]}


def run_quietly(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)


def load_yaml(path: Path) -> Any:
    from ruamel.yaml import YAML  # comes with check-jsonschema

    return YAML(typ="safe", pure=True).load(path.read_text())


def config_copy(directory: Path, conf: str, extra: str = "") -> Path:
    """The shipped configs copied to `directory`, and a test config there that includes
    `conf` unchanged and only moves monitoring to a free loopback port (the client port
    is given on the command line: -a 127.0.0.1 -p -1)."""
    directory.mkdir(parents=True, exist_ok=True)
    for path in NATS_DIR.glob("*.conf"):
        shutil.copy(path, directory / path.name)
    test_conf = directory / f"test-{conf}"
    test_conf.write_text(f'include "{conf}"\nhttp: 127.0.0.1:-1\n{extra}')
    return test_conf


def start_server(
    directory: Path, conf: str, env: dict[str, str], extra_args: list[str] | None = None
) -> NatsServer:
    server = NatsServer(
        config_file=str(config_copy(directory, conf)),
        jetstream=True,  # the configs switch JetStream on; -sd puts its store in tmp
        extra_args=extra_args,
        env={**os.environ, **env},
    )
    server.start()
    return server


def nats_server_check(config: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [find_nats_server(), "-t", "-c", str(config)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.fixture(scope="module")
def test_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """deploy/nats/make-test-ca.sh, run into a temporary directory."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    directory = tmp_path_factory.mktemp("ca")
    subprocess.run(
        ["sh", str(NATS_DIR / "make-test-ca.sh"), str(directory)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return directory


def tls_server_env(ca: Path) -> dict[str, str]:
    return {
        **SERVER_ENV,
        "NATS_TLS_CERT": str(ca / "server-cert.pem"),
        "NATS_TLS_KEY": str(ca / "server-key.pem"),
        "NATS_TLS_CA": str(ca / "ca.pem"),
    }


def cluster_env(name: str, route_ports: list[int]) -> dict[str, str]:
    env = {**SERVER_ENV, "NATS_SERVER_NAME": name, "NATS_CLUSTER_PASSWORD": "routepw"}
    for i, port in enumerate(route_ports, 1):
        env[f"NATS_ROUTE_{i}"] = f"nats-route://route:routepw@127.0.0.1:{port}"
    return env


# --------------------------------------------------------------------------------------
# The compose file


def test_the_compose_file_matches_the_compose_specification(tmp_path: Path) -> None:
    """check-jsonschema with its vendored compose-spec schema: no network, no Docker."""
    check = [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec"]
    ok = subprocess.run([*check, str(COMPOSE)], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # The validator does catch mistakes: the same file with one bad condition fails.
    broken = tmp_path / "compose.yaml"
    broken.write_text(COMPOSE.read_text().replace("service_healthy", "service_happy", 1))
    bad = subprocess.run([*check, str(broken)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1
    assert "service_happy" in bad.stdout + bad.stderr
    # So are the profiles' services: Grafana's wait for Prometheus, misspelt.
    grafana_waits = "      prometheus:\n        condition: service_started\n"
    text = COMPOSE.read_text()
    assert text.count(grafana_waits) == 1
    broken.write_text(text.replace(grafana_waits, grafana_waits.replace("started", "begun")))
    bad = subprocess.run([*check, str(broken)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1
    assert "service_begun" in bad.stdout + bad.stderr


def _cli_commands() -> dict[str, set[str]]:
    """Each `genmesh` command and the GENMESH_* variables its options read."""
    return {
        name: set(variables(load_config_class(command)))
        for name, command in COMMANDS.items()
        if command.config
    }


def test_every_command_and_variable_in_the_compose_file_exists_in_the_cli() -> None:
    compose = load_yaml(COMPOSE)
    commands = _cli_commands()
    assert {"frontend", "router", "worker"} <= set(commands)
    assert "GENMESH_NATS_PASSWORD" in commands["worker"]  # the table is read right
    genmesh_services = 0
    for name, service in compose["services"].items():
        env = service.get("environment") or {}
        if service.get("image") != "genmesh:local":
            assert not any(k.startswith("GENMESH_") for k in env), name
            continue
        genmesh_services += 1
        command = service["command"]
        assert command[0] in commands, f"{name}: genmesh has no command {command[0]!r}"
        unknown = {k for k in env if k.startswith("GENMESH_")} - commands[command[0]]
        assert not unknown, f"{name}: `genmesh {command[0]}` reads no {sorted(unknown)}"
        # Options given as arguments must exist too.
        for arg in command[1:]:
            if arg.startswith("--"):
                flag = "GENMESH_" + arg[2:].split("=")[0].replace("-", "_").upper()
                assert flag in commands[command[0]], f"{name}: unknown option {arg}"
        # Each role logs in as itself, with its own password (a decode worker as `decode`).
        role = "decode" if env.get("GENMESH_ROLE") == "decode" else command[0]
        assert env["GENMESH_NATS_USER"] == role, name
        assert f"NATS_{role.upper()}_PASSWORD" in env["GENMESH_NATS_PASSWORD"], name
        assert service["depends_on"]["nats"]["condition"] == "service_healthy", name
    assert genmesh_services >= 5  # frontend, two routers, two mock workers (+ profiles)


def test_the_compose_file_has_what_the_deployment_needs() -> None:
    compose = load_yaml(COMPOSE)
    services = compose["services"]
    by_profile: dict[str, set[str]] = {}
    for name, service in services.items():
        for profile in service.get("profiles", ["(default)"]):
            by_profile.setdefault(profile, set()).add(name)
    default = by_profile["(default)"]
    assert {"nats", "jaeger", "frontend", "router-1", "router-2", "worker-1", "worker-2"} <= default
    assert by_profile["sglang"] == {"worker-sglang"}
    assert by_profile["vllm"] == {"worker-vllm"}
    assert by_profile["cluster"] == {"nats-2", "nats-3"}
    assert by_profile["pd"] == {"worker-prefill", "worker-decode"}
    assert by_profile["monitoring"] == {"nats-exporter", "prometheus", "grafana"}
    for name, role in (("worker-prefill", "prefill"), ("worker-decode", "decode")):
        env = services[name]["environment"]
        assert (env["GENMESH_ENGINE"], env["GENMESH_ROLE"]) == ("mock", role), name
    for name in ("worker-sglang", "worker-vllm"):
        env = services[name]["environment"]
        assert env["GENMESH_ENGINE"] in name
        assert env["GENMESH_ENGINE_URL"].startswith("${")
    for name in ("worker-1", "worker-2"):
        assert services[name]["environment"]["GENMESH_ENGINE"] == "mock"
    # NATS: an -alpine image (a shell and wget for the health check), JetStream-aware
    # health check, monitoring published on loopback only, the configs mounted.
    for name in ("nats", "nats-2", "nats-3"):
        nats = services[name]
        assert re.fullmatch(r"nats:2\.\d+-alpine", nats["image"]), name
        assert "/healthz?js-enabled-only=true" in " ".join(nats["healthcheck"]["test"])
        assert "./nats:/etc/nats:ro" in nats["volumes"]
        conf = nats["command"][1].replace("${NATS_CONF:-mesh.conf}", "mesh.conf")
        assert (NATS_DIR / Path(conf).name).exists(), conf
        # Every $VARIABLE the configs read is in the server's environment.
        needed = set()
        for path in NATS_DIR.glob("*.conf"):
            if path.name in ("mesh.conf", "cluster.conf", "permissions.conf"):
                needed |= set(re.findall(r"\$(NATS_[A-Z0-9_]+)", path.read_text()))
        assert needed <= set(nats["environment"]), sorted(needed - set(nats["environment"]))
    assert services["nats"]["ports"] == ["127.0.0.1:4222:4222", "127.0.0.1:8222:8222"]
    jaeger = services["jaeger"]
    assert jaeger["image"].startswith("cr.jaegertracing.io/jaegertracing/jaeger:2.")
    assert {p.split(":")[-1] for p in jaeger["ports"]} == {"16686", "4317", "4318"}
    assert services["frontend"]["ports"] == ["8000:8000"]
    for name, service in services.items():
        if service.get("image") == "genmesh:local":
            env = service["environment"]
            assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318", name
            assert service["build"]["dockerfile"] == "deploy/Dockerfile", name


def test_the_dockerfile_builds_one_unprivileged_image_for_every_service() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.\d+-slim", text, re.M)
    assert re.search(r"^USER genmesh", text, re.M)
    assert "./codecs/b64zstd" in text
    assert 'ENTRYPOINT ["genmesh"]' in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git", "deploy", "**/*.pem", "**/.env"} <= set(ignored)


# --------------------------------------------------------------------------------------
# The NATS server configs


@pytest.mark.parametrize("conf", CONFIGS)
def test_every_nats_config_passes_nats_server_t(conf: str, test_ca: Path, tmp_path: Path) -> None:
    keys = write_nkeys(tmp_path / "nkeys")
    env = {
        **tls_server_env(test_ca),
        **cluster_env("nats-1", [6222, 6223, 6224]),
        **{f"NATS_{role.upper()}_NKEY": key for role, key in keys.items()},
    }
    checked = nats_server_check(NATS_DIR / conf, env)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "is valid" in checked.stdout + checked.stderr
    # Without its variables a config is refused: -t really reads them.
    missing = nats_server_check(NATS_DIR / conf, {})
    assert missing.returncode != 0
    assert "can not be found" in missing.stdout + missing.stderr


def test_generated_passwords_are_valid_config_values(tmp_path: Path) -> None:
    """nats-server parses a substituted variable like config text (`123` is a number);
    `genmesh.deploy env` makes passwords it takes as strings."""
    lines = [line for line in make_env(cluster=True).splitlines() if "=" in line]
    env = dict(line.split("=", 1) for line in lines if not line.startswith("#"))
    assert set(SERVER_ENV) <= set(env)
    assert env["NATS_CONF"] == "cluster.conf"
    checked = nats_server_check(NATS_DIR / "mesh.conf", env)
    assert checked.returncode == 0, checked.stdout + checked.stderr


# --------------------------------------------------------------------------------------
# NATS security: the shipped mesh.conf, a real mesh, the permission matrix


@dataclass(frozen=True)
class Rule:
    """One cell of the permission matrix: may `role` publish to / subscribe to `subject`?"""

    role: str
    op: str  # "pub" or "sub"
    subject: str  # {ns}: the namespace
    allowed: bool
    why: str
    queue: str = ""  # a queue subscription
    sample: str = ""  # for a wildcard subscription: a subject it covers

    def concrete(self, ns: str) -> tuple[str, str]:
        """(the subject the role uses, the subject a message goes to)."""
        subject = self.subject.format(ns=ns)
        return subject, (self.sample or self.subject).format(ns=ns)


W = "genmesh.{ns}.worker.w1"
MATRIX: list[Rule] = [
    # client: an application that sends requests over NATS (MeshClient, genmesh request)
    Rule("client", "pub", "genmesh.{ns}.router.generate", True, "requests go to the routers"),
    Rule("client", "pub", "genmesh.{ns}.cancel", True, "cancel its requests"),
    Rule("client", "pub", "genmesh.{ns}.abort", False, "aborts by ID go through a frontend"),
    Rule("client", "pub", W + ".ping", True, "liveness ping of its worker (migration)"),
    Rule("client", "pub", W + ".generate", False, "no way around the routers"),
    Rule("client", "pub", "genmesh.{ns}.discovery.announce", False, "cannot pose as a worker"),
    Rule("client", "pub", "genmesh.{ns}.discovery.router", False, "cannot pose as a router"),
    Rule("client", "pub", "_INBOX_frontend.x.0", False, "cannot inject frames into a stream"),
    Rule("client", "pub", "$JS.API.INFO", False, "no JetStream"),
    Rule("client", "pub", W + ".kv_snapshot", False, "a worker's cache is the mesh's business"),
    Rule(
        "client", "sub", "genmesh.{ns}.kv.*", False, "nor its KV events (they hold prompts)",
        sample="genmesh.{ns}.kv.w1",
    ),
    Rule("client", "sub", "_INBOX_client.c1.*", True, "its replies", sample="_INBOX_client.c1.0"),
    Rule("client", "sub", W + ".generate", False, "cannot read a worker's requests"),
    Rule(
        "client", "sub", "genmesh.{ns}.worker.*.generate", False, "nor every worker's",
        sample=W + ".generate",
    ),
    Rule("client", "sub", "genmesh.{ns}.router.generate", False, "cannot read requests"),
    Rule(
        "client", "sub", "genmesh.{ns}.router.generate", False, "cannot act as a router",
        queue="router",
    ),
    Rule("client", "sub", "genmesh.{ns}.cancel", False, "cannot watch cancels"),
    Rule(
        "client", "sub", "genmesh.{ns}.discovery.>", False, "cannot watch discovery",
        sample="genmesh.{ns}.discovery.announce",
    ),
    Rule(
        "client", "sub", "_INBOX_frontend.>", False,
        "another requester's inbox (the frontend's: every HTTP client's tokens)",
        sample="_INBOX_frontend.f1.0",
    ),
    Rule("client", "sub", "_INBOX_router.>", False, "a router's inbox", sample="_INBOX_router.r.0"),
    Rule("client", "sub", "_INBOX_worker.>", False, "a worker's inbox", sample="_INBOX_worker.w.0"),
    Rule("client", "sub", ">", False, "no wildcard snooping", sample="genmesh.{ns}.cancel"),
    Rule(
        "client", "sub", "_INBOX_client.>", True,
        "the same user's other applications share its inbox: those that must not see each "
        "other get users of their own, as client2",
        sample="_INBOX_client.c2.0",
    ),
    Rule(
        "client", "sub", "_INBOX_client2.>", False, "another client's inbox",
        sample="_INBOX_client2.c.0",
    ),
    Rule("client", "pub", "$SRV.PING", False, "the mesh's layout is the operators' ($SRV)"),
    Rule("client", "pub", "$SRV.STATS.genmesh", False, "nor its services' stats"),
    Rule("client", "sub", "$SRV.PING", False, "cannot pose as a service"),
    # client2: a second client application, with its own user and inbox prefix
    Rule(
        "client2", "sub", "_INBOX_client2.c.*", True, "its replies, under its own prefix",
        sample="_INBOX_client2.c.0",
    ),
    Rule(
        "client2", "sub", "_INBOX_client.c1.*", False, "another client's inbox",
        sample="_INBOX_client.c1.0",
    ),
    Rule(
        "client2", "sub", "_INBOX_client.>", False, "nor every inbox of that client",
        sample="_INBOX_client.c1.0",
    ),
    Rule("client2", "pub", "genmesh.{ns}.router.generate", True, "requests, as every client"),
    Rule("client2", "pub", W + ".generate", False, "no way around the routers"),
    # frontend
    Rule("frontend", "pub", "genmesh.{ns}.router.generate", True, "dispatch"),
    Rule("frontend", "pub", "genmesh.{ns}.cancel", True, "HTTP client went away"),
    Rule("frontend", "pub", W + ".ping", True, "liveness ping (migration)"),
    Rule("frontend", "pub", "genmesh.{ns}.discovery.query", True, "learn the mesh"),
    Rule("frontend", "pub", "genmesh.{ns}.trace", True, "--request-trace-nats"),
    Rule("frontend", "pub", "genmesh.{ns}.abort", True, "/abort_request, /abort_requests"),
    Rule("frontend", "pub", "genmesh.{ns}.flush_cache", True, "/flush_cache"),
    Rule("frontend", "pub", W + ".generate", True, "routes its own requests"),
    Rule("frontend", "pub", W + ".kv_snapshot", True, "resyncs a worker's KV events"),
    Rule(
        "frontend", "sub", "genmesh.{ns}.kv.*", True, "workers' KV events (routes by cache)",
        sample="genmesh.{ns}.kv.w1",
    ),
    Rule("frontend", "pub", "genmesh.{ns}.discovery.announce", False, "cannot pose as a worker"),
    Rule(
        "frontend", "sub", "genmesh.{ns}.discovery.>", True, "worker cards, router presence",
        sample="genmesh.{ns}.discovery.announce",
    ),
    Rule(
        "frontend", "sub", "_INBOX_frontend.f1.*", True, "its replies",
        sample="_INBOX_frontend.f1.0",
    ),
    Rule(
        "frontend", "sub", "_INBOX_client.>", False, "a client's inbox",
        sample="_INBOX_client.c1.0",
    ),
    Rule("frontend", "sub", "genmesh.{ns}.router.generate", False, "cannot read requests"),
    Rule("frontend", "sub", "genmesh.{ns}.cancel", False, "cannot watch cancels"),
    Rule("frontend", "sub", "$SRV.PING", True, "answers $SRV (NATS micro)"),
    Rule("frontend", "sub", "$SRV.INFO.genmesh", True, "as a genmesh service"),
    Rule(
        "frontend", "sub", "$SRV.STATS.genmesh.*", True, "as its instance",
        sample="$SRV.STATS.genmesh.x1",
    ),
    Rule("frontend", "pub", "$SRV.PING", False, "answers $SRV, never asks"),
    # router
    Rule(
        "router", "sub", "genmesh.{ns}.router.generate", True, "requests, in the queue group",
        queue="router",
    ),
    Rule(
        "router", "sub", "genmesh.{ns}.router.generate", False,
        "only in the queue group: a router cannot watch every request",
    ),
    Rule(
        "router", "sub", "genmesh.{ns}.discovery.>", True, "worker cards",
        sample="genmesh.{ns}.discovery.announce",
    ),
    Rule("router", "sub", W + ".generate", False, "cannot take a worker's requests"),
    Rule("router", "sub", "genmesh.{ns}.cancel", False, "routers hold no requests"),
    Rule(
        "router", "sub", "_INBOX_frontend.>", False, "a requester's inbox",
        sample="_INBOX_frontend.f1.0",
    ),
    Rule("router", "pub", W + ".generate", True, "forward to the chosen worker"),
    Rule("router", "pub", W + ".kv_snapshot", True, "resync a worker's KV events"),
    Rule(
        "router", "sub", "genmesh.{ns}.kv.*", True, "workers' KV events",
        sample="genmesh.{ns}.kv.w1",
    ),
    Rule("router", "pub", "genmesh.{ns}.discovery.router", True, "presence"),
    Rule("router", "pub", "genmesh.{ns}.discovery.query", True, "learn the mesh"),
    Rule("router", "pub", "genmesh.{ns}.discovery.announce", False, "cannot pose as a worker"),
    Rule("router", "pub", "genmesh.{ns}.router.generate", False, "no loops"),
    Rule("router", "pub", "genmesh.{ns}.cancel", False, "cannot cancel requests"),
    Rule(
        "router", "pub", "_INBOX_frontend.f1.0", False,
        "replies only to requests it received (allow_responses)",
    ),
    Rule("router", "sub", "$SRV.PING.genmesh", True, "answers $SRV (NATS micro)"),
    Rule("router", "sub", "$SRV.STATS", True, "its stats"),
    Rule("router", "sub", "$SRV.>", False, "only the $SRV subjects it answers"),
    Rule("router", "pub", "$SRV.INFO", False, "answers $SRV, never asks"),
    # worker
    Rule("worker", "sub", W + ".generate", True, "its requests"),
    Rule("worker", "sub", W + ".ping", True, "liveness pings"),
    Rule("worker", "sub", "genmesh.{ns}.cancel", True, "cancels"),
    Rule("worker", "sub", "genmesh.{ns}.abort", True, "aborts by client ID"),
    Rule("worker", "sub", "genmesh.{ns}.flush_cache", True, "cache flushes"),
    Rule("worker", "sub", "genmesh.{ns}.discovery.query", True, "announce on a query"),
    Rule("worker", "sub", W + ".kv_snapshot", True, "snapshot requests"),
    Rule("worker", "pub", "genmesh.{ns}.kv.w1", True, "its engine's KV events"),
    Rule(
        "worker", "sub", "genmesh.{ns}.router.generate", False, "cannot take requests "
        "before routing", queue="router",
    ),
    Rule(
        "worker", "sub", "genmesh.{ns}.discovery.announce", False, "does not need the others' cards"
    ),
    Rule(
        "worker", "sub", "_INBOX_frontend.>", False, "a requester's inbox",
        sample="_INBOX_frontend.f1.0",
    ),
    Rule("worker", "pub", "genmesh.{ns}.discovery.announce", True, "its card"),
    Rule("worker", "pub", "genmesh.{ns}.discovery.leave", True, "leaving"),
    Rule("worker", "pub", "genmesh.{ns}.discovery.router", False, "cannot pose as a router"),
    Rule("worker", "pub", "genmesh.{ns}.router.generate", False, "cannot send requests"),
    Rule("worker", "pub", "genmesh.{ns}.worker.w2.generate", False, "nor to another worker"),
    Rule("worker", "pub", "genmesh.{ns}.cancel", False, "cannot cancel others' requests"),
    Rule("worker", "pub", "genmesh.{ns}.abort", False, "cannot abort others' requests"),
    Rule(
        "worker", "pub", "_INBOX_frontend.f1.0", False,
        "replies only to requests it received (allow_responses)",
    ),
    Rule("worker", "sub", W + ".kv_pull", True, "KV pulls of its handles (the mock's P/D)"),
    Rule("worker", "pub", W + ".kv_pull", False, "only a decode worker pulls KV"),
    Rule(
        "worker", "sub", "_INBOX_decode.>", False, "a decode worker's inbox",
        sample="_INBOX_decode.d.0",
    ),
    Rule("worker", "sub", "$SRV.INFO", True, "answers $SRV (NATS micro)"),
    Rule(
        "worker", "sub", "$SRV.PING.genmesh.*", True, "as its instance",
        sample="$SRV.PING.genmesh.x1",
    ),
    Rule("worker", "sub", "$SRV.*.other", False, "not another service's $SRV subjects",
         sample="$SRV.PING.other"),
    Rule("worker", "pub", "$SRV.STATS", False, "answers $SRV, never asks"),
    # decode: a decode worker (--role decode), which has prefill stages run elsewhere
    Rule("decode", "sub", W + ".generate", True, "its requests"),
    Rule("decode", "pub", "genmesh.{ns}.worker.w2.generate", True, "prefill stages"),
    Rule("decode", "pub", W + ".ping", True, "is its prefill worker alive?"),
    Rule("decode", "pub", "genmesh.{ns}.cancel", True, "stop a stage it no longer needs"),
    Rule("decode", "pub", W + ".kv_pull", True, "the mock's KV transfer"),
    Rule(
        "decode", "sub", "genmesh.{ns}.discovery.>", True, "the prefill workers' cards",
        sample="genmesh.{ns}.discovery.announce",
    ),
    Rule(
        "decode", "sub", "_INBOX_decode.>", True, "its stages' frames",
        sample="_INBOX_decode.d.0",
    ),
    Rule("decode", "pub", "genmesh.{ns}.router.generate", False, "not a client of the routers"),
    Rule("decode", "pub", "genmesh.{ns}.abort", False, "cannot abort others' requests"),
    Rule("decode", "pub", "genmesh.{ns}.discovery.router", False, "cannot pose as a router"),
    Rule(
        "decode", "sub", "_INBOX_frontend.>", False, "a requester's inbox",
        sample="_INBOX_frontend.f1.0",
    ),
    Rule(
        "decode", "pub", "_INBOX_frontend.f1.0", False,
        "replies only to requests it received (allow_responses)",
    ),
    Rule("decode", "sub", "$SRV.STATS.genmesh", True, "answers $SRV (NATS micro)"),
    # admin: operators' tools
    Rule("admin", "sub", ">", True, "everything", sample="genmesh.{ns}.cancel"),
    Rule("admin", "pub", W + ".generate", True, "everything"),
    Rule("admin", "pub", "$SRV.PING", True, "genmesh status; nats micro ls, info, stats"),
]  # fmt: skip


def matrix_table() -> str:
    """The matrix as the markdown table docs/deploy.md shows."""
    lines = ["| role | op | subject | queue | allowed | why |", "|---|---|---|---|---|---|"]
    for r in MATRIX:
        subject = r.subject.format(ns="<ns>").replace(".w1.", ".<wid>.").replace(".w2.", ".<wid2>.")
        verdict = "allowed" if r.allowed else "**denied**"
        lines.append(f"| {r.role} | {r.op} | `{subject}` | {r.queue} | {verdict} | {r.why} |")
    return "\n".join(lines)


@dataclass
class Outcome:
    rule: Rule
    delivered: bool
    violation: str | None


async def _probe(url: str, rule: Rule, ns: str, index: int) -> Outcome:
    """Do what the rule says, as its role, and watch from an admin connection."""
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    subject, target = rule.concrete(ns)
    marker = f"probe-{index}".encode()
    got = asyncio.Event()

    async def on_msg(msg: Msg) -> None:
        if msg.data == marker:
            got.set()

    nc = await connect(url, name=f"probe-{rule.role}", auth=role_auth(rule.role),
                       options={"error_cb": on_error})  # fmt: skip
    admin = await connect(url, name="probe-admin", auth=role_auth("admin"))
    try:
        if rule.op == "sub":
            await nc.subscribe(subject, queue=rule.queue, cb=on_msg)
            await flush_in_order(nc)
            await asyncio.sleep(0.05)  # a refusal arrives asynchronously
            await admin.publish(target, marker)
            await flush_in_order(admin)
        else:
            await admin.subscribe(target, cb=on_msg)
            await flush_in_order(admin)
            await nc.publish(subject, marker)
            await flush_in_order(nc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(got.wait(), 2.0 if rule.allowed else 0.3)
        violations = [str(e) for e in errors if "permissions violation" in str(e).lower()]
        return Outcome(rule, got.is_set(), violations[0] if violations else None)
    finally:
        await nc.close()
        await admin.close()


@pytest.fixture(scope="module")
def secured_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """nats-server on the shipped deploy/nats/mesh.conf (test ports)."""
    server = start_server(tmp_path_factory.mktemp("secured"), "mesh.conf", SERVER_ENV)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def secured_mesh(
    secured_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    """Two routers, two workers and a frontend, each logged in as its role: the frontend
    and routers with GENMESH_NATS_PASSWORD, the workers with a password file. The workers'
    mock caches are on, so they relay KV events and answer snapshot requests too."""
    workdir = tmp_path_factory.mktemp("secured-mesh")
    password_file = workdir / "worker-password"
    password_file.write_text(PASSWORDS["worker"] + "\n")
    envs = {
        "frontend": role_env("frontend"),
        "router": role_env("router"),
        "worker": {"GENMESH_NATS_USER": "worker", "GENMESH_NATS_PASSWORD_FILE": str(password_file)},
    }
    mesh = start_mesh(
        secured_server.url,
        workdir,
        namespace=unique_namespace("sec"),
        routers=2,
        worker_opts={
            "vocab_size": 1000,
            "eos_token_id": 7,
            "extra_args": ("--mock-kv-blocks", "64"),
        },
        role_env=envs,
    )
    yield mesh
    mesh.stop()


@pytest.mark.process
async def test_the_mesh_works_with_each_roles_credentials(
    secured_mesh: Mesh, secured_server: NatsServer, tmp_path: Path
) -> None:
    mesh = secured_mesh
    # HTTP, streamed: 300 frames through the worker's allow_responses (max: -1).
    body = {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 300, "ignore_eos": True},
        "stream": True,
    }
    async with (
        aiohttp.ClientSession() as session,
        session.post(mesh.http_url + "/generate", json=body) as resp,
    ):
        assert resp.status == 200
        raw = await resp.text()
    chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    assert chunks[-1]["meta_info"]["completion_tokens"] == 300
    assert sum(len(c["output_ids"]) for c in chunks) == 300

    # The admin fan-outs: the frontend's orders and the workers' answers (as responses).
    async with aiohttp.ClientSession() as session:
        async with session.post(mesh.http_url + "/flush_cache") as resp:
            assert resp.status == 200, await resp.text()
            assert "Flushed on 2 of 2 workers." in await resp.text()
        async with session.post(mesh.http_url + "/v1/requests/generate-tokens-none/cancel") as resp:
            assert resp.status == 404  # every worker answered: none runs it

    # NATS, as the client user: a request, and a router's refusal (not_found), which
    # reaches the client through the router's allow_responses.
    client = await MeshClient.connect(secured_server.url, mesh.namespace, auth=role_auth("client"))
    async with client:
        frames = [f async for f in client.generate(request([1, 2, 3], max_tokens=40))]
        assert frames[-1]["t"] == "end", frames[-1]
        assert sum(len(f.get("tokens", [])) for f in frames) == 40
        refused = request([1, 2, 3], max_tokens=4)
        refused.model = "no-such-model"
        frames = [f async for f in client.generate(refused)]
        assert (frames[-1]["t"], frames[-1]["code"]) == ("err", "not_found")

    # `genmesh request`, as the client user, the password from a file.
    secret = tmp_path / "client-password"
    secret.write_text(PASSWORDS["client"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("GENMESH_")}
    env |= {"GENMESH_NATS_USER": "client", "GENMESH_NATS_PASSWORD_FILE": str(secret)}
    args = [sys.executable, "-m", "genmesh", "request", "--nats-url", secured_server.url,
            "--namespace", mesh.namespace, "--input-ids", "1,2,3", "--max-tokens", "5"]  # fmt: skip
    done = await asyncio.to_thread(run_quietly, args, env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["t"] == "end"

    # A wrong password: a one-line refusal, exit code 2, nothing retried for minutes.
    env["GENMESH_NATS_PASSWORD_FILE"] = str(tmp_path / "wrong")
    (tmp_path / "wrong").write_text("not-the-password")
    started = time.monotonic()
    refused_run = await asyncio.to_thread(run_quietly, args, env)
    assert refused_run.returncode == 2
    assert "refused the credentials" in refused_run.stderr
    assert time.monotonic() - started < 15

    # The mesh's own traffic never met a refusal: the permissions cover all it does.
    for service in mesh.services:
        assert "permissions violation" not in service.log().lower(), service.name


@pytest.mark.process
async def test_every_role_answers_srv_to_the_admin_user(
    secured_mesh: Mesh, secured_server: NatsServer
) -> None:
    """`nats micro ls` as operators run it (the admin user): each process answers with its
    own user (its `$SRV` subscriptions and allow_responses), the frontend too."""
    admin = await connect(secured_server.url, name="admin", auth=role_auth("admin"))
    try:
        pings = await gather(admin, "$SRV.PING", kind="ping", namespace=secured_mesh.namespace)
        stats = await gather(
            admin, "$SRV.STATS.genmesh", kind="stats", namespace=secured_mesh.namespace
        )
    finally:
        await admin.close()
    roles = sorted(p["metadata"]["role"] for p in pings)
    assert roles == ["frontend", "router", "router", "worker", "worker"]
    assert sorted(s["id"] for s in stats) == sorted(p["id"] for p in pings)
    for service in secured_mesh.services:
        assert "permissions violation" not in service.log().lower(), service.name


@pytest.mark.process
async def test_genmesh_status_as_the_admin_user_and_refused_to_a_client(
    secured_mesh: Mesh, secured_server: NatsServer
) -> None:
    """`genmesh status` takes the credentials every command takes: as the admin user it
    sees the whole secured mesh up; a client user, which may not watch discovery, gets
    the one-line refusal and exit status 2."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("GENMESH_")}
    args = [sys.executable, "-m", "genmesh", "status", "--nats-url", secured_server.url,
            "--namespace", secured_mesh.namespace, "--json"]  # fmt: skip
    done = await asyncio.to_thread(run_quietly, args, base | role_env("admin"))
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    healths = [row["health"] for kind in ("routers", "workers", "frontends") for row in shown[kind]]
    assert healths == ["up"] * 5, shown
    refused = await asyncio.to_thread(run_quietly, args, base | role_env("client"))
    assert refused.returncode == 2
    assert refused.stdout == ""
    assert refused.stderr == (
        f'genmesh: the NATS server refused a subscription to "genmesh.{secured_mesh.namespace}'
        '.discovery.>": this NATS user may not subscribe there (check --nats-user and, for '
        "reply inboxes, --nats-inbox-prefix; docs/deploy.md)\n"
    )


@pytest.mark.process
async def test_a_pd_mesh_pairs_with_each_roles_credentials(
    secured_server: NatsServer, tmp_path: Path
) -> None:
    """A mock prefill worker (the worker user) and a mock decode worker (the decode user)
    behind a frontend: the decode worker sends the stage and pulls the KV handle, the
    prefill worker answers the pull (allow_responses), and nothing meets a refusal."""
    mesh = Mesh(
        secured_server.url,
        tmp_path,
        unique_namespace("secpd"),
        role_env={"frontend": role_env("frontend"), "worker": role_env("worker")},
    )
    try:
        mesh.add_worker("w-prefill", wait=False, extra_args=("--role", "prefill"))
        mesh.add_worker(
            "w-decode", wait=False, extra_args=("--role", "decode"), env=role_env("decode")
        )
        mesh.add_frontend()
        mesh.wait_for_workers(lambda known: {"w-prefill", "w-decode"} <= known)
        body = {
            "input_ids": [1, 2, 3],
            "sampling_params": {"max_new_tokens": 20, "ignore_eos": True},
        }
        async with (
            aiohttp.ClientSession() as session,
            session.post(mesh.http_url + "/generate", json=body) as resp,
        ):
            assert resp.status == 200, await resp.text()
            answer = await resp.json()
        assert answer["meta_info"]["completion_tokens"] == 20

        def both_ran_it() -> bool:
            workers = mesh.server_info()["genmesh"]["workers"]
            return [w["stats"]["admitted"] for w in workers] == [1, 1]

        wait_until(both_ran_it, what="the request on w-decode and its stage on w-prefill")
        # The decode user answers `$SRV` too, with the prefill worker's kv_pull counted.
        admin = await connect(secured_server.url, name="admin", auth=role_auth("admin"))
        try:
            stats = await gather(admin, "$SRV.STATS", kind="stats", namespace=mesh.namespace)
        finally:
            await admin.close()
        pulls = {
            s["metadata"].get("worker_role", "-"): [
                e["num_requests"] for e in s["endpoints"] if e["name"] == "kv_pull"
            ]
            for s in stats
        }
        assert pulls == {"-": [], "prefill": [1], "decode": [0]}  # "-": the frontend
        for service in mesh.services:
            assert "permissions violation" not in service.log().lower(), service.name
    finally:
        mesh.stop()


async def frames_of(client: MeshClient, envelope: Any) -> list[dict[str, Any]]:
    return [frame async for frame in client.generate(envelope)]


@pytest.mark.process
async def test_a_client_reads_only_its_own_inbox(
    secured_mesh: Mesh, secured_server: NatsServer
) -> None:
    """Two client applications with users of their own: each is served under its own
    inbox prefix, and one that listens on the other's inbox hears nothing of its tokens."""
    mesh = secured_mesh
    snooped: list[Msg] = []
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    async def on_snooped(msg: Msg) -> None:
        snooped.append(msg)

    auth2 = NatsAuth(user="client2", password=PASSWORDS["client2"], inbox_prefix="_INBOX_client2")
    snoop = await connect(secured_server.url, name="snoop", auth=auth2,
                          options={"error_cb": on_error})  # fmt: skip
    try:
        await snoop.subscribe("_INBOX_client.>", cb=on_snooped)
        await flush_in_order(snoop)
        async with (
            await MeshClient.connect(secured_server.url, mesh.namespace,
                                     auth=role_auth("client")) as client,
            await MeshClient.connect(secured_server.url, mesh.namespace, auth=auth2) as client2,
        ):  # fmt: skip
            streams = await asyncio.gather(
                *(
                    frames_of(c, request([1, 2, i], max_tokens=30, ignore_eos=True))
                    for c in (client, client2)
                    for i in range(4)
                )
            )
    finally:
        await snoop.close()
    for frames in streams:
        assert frames[-1]["t"] == "end", frames[-1]
        assert sum(len(f.get("tokens", [])) for f in frames) == 30
    assert snooped == []
    assert any('subscription to "_inbox_client.>"' in str(e) for e in errors), errors

    # client2 without its prefix: told at once, not left waiting for replies.
    wrong_prefix = NatsAuth(user="client2", password=PASSWORDS["client2"])
    with pytest.raises(NatsPermissionDenied, match="--nats-inbox-prefix"):
        await MeshClient.connect(secured_server.url, mesh.namespace, auth=wrong_prefix)

    # The same through `genmesh request` and its environment.
    env = {k: v for k, v in os.environ.items() if not k.startswith("GENMESH_")}
    env |= {"GENMESH_NATS_USER": "client2", "GENMESH_NATS_PASSWORD": PASSWORDS["client2"]}
    args = [sys.executable, "-m", "genmesh", "request", "--nats-url", secured_server.url,
            "--namespace", mesh.namespace, "--input-ids", "1,2,3", "--max-tokens", "5"]  # fmt: skip
    refused = await asyncio.to_thread(run_quietly, args, env)
    assert refused.returncode == 2
    assert 'refused a subscription to "_INBOX_client.' in refused.stderr, refused.stderr
    env["GENMESH_NATS_INBOX_PREFIX"] = "_INBOX_client2"
    done = await asyncio.to_thread(run_quietly, args, env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["t"] == "end"


@pytest.mark.process
async def test_a_service_with_the_wrong_user_stops_with_a_clear_error(
    secured_server: NatsServer,
) -> None:
    """A worker given the client user cannot subscribe to its subjects: it says so and
    exits, rather than sitting there deaf."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GENMESH_")}
    env |= role_env("client")
    args = [sys.executable, "-m", "genmesh", "worker", "--nats-url", secured_server.url,
            "--namespace", unique_namespace("wrong"), "--engine", "mock"]  # fmt: skip
    done = await asyncio.to_thread(run_quietly, args, env)
    assert done.returncode == 2, done.stderr
    assert "refused a subscription to" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


async def test_the_permission_matrix(secured_server: NatsServer) -> None:
    """Every row, both ways: allowed rows deliver, denied rows are refused by the server
    (a permissions violation reaches the error callback) and deliver nothing."""
    ns = unique_namespace("perm")
    outcomes = await asyncio.gather(
        *(_probe(secured_server.url, rule, ns, i) for i, rule in enumerate(MATRIX))
    )
    wrong = []
    for o in outcomes:
        if o.rule.allowed and (not o.delivered or o.violation):
            wrong.append(f"{o.rule}: expected delivery, got {o.delivered=} {o.violation=}")
        if not o.rule.allowed and (o.delivered or not o.violation):
            wrong.append(f"{o.rule}: expected a refusal, got {o.delivered=} {o.violation=}")
        if o.violation:  # the refusal names the subject (nats-py lowercases the text)
            assert f'"{o.rule.concrete(ns)[0].lower()}"' in o.violation, o.violation
    assert not wrong, "\n".join(wrong)


def test_docs_show_the_permission_matrix_that_is_tested() -> None:
    assert matrix_table() in (ROOT / "docs" / "deploy.md").read_text()


async def test_allow_responses_lets_a_whole_stream_through_and_nothing_else(
    secured_server: NatsServer,
) -> None:
    """The worker answers a forwarded request with many messages on the requester's
    reply subject (allow_responses max -1); an inbox it was not asked on stays shut."""
    ns = unique_namespace("resp")
    subject = f"genmesh.{ns}.worker.w1.generate"
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    worker = await connect(secured_server.url, name="w", auth=role_auth("worker"),
                           options={"error_cb": on_error})  # fmt: skip
    router = await connect(secured_server.url, name="r", auth=role_auth("router"))
    client = await connect(secured_server.url, name="c", auth=role_auth("client"),
                           inbox_prefix="_INBOX_client")  # fmt: skip
    received: list[bytes] = []
    try:

        async def answer(msg: Msg) -> None:
            for i in range(500):
                await worker.publish(msg.reply, str(i).encode())
            await worker.publish("_INBOX_client.someone-else.0", b"stolen")  # never asked

        await worker.subscribe(subject, cb=answer)
        inbox = client.new_inbox()

        async def on_reply(msg: Msg) -> None:
            received.append(msg.data)

        await client.subscribe(f"{inbox}.*", cb=on_reply)
        await client.subscribe("_INBOX_client.someone-else.*", cb=on_reply)
        await flush_in_order(worker)
        await flush_in_order(client)
        await router.publish(subject, b"request", reply=f"{inbox}.0")  # as a router forwards
        await flush_in_order(router)
        await asyncio.to_thread(wait_until, lambda: len(received) >= 500, 10)
        await flush_in_order(worker)
        await asyncio.to_thread(wait_until, lambda: bool(errors), 5)
        await asyncio.sleep(0.1)
    finally:
        for nc in (worker, router, client):
            await nc.close()
    assert received == [str(i).encode() for i in range(500)]  # all of them, in order
    assert '"_inbox_client.someone-else.0"' in str(errors[0])


async def test_credentials_that_do_not_fit_are_refused(secured_server: NatsServer) -> None:
    with pytest.raises(NatsUnreachable, match="refused the credentials"):
        await connect(secured_server.url, name="x", auth=NatsAuth(user="client", password="no"))
    with pytest.raises(NatsUnreachable, match="refused the credentials"):
        await connect(secured_server.url, name="x")  # no credentials at all


# --------------------------------------------------------------------------------------
# nkeys, TLS, tokens


def headless_mesh(url: str, workdir: Path, envs: dict[str, dict[str, str]]) -> Mesh:
    """A router and a worker (no frontend), each with its own credentials."""
    mesh = Mesh(url, workdir, unique_namespace("auth"), role_env=envs)
    try:
        mesh.add_router()
        mesh.add_worker(wait=False)
    except BaseException:
        print(mesh.logs())
        mesh.stop()
        raise
    return mesh


async def served(client: MeshClient, timeout: float = 15.0) -> list[dict[str, Any]]:
    """The frames of one request, once the mesh has a worker (no_worker: try again)."""
    deadline = time.monotonic() + timeout
    while True:
        frames = [f async for f in client.generate(request([1, 2, 3], max_tokens=8))]
        if frames[-1].get("code") != "no_worker" or time.monotonic() > deadline:
            return frames
        await asyncio.sleep(0.2)


@pytest.mark.process
async def test_nkey_users(tmp_path: Path) -> None:
    """mesh-nkeys.conf: the server holds public keys only; services sign with seed files
    (GENMESH_NATS_NKEY_SEED=path), the client with the seed itself."""
    keys = write_nkeys(tmp_path / "nkeys")
    env = {f"NATS_{role.upper()}_NKEY": key for role, key in keys.items()}
    server = start_server(tmp_path / "nats", "mesh-nkeys.conf", env)
    mesh = None
    try:
        seed = {role: str(tmp_path / "nkeys" / f"{role}.nk") for role in USERS}
        envs = {role: {"GENMESH_NATS_NKEY_SEED": seed[role]} for role in ("router", "worker")}
        mesh = headless_mesh(server.url, tmp_path, envs)
        client_seed = (tmp_path / "nkeys" / "client.nk").read_text().strip()
        auth = NatsAuth(nkey_seed=client_seed)
        async with await MeshClient.connect(server.url, mesh.namespace, auth=auth) as client:
            frames = await served(client)
        assert frames[-1]["t"] == "end", frames[-1]
        # A key the server does not list is refused; so is a password user here.
        stranger = write_nkeys(tmp_path / "stranger", ["client"])
        assert stranger["client"] != keys["client"]
        stranger_seed = str(tmp_path / "stranger" / "client.nk")
        with pytest.raises(NatsUnreachable, match="refused the credentials"):
            await connect(server.url, name="x", auth=NatsAuth(nkey_seed=stranger_seed))
        with pytest.raises(NatsUnreachable, match="refused the credentials"):
            await connect(server.url, name="x", auth=role_auth("client"))
    finally:
        if mesh is not None:
            mesh.stop()
        server.stop()


@pytest.mark.process
async def test_mutual_tls(test_ca: Path, tmp_path: Path) -> None:
    """mesh-tls.conf: TLS with client certificates required, roles still by password."""
    server = start_server(tmp_path / "nats", "mesh-tls.conf", tls_server_env(test_ca))
    mesh = None
    url = server.url.replace("nats://", "tls://")

    def tls_env(role: str) -> dict[str, str]:
        return {
            **role_env(role),
            "GENMESH_NATS_TLS_CA": str(test_ca / "ca.pem"),
            "GENMESH_NATS_TLS_CERT": str(test_ca / f"{role}-cert.pem"),
            "GENMESH_NATS_TLS_KEY": str(test_ca / f"{role}-key.pem"),
        }

    try:
        mesh = headless_mesh(url, tmp_path, {r: tls_env(r) for r in ("router", "worker")})
        auth = NatsAuth(
            user="client",
            password=PASSWORDS["client"],
            tls_ca=str(test_ca / "ca.pem"),
            tls_cert=str(test_ca / "client-cert.pem"),
            tls_key=str(test_ca / "client-key.pem"),
        )
        async with await MeshClient.connect(url, mesh.namespace, auth=auth) as client:
            frames = await served(client)
        assert frames[-1]["t"] == "end", frames[-1]
        # Without a client certificate, or without trusting the CA: no connection.
        no_cert = NatsAuth(user="client", password=PASSWORDS["client"], tls_ca=auth.tls_ca)
        with pytest.raises(NatsUnreachable):
            await connect(url, name="x", auth=no_cert)
        untrusting = NatsAuth(
            user="client", password=PASSWORDS["client"],
            tls_cert=auth.tls_cert, tls_key=auth.tls_key,
        )  # fmt: skip
        with pytest.raises(NatsUnreachable, match=r"(?i)certificate"):
            await connect(url, name="x", auth=untrusting)
    finally:
        if mesh is not None:
            mesh.stop()
        server.stop()


async def test_token_from_a_file(tmp_path: Path) -> None:
    token = new_password()
    server = NatsServer(extra_args=["--auth", token])
    server.start()
    try:
        (tmp_path / "token").write_text(token + "\n")
        nc = await connect(server.url, name="x", auth=NatsAuth(token_file=str(tmp_path / "token")))
        await nc.close()
        with pytest.raises(NatsUnreachable, match="refused the credentials"):
            await connect(server.url, name="x", auth=NatsAuth(token="wrong"))
    finally:
        server.stop()


# --------------------------------------------------------------------------------------
# A 3-node cluster on loopback; one node dies under load


def monitor_url(server: NatsServer) -> str:
    match = re.search(r"Starting http monitor on (\S+)", server.log_path.read_text())
    assert match, "no monitoring port in the server log"
    return f"http://{match.group(1)}"


def monitor(server: NatsServer, path: str) -> Any:
    with urllib.request.urlopen(monitor_url(server) + path, timeout=5) as resp:
        return json.load(resp)


def connection_names(server: NatsServer) -> set[str]:
    return {c.get("name", "") for c in monitor(server, "/connz?limit=1000")["connections"]}


@dataclass
class Result:
    started: float
    ended: float
    status: int  # 0: no HTTP answer at all
    body: Any


async def _generate(
    session: aiohttp.ClientSession, url: str, timeout_s: float, tokens: int = 48
) -> Result:
    body = {
        "input_ids": [5, 6, 7],
        "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True},
    }
    started = time.monotonic()
    try:
        async with session.post(
            url + "/generate",
            json=body,
            headers={"X-Request-Timeout": str(timeout_s)},
            timeout=aiohttp.ClientTimeout(total=timeout_s + 10),
        ) as resp:
            text = await resp.text()
            status = resp.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        return Result(started, time.monotonic(), 0, repr(exc))
    try:
        parsed: Any = json.loads(text)
    except ValueError:
        parsed = text
    return Result(started, time.monotonic(), status, parsed)


def error_message(body: Any) -> str:
    """The message of an SGLang error body: `{"error": {"message"}}` (4xx) or
    `{"object": "error", "message"}` (5xx)."""
    if not isinstance(body, dict):
        return ""
    if isinstance(body.get("error"), dict):
        return str(body["error"].get("message") or "")
    return str(body.get("message") or "")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[list[NatsServer]]:
    route_ports = [free_port() for _ in range(3)]
    servers: list[NatsServer] = []
    try:
        for i, port in enumerate(route_ports):
            servers.append(
                start_server(
                    tmp_path / f"nats-{i + 1}",
                    "cluster.conf",
                    cluster_env(f"nats-{i + 1}", route_ports),
                    extra_args=["--cluster", f"nats://127.0.0.1:{port}"],
                )
            )
        # Routed: every node sees the other two.
        wait_until(
            lambda: all(
                len({r.get("remote_name") for r in monitor(s, "/routez")["routes"]}) == 2
                for s in servers
            ),
            timeout=15,
            what="the three nodes to route to each other",
        )
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.mark.chaos
@pytest.mark.parametrize(
    "dies",
    [
        pytest.param("n2", id="a-router-and-a-worker-node"),
        pytest.param("n1", id="the-frontends-node"),
    ],
)
async def test_a_cluster_node_dies_under_load(
    cluster: list[NatsServer], tmp_path: Path, dies: str
) -> None:
    nodes = dict(zip(("n1", "n2", "n3"), cluster, strict=True))
    mesh = Mesh(nodes["n1"].url, tmp_path, unique_namespace("cluster"),
                role_env={r: role_env(r) for r in ("frontend", "router", "worker")})  # fmt: skip
    on = {name: ("--nats-url", server.url) for name, server in nodes.items()}
    try:
        # The frontend on node 1, a router on each of nodes 2 and 3, a worker on each node.
        # Each service is given one node and learns the others from it.
        services = {
            "n2": [mesh.add_router(extra_args=on["n2"])],
            "n3": [mesh.add_router(extra_args=on["n3"])],
            "n1": [mesh.add_frontend(*on["n1"])],
        }
        for node in ("n1", "n2", "n3"):
            services[node].append(
                mesh.add_worker(f"w{node}", speedup=2.0, extra_args=on[node], wait=False)
            )
        mesh.wait_for_workers(lambda ids: {"wn1", "wn2", "wn3"} <= ids, what="three workers")
        dying = {_connection_name(s) for s in services[dies]}
        assert dying <= connection_names(nodes[dies])
        survivors = [server for name, server in nodes.items() if name != dies]

        # Load: 24 clients in a loop for 8 s, plus 6 long generations that outlive the
        # node; the node is SIGKILLed after 3 s.
        timeout_s = 15.0
        long_tokens = 2000
        results: list[Result] = []
        stop_at = time.monotonic() + 8.0

        async def client_loop(session: aiohttp.ClientSession) -> None:
            while time.monotonic() < stop_at:
                results.append(await _generate(session, mesh.http_url, timeout_s))

        async with aiohttp.ClientSession() as session:
            load = asyncio.gather(*(client_loop(session) for _ in range(24)))
            longs = asyncio.gather(
                *(_generate(session, mesh.http_url, 30.0, long_tokens) for _ in range(6))
            )
            await asyncio.sleep(3.0)
            killed_at = time.monotonic()
            nodes[dies].kill()
            await load
            long_results = await longs

        # The long ones were caught mid-stream; those of the dead node's worker move on
        # at once (the worker stops a stream whose replies the server refuses after its
        # reconnect; pings then say "not running"), not after the 60 s idle timeout.
        for r in long_results:
            assert r.status == 200, r
            assert len(r.body["output_ids"]) == long_tokens
            assert r.started < killed_at < r.ended
        spans = [r.ended - r.started for r in long_results]
        # A stalled stream would wait for its old worker to finish (~4 s more here).
        assert max(spans) < min(spans) + 3.0, spans

        # Every request got an answer: a generation, or a clear error within its deadline.
        in_flight = [r for r in results if r.started <= killed_at <= r.ended]
        failed = [r for r in results if r.status != 200]
        after = [r for r in results if r.started > killed_at]
        for r in results:
            assert r.status != 0, f"no HTTP answer: {r.body}"
            assert r.ended - r.started <= timeout_s + 2, r
            if r.status == 200:
                assert len(r.body["output_ids"]) == 48, r.body
            else:
                assert r.status in (500, 503, 504), r
                assert error_message(r.body), f"an error without a message: {r.body}"
        migrations = _metric(mesh.http_url, "genmesh_frontend_migrations_total")
        summary = {
            "killed": dies,
            "requests": len(results),
            "completed": len(results) - len(failed),
            "failed": len(failed),
            "in_flight_at_kill": len(in_flight),
            "in_flight_completed": sum(r.status == 200 for r in in_flight),
            "refused_while_reconnecting": sum(
                r.status == 503 and r.started > killed_at for r in failed
            ),
            "migrations": int(migrations),
            "slowest_s": round(max(r.ended - r.started for r in results), 2),
            "long_streams_s": sorted(round(r.ended - r.started, 1) for r in long_results),
            "failures": Counter(
                f"{r.status} {error_message(r.body)}" for r in failed
            ).most_common(),
        }
        print("\ncluster node kill:", json.dumps(summary))
        # Not one request fails: those caught by the kill migrate, and those that arrive
        # while the frontend itself reconnects (its node died) are held until it has
        # (--reconnect-hold), not refused with 503 "not connected to NATS".
        assert not failed, summary
        assert in_flight, "the kill landed between requests: nothing was tested"
        assert after, summary
        assert all(r.status == 200 for r in after[-24:]), summary

        # The dead node's services reconnected to the other two, and its worker serves.
        wait_until(
            lambda: dying <= set().union(*(connection_names(s) for s in survivors)),
            timeout=15,
            what=f"{sorted(dying)} to reconnect to the surviving nodes",
        )
        wid = f"w{dies}"
        mesh.wait_for_workers(lambda ids: wid in ids, what=f"{wid} known again")
        auth = role_auth("client")
        async with await MeshClient.connect(survivors[-1].url, mesh.namespace, auth=auth) as c:
            frames = [f async for f in c.generate(request([1, 2, 3], max_tokens=5, worker=wid))]
        assert frames[-1]["t"] == "end", frames
        assert frames[0]["worker"] == wid, frames
        for service in services[dies]:
            assert "reconnected to" in service.log(), service.name
    except BaseException:
        print(mesh.logs())
        raise
    finally:
        mesh.stop()


def _connection_name(service: Any) -> str:
    """The NATS connection name a service process uses."""
    if service.role == "worker":
        return f"genmesh-worker-{service.name}"
    if service.role == "frontend":
        return "genmesh-frontend"
    return f"genmesh-router-{_router_id(service)}"


def _router_id(service: Any) -> str:
    router_id: str = service.config.router_id
    return router_id


def _metric(http_url: str, name: str) -> float:
    with urllib.request.urlopen(http_url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((name + "{", name + " "))
    )


# --------------------------------------------------------------------------------------
# `genmesh up` against a secured server


@pytest.mark.process
def test_up_hands_its_credentials_to_every_child(
    secured_server: NatsServer, tmp_path: Path
) -> None:
    """`genmesh up --nats-user ... --nats-password-file ...`: every child process logs in
    (credentials reach them through their environment, not their command line)."""
    secret = tmp_path / "admin-password"
    secret.write_text(PASSWORDS["admin"])
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GENMESH_")}
    env["GENMESH_MOCK_SPEEDUP"] = "0"
    args = [sys.executable, "-m", "genmesh", "up", "--nats-url", secured_server.url,
            "--namespace", unique_namespace("up"), "--port", str(port), "--workers", "1",
            "--nats-user", "admin", "--nats-password-file", str(secret)]  # fmt: skip
    with (tmp_path / "up.log").open("w+") as log:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        try:
            assert proc.stdout is not None
            lines = []
            deadline = time.monotonic() + 40
            while time.monotonic() < deadline:
                line = proc.stdout.readline()
                lines.append(line)
                if "Ctrl-C stops everything" in line or not line:
                    break
            text = "".join(lines)
            assert "genmesh is up" in text, text + Path(log.name).read_text()
            pids = [int(p) for p in re.findall(r"pid (\d+)", text)]
            for pid in pids:  # no secret on any child's command line
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
                assert PASSWORDS["admin"] not in cmdline
                assert "--nats-user" not in cmdline
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/generate",
                data=b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}}',
            )
            with urllib.request.urlopen(req, timeout=10) as resp:
                assert len(json.load(resp)["output_ids"]) == 3
            proc.terminate()
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# --------------------------------------------------------------------------------------
# The compose stack itself, where a Docker engine is reachable


def compose_command() -> list[str] | None:
    """`docker compose` (v2) if it is installed and its engine answers, else None."""
    docker = shutil.which("docker")
    if docker is None:
        return None
    try:
        if subprocess.run([docker, "info"], capture_output=True, timeout=10).returncode:
            return None  # a CLI without a reachable engine
        if subprocess.run(
            [docker, "compose", "version"], capture_output=True, timeout=10
        ).returncode:
            return None
    except (OSError, subprocess.TimeoutExpired):
        return None
    return [docker, "compose"]


@pytest.mark.docker
@pytest.mark.timeout(1200)
def test_the_compose_stack_serves_a_request(tmp_path: Path) -> None:
    compose = compose_command()
    if compose is None:
        pytest.skip("no Docker engine with the compose plugin is reachable")
    env_file = tmp_path / ".env"
    env_file.write_text(make_env())
    base = [*compose, "-f", str(COMPOSE), "--env-file", str(env_file), "-p", "genmesh-smoke"]
    try:
        up = subprocess.run(
            [*base, "up", "-d", "--build", "--wait", "--wait-timeout", "300"],
            capture_output=True, text=True, timeout=1000,
        )  # fmt: skip
        if up.returncode != 0:
            output = up.stdout + up.stderr
            if re.search(r"(?i)pull|registry|resolve|manifest|network is unreachable", output):
                pytest.skip(f"cannot fetch the images: {output[-500:]}")
            logs = subprocess.run([*base, "logs", "--tail", "50"], capture_output=True, text=True)
            pytest.fail(f"compose up failed:\n{output[-3000:]}\n{logs.stdout[-5000:]}")
        req = urllib.request.Request(
            "http://127.0.0.1:8000/generate",
            data=b'{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8}}',
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert len(json.load(resp)["output_ids"]) == 8
        with urllib.request.urlopen("http://127.0.0.1:8000/metrics", timeout=10) as resp:
            assert b"genmesh_frontend_requests_total" in resp.read()
    finally:
        subprocess.run([*base, "down", "-v", "--remove-orphans"], capture_output=True, timeout=300)

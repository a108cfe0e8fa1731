"""The compose `monitoring` profile (deploy/monitoring/), checked offline, without Docker:
Prometheus's scrape config and Grafana's provisioning against compose, the genmesh
dashboard against Grafana's dashboard model, every PromQL expression with a real PromQL
parser, and every metric (and label) a panel queries against what a real mesh and a real
nats-server export (docs/observability.md, "Prometheus and Grafana")."""

from __future__ import annotations

import asyncio
import copy
import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import promql_parser
import pytest
from prometheus_client.parser import text_string_to_metric_families

from genmesh.client import MeshClient, request
from genmesh.shared.natsserver import NatsServer
from tests.conftest import unique_namespace
from tests.http_util import post, stream
from tests.inproc import InProcessMesh
from tests.mesh import free_port

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
MONITORING = DEPLOY / "monitoring"
PROMETHEUS_CONFIG = MONITORING / "prometheus.yml"
PROVISIONING = MONITORING / "grafana" / "provisioning"
DATASOURCES = PROVISIONING / "datasources" / "prometheus.yaml"
DASHBOARD_PROVIDERS = PROVISIONING / "dashboards" / "genmesh.yaml"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "genmesh.json"

MONITORING_SERVICES = {"nats-exporter", "prometheus", "grafana"}
# What Prometheus itself adds to every scraped series: the target labels (`service` is
# prometheus.yml's relabelling), and the synthetic `up` series of each target.
TARGET_LABELS = {"job", "instance", "service"}
PROMETHEUS_SERIES = {"up": TARGET_LABELS}
# The only Grafana variable the panels use: Grafana replaces it with a range of at least
# four scrape intervals before the query reaches Prometheus.
GRAFANA_VARIABLES = {"$__rate_interval": "20s"}

# prometheus-nats-exporter (github.com/nats-io/prometheus-nats-exporter, v0.20.1):
# - its default listen port, exporter/exporter.go `DefaultListenPort`;
EXPORTER_PORT = 7777
# - the flags compose gives it, as main.go declares them;
EXPORTER_FLAGS = {"-varz", "-healthz_js_enabled_only", "-use_internal_server_name"}
# - the metric names of the collectors those flags turn on. `-healthz_js_enabled_only`:
#   collector/healthz.go, BuildFQName("gnatsd", "healthz_js_enabled_only", "status" and
#   "status_value"), labelled server_id (and value). `-varz`: collector/collector.go makes
#   one gauge per number in the server's /varz JSON (`varz_metric_names` below).
EXPORTER_HEALTHZ = {
    "gnatsd_healthz_js_enabled_only_status": {"server_id"},
    "gnatsd_healthz_js_enabled_only_status_value": {"server_id", "value"},
}
# collector/collector.go, objectToMetrics: names it skips, and the string fields it keeps
# (as a `value` label, or as a gauge of the time they hold).
EXPORTER_SKIPPED = {
    "leaf",
    "trusted_operators_claim",
    "cluster_tls_timeout",
    "cluster_cluster_port",
    "cluster_auth_timeout",
    "gateway_port",
    "gateway_auth_timeout",
    "gateway_tls_timeout",
    "gateway_connect_retries",
}
EXPORTER_STRING_KEYS = {
    "server_id",
    "server_name",
    "version",
    "domain",
    "leader",
    "name",
    "start",
    "config_load_time",
}


def load_yaml(path: Path) -> Any:
    from ruamel.yaml import YAML  # comes with check-jsonschema

    return YAML(typ="safe", pure=True).load(path.read_text())


def compose_services() -> dict[str, Any]:
    services: dict[str, Any] = load_yaml(COMPOSE)["services"]
    return services


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def mounts(service: dict[str, Any]) -> dict[str, Path]:
    """A compose service's bind mounts: container path -> host path (relative paths are
    relative to the compose file's directory)."""
    found = {}
    for volume in service.get("volumes", []):
        host, container = volume.split(":")[:2]
        if host.startswith("."):
            found[container] = (DEPLOY / host).resolve()
    return found


def published(service: dict[str, Any]) -> dict[int, str]:
    """Container port -> the host address it is published on."""
    ports = {}
    for mapping in service.get("ports", []):
        host, _, container = mapping.rpartition(":")
        ports[int(container)] = host.rsplit(":", 1)[0]
    return ports


# --------------------------------------------------------------------------------------
# Compose and Prometheus


def test_the_monitoring_profile_runs_the_exporter_prometheus_and_grafana() -> None:
    services = compose_services()
    in_profile = {n for n, s in services.items() if "monitoring" in s.get("profiles", [])}
    assert in_profile == MONITORING_SERVICES
    for name in MONITORING_SERVICES:
        image = services[name]["image"]
        assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", image), f"{name}: pin a version: {image}"
        # Monitoring has no authentication worth the name: loopback only, as NATS's 8222.
        assert set(published(services[name]).values()) <= {"127.0.0.1"}, name
    assert published(services["prometheus"]) == {9090: "127.0.0.1"}
    assert published(services["grafana"]) == {3000: "127.0.0.1"}

    # The exporter reads the monitoring port that compose's NATS config opens.
    exporter = services["nats-exporter"]
    *flags, url = exporter["command"]
    assert set(flags) == EXPORTER_FLAGS
    conf = (DEPLOY / "nats" / "mesh.conf").read_text()
    monitor = re.search(r"^http: 0\.0\.0\.0:(\d+)$", conf, re.M)
    assert monitor is not None
    assert url == f"http://nats:{monitor.group(1)}"
    assert exporter["depends_on"]["nats"]["condition"] == "service_healthy"

    # Prometheus reads its config where the image's default --config.file points.
    config = mounts(services["prometheus"])["/etc/prometheus/prometheus.yml"]
    assert config == PROMETHEUS_CONFIG

    # Grafana: provisioning where Grafana looks for it, the dashboards where the provider
    # says, the home dashboard among them, anonymous users viewers only.
    grafana = services["grafana"]
    grafana_mounts = mounts(grafana)
    assert grafana_mounts["/etc/grafana/provisioning"] == PROVISIONING
    (provider,) = load_yaml(DASHBOARD_PROVIDERS)["providers"]
    assert provider["type"] == "file"
    dashboards = grafana_mounts[provider["options"]["path"]]
    assert sorted(dashboards.glob("*.json")) == [DASHBOARD]
    env = grafana["environment"]
    home = Path(env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert dashboards / home.relative_to(provider["options"]["path"]) == DASHBOARD
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"


def metrics_port(name: str, service: dict[str, Any]) -> int | None:
    """Where a compose service serves /metrics to the other containers, if it does."""
    env = service.get("environment") or {}
    if service.get("image") == "genmesh:local":
        if service["command"] == ["frontend"]:
            assert env["GENMESH_HOST"] == "0.0.0.0", name
            return int(env["GENMESH_PORT"])
        # Reachable from the Prometheus container: not the default 127.0.0.1.
        assert env["GENMESH_METRICS_HOST"] == "0.0.0.0", name
        return int(env["GENMESH_METRICS_PORT"])
    if name == "nats-exporter":
        assert not {"-p", "-port"} & set(service["command"])  # the default port
        return EXPORTER_PORT
    return None


def test_every_service_is_scraped_on_its_metrics_port() -> None:
    services = compose_services()
    config = load_yaml(PROMETHEUS_CONFIG)
    assert set(config) == {"global", "scrape_configs"}
    assert config["global"]["scrape_interval"] == "5s"
    jobs = [job["job_name"] for job in config["scrape_configs"]]
    assert len(jobs) == len(set(jobs)), jobs
    scraped: dict[str, int] = {}
    for job in config["scrape_configs"]:
        assert set(job) == {"job_name", "dns_sd_configs", "relabel_configs"}, job["job_name"]
        assert job["relabel_configs"] == [
            {"source_labels": ["__meta_dns_name"], "target_label": "service"}
        ]
        for sd in job["dns_sd_configs"]:
            assert set(sd) == {"names", "type", "port"}
            assert sd["type"] == "A"  # compose's DNS answers A records per container
            for name in sd["names"]:
                assert name in services, f"{job['job_name']}: no compose service {name}"
                assert sd["port"] == metrics_port(name, services[name]), name
                scraped[name] = sd["port"]
    exporting = {n for n, s in services.items() if metrics_port(n, s) is not None}
    assert exporting == set(scraped), sorted(exporting ^ set(scraped))
    assert {"frontend", "router-1", "worker-1", "worker-decode", "nats-exporter"} <= exporting


def test_grafanas_datasource_is_the_prometheus_service() -> None:
    provisioned = load_yaml(DATASOURCES)
    assert provisioned["apiVersion"] == 1
    (source,) = provisioned["datasources"]
    assert source["type"] == "prometheus"
    assert source["isDefault"] is True
    match = re.fullmatch(r"http://([\w-]+):(\d+)", source["url"])
    assert match is not None, source["url"]
    service = compose_services()[match.group(1)]
    assert int(match.group(2)) in published(service)
    # Grafana's rate window follows the scrape interval.
    assert (
        source["jsonData"]["timeInterval"]
        == load_yaml(PROMETHEUS_CONFIG)["global"]["scrape_interval"]
    )


# --------------------------------------------------------------------------------------
# The dashboard

GRID_POS = {
    "type": "object",
    "required": ["h", "w", "x", "y"],
    "properties": {
        "h": {"type": "integer", "exclusiveMinimum": 0},
        "w": {"type": "integer", "exclusiveMinimum": 0, "maximum": 24},
        "x": {"type": "integer", "minimum": 0, "exclusiveMaximum": 24},
        "y": {"type": "integer", "minimum": 0},
    },
}
DATASOURCE_REF = {
    "type": "object",
    "required": ["type", "uid"],
    "properties": {"type": {"type": "string"}, "uid": {"type": "string"}},
    "additionalProperties": False,
}
# Grafana's dashboard JSON model (schemaVersion 36 and later), transcribed from the
# dashboard kind's schema: grafana/grafana, kinds/dashboard/dashboard_kind.cue (`spec`,
# `#Panel`, `#RowPanel`, `#GridPos`, `#DataSourceRef`, `#FieldConfigSource`). Fields the
# kind gives a default are required here, so the file does not lean on defaults; a panel's
# `targets` are open in the kind (`#Target: {...}`): the Prometheus datasource's query
# model (refId, expr, legendFormat) is checked instead.
DASHBOARD_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["uid", "title", "editable", "graphTooltip", "schemaVersion", "time", "panels"],
    "properties": {
        "uid": {"type": "string", "minLength": 1, "maxLength": 40},
        "title": {"type": "string", "minLength": 1},
        "tags": {"type": "array", "items": {"type": "string"}},
        "editable": {"type": "boolean"},
        "graphTooltip": {"enum": [0, 1, 2]},
        "schemaVersion": {"type": "integer", "minimum": 36, "maximum": 65535},
        "refresh": {"type": "string"},
        "time": {
            "type": "object",
            "required": ["from", "to"],
            "properties": {"from": {"type": "string"}, "to": {"type": "string"}},
        },
        "templating": {"type": "object", "properties": {"list": {"type": "array"}}},
        "annotations": {"type": "object", "properties": {"list": {"type": "array"}}},
        "panels": {"type": "array", "items": {"$ref": "#/$defs/anyPanel"}},
    },
    "$defs": {
        "anyPanel": {
            "if": {"properties": {"type": {"const": "row"}}},
            "then": {"$ref": "#/$defs/rowPanel"},
            "else": {"$ref": "#/$defs/panel"},
        },
        "rowPanel": {
            "type": "object",
            "required": ["type", "id", "collapsed", "panels", "gridPos"],
            "properties": {
                "id": {"type": "integer", "minimum": 0},
                "title": {"type": "string"},
                "collapsed": {"type": "boolean"},
                "gridPos": GRID_POS,
                "panels": {"type": "array", "items": {"$ref": "#/$defs/panel"}},
            },
        },
        "panel": {
            "type": "object",
            "required": [
                "type",
                "id",
                "title",
                "gridPos",
                "datasource",
                "targets",
                "options",
                "fieldConfig",
            ],
            "properties": {
                "type": {"type": "string", "minLength": 1},
                "id": {"type": "integer", "minimum": 0},
                "title": {"type": "string", "minLength": 1},
                "description": {"type": "string"},
                "gridPos": GRID_POS,
                "datasource": DATASOURCE_REF,
                "options": {"type": "object"},
                "fieldConfig": {
                    "type": "object",
                    "required": ["defaults", "overrides"],
                    "properties": {
                        "defaults": {"type": "object"},
                        "overrides": {"type": "array"},
                    },
                },
                "targets": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["refId", "expr", "datasource"],
                        "properties": {
                            "refId": {"type": "string", "minLength": 1},
                            "expr": {"type": "string", "minLength": 1},
                            "legendFormat": {"type": "string"},
                            "datasource": DATASOURCE_REF,
                        },
                    },
                },
            },
        },
    },
}


def schema_errors(document: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft202012Validator(DASHBOARD_SCHEMA)
    return [error.message for error in validator.iter_errors(document)]


def panels(document: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel but rows (also those inside collapsed rows)."""
    for panel in document["panels"]:
        if panel["type"] == "row":
            yield from panel["panels"]
        else:
            yield panel


def test_the_dashboard_follows_grafanas_dashboard_model() -> None:
    jsonschema.Draft202012Validator.check_schema(DASHBOARD_SCHEMA)
    document = dashboard()
    assert schema_errors(document) == []
    # The schema does refuse what Grafana would not lay out or query.
    broken = copy.deepcopy(document)
    first = next(panels(broken))
    first["gridPos"]["w"] = 25
    del first["targets"][0]["expr"]
    assert sorted(schema_errors(broken)) == [
        "'expr' is a required property",
        "25 is greater than the maximum of 24",
    ]
    # Panel ids are unique; no two panels overlap on the 24-column grid.
    everything = document["panels"]
    ids = [p["id"] for p in everything]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for panel in everything:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]
    for panel in panels(document):
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]


def test_every_panel_queries_the_provisioned_datasource() -> None:
    (source,) = load_yaml(DATASOURCES)["datasources"]
    expected = {"type": source["type"], "uid": source["uid"]}
    found = 0
    for panel in panels(dashboard()):
        assert panel["datasource"] == expected, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == expected, panel["title"]
            found += 1
    assert found >= 30


def expressions() -> list[tuple[str, str, str]]:
    """(panel title, PromQL as Prometheus receives it, legend) of every query."""
    found = []
    for panel in panels(dashboard()):
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            assert "$" not in expr, f"{panel['title']}: a variable Grafana does not define"
            found.append((panel["title"], expr, target.get("legendFormat", "")))
    return found


def parse(expr: str) -> promql_parser.Expr:
    return promql_parser.parse(expr)


def test_every_expression_parses() -> None:
    """With promql-parser (a port of Prometheus's own parser), as promtool would."""
    parsed = [parse(expr) for _, expr, _ in expressions()]  # ValueError: what is wrong
    assert len(parsed) >= 30
    # The parser does refuse what Prometheus refuses.
    with pytest.raises(ValueError, match="unclosed left parenthesis"):
        parse("sum(rate(genmesh_frontend_requests_total[1m])")
    with pytest.raises(ValueError, match="unknown function with name 'histogram_percentile'"):
        parse("histogram_percentile(0.5, genmesh_frontend_requests_total)")
    with pytest.raises(ValueError, match="expected type matrix in call to function 'rate'"):
        parse("rate(genmesh_frontend_requests_total)")


def queried(expr: str) -> tuple[set[str], set[str]]:
    """The metric names an expression selects and the label names it reads (matchers,
    by/without, on/ignoring, group_left/right)."""
    names: set[str] = set()
    labels: set[str] = set()

    def visit(node: promql_parser.Expr) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"a selector without a metric name in {expr}"
            names.add(node.name)
            labels.update(m.name for m in node.matchers.matchers if m.name != "__name__")
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            labels.update(node.modifier.labels)
        elif isinstance(node, promql_parser.BinaryExpr) and node.modifier is not None:
            if node.modifier.matching is not None:
                labels.update(node.modifier.matching.labels)
            labels.update(node.modifier.group_labels or [])

    promql_parser.walk(parse(expr), visit)
    return names, labels


def test_queried_reads_names_and_labels() -> None:
    names, labels = queried(
        'sum by (worker) (a_total{code!="x"}) / on (instance) group_left (model) b * 2'
    )
    assert names == {"a_total", "b"}
    assert labels == {"worker", "code", "instance", "model"}


# --------------------------------------------------------------------------------------
# Every metric a panel queries exists


def exported(text: str) -> dict[str, set[str]]:
    """Each series name a /metrics page exports, with the labels seen on it. A family
    with no sample yet counts from its HELP/TYPE lines (a histogram as its _bucket,
    _sum and _count, a counter as its _total)."""
    found: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",)}
        for suffix in suffixes.get(family.type, ("",)):
            found.setdefault(family.name + suffix, set())
        for sample in family.samples:
            found.setdefault(sample.name, set()).update(sample.labels)
    return found


def varz_metric_names(varz: dict[str, Any], prefix: tuple[str, ...] = ()) -> set[str]:
    """The names prometheus-nats-exporter's `-varz` gives the numbers of a /varz answer:
    collector/collector.go, objectToMetrics and fqName (nested objects flattened with
    `_`, `/` made `_`, runs of `_` made one; booleans and lists left out)."""
    names = set()
    for key, value in varz.items():
        path = (*prefix, key)
        fqn = re.sub(r"_+", "_", "_".join(path).replace("/", "_")).strip("_")
        if fqn in EXPORTER_SKIPPED:
            continue
        if isinstance(value, dict):
            names |= varz_metric_names(value, path)
        elif (isinstance(value, int | float) and not isinstance(value, bool)) or (
            isinstance(value, str) and key in EXPORTER_STRING_KEYS
        ):
            names.add(f"gnatsd_varz_{fqn}")
    return names


@pytest.fixture(scope="module")
def nats_exporter_series() -> dict[str, set[str]]:
    """What the exporter, as compose runs it, exports for a real nats-server with
    JetStream on (as compose's) and a monitoring port."""
    monitor_port = free_port()
    server = NatsServer(jetstream=True, extra_args=["-m", str(monitor_port)])
    server.start()
    try:
        varz_url = f"http://{server.host}:{monitor_port}/varz"
        with urllib.request.urlopen(varz_url, timeout=10) as answer:
            varz = json.load(answer)
    finally:
        server.stop()
    assert varz["connections"] == 0  # a number the exporter turns into a gauge
    series = {name: {"server_id"} for name in varz_metric_names(varz)}
    return {**series, **EXPORTER_HEALTHZ}


def test_the_exporters_naming_rule() -> None:
    varz = {
        "connections": 3,
        "jetstream": {"config": {"max_memory": 10, "store_dir": "/data"}, "stats": {"api": {}}},
        "cluster": {"cluster_port": 6222, "name": "c"},
        "server_name": "nats-1",
        "tls_required": False,
        "http_req_stats": {"/varz": 1},
        "connect_urls": ["a"],
    }
    assert varz_metric_names(varz) == {
        "gnatsd_varz_connections",
        "gnatsd_varz_jetstream_config_max_memory",
        "gnatsd_varz_cluster_name",
        "gnatsd_varz_server_name",
        "gnatsd_varz_http_req_stats_varz",
    }


TOKENS = 4
PROMPT = list(range(1, 65))  # four blocks of 16: cached where it ran before


async def traffic(mesh: InProcessMesh, decode: str) -> None:
    """Requests that make every series appear: through the frontend (unary, SSE, vLLM,
    one refused; one prompt three times, for a prefix cache hit), and two over NATS
    through the router, the second pinned to the decode worker `decode`, which the
    router pairs with the prefill worker (a disaggregated request)."""
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": TOKENS}}
    for _ in range(2):
        reply = await post(mesh.http_url + "/generate", body)
        assert reply.status == 200, reply.body
    events = await stream(mesh.http_url + "/generate", {**body, "stream": True})
    assert events.events[-1] == "[DONE]"
    vllm = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": TOKENS}}
    json_body = {"Content-Type": "application/json"}  # as vLLM requires
    vllm_reply = await post(mesh.http_url + "/inference/v1/generate", vllm, headers=json_body)
    assert vllm_reply.status == 200, vllm_reply.body
    refused = await post(mesh.http_url + "/generate", {"sampling_params": {}})
    assert refused.status == 400
    async with await MeshClient.connect(mesh.nats_url, mesh.namespace) as client:
        frames = [f async for f in client.generate(request([1, 2, 3], max_tokens=TOKENS))]
        assert frames[-1]["t"] == "end", frames[-1]
        pinned = request(PROMPT, max_tokens=TOKENS, worker=decode)
        frames = [f async for f in client.generate(pinned)]
        assert frames[-1]["t"] == "end", frames[-1]


async def scrape(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url) as answer:
        assert answer.status == 200, url
        return await answer.text()


def total(text: str, name: str, **labels: str) -> float:
    """The sum of a /metrics page's samples named `name` (with these label values)."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


# The workers of the live mesh: compose's two plain ones, and its `pd` profile's pair.
WORKER_ROLES = {"worker-1": "", "worker-2": "", "prefill": "prefill", "decode": "decode"}


def start_mesh(nats_url: str) -> tuple[InProcessMesh, dict[str, str]]:
    """A mesh like compose's with its `pd` profile (the frontend routes its own requests;
    a router, two workers and a prefill + decode pair serve metrics ports), with the kv
    policy and the mocks' prefix caches on so that the KV series exist too. Returns it
    and the URL of every /metrics by service ("frontend", "router", WORKER_ROLES' keys);
    the decode worker's id is its service name."""
    mesh = InProcessMesh(nats_url, unique_namespace("monitoring"))
    ports = {name: free_port() for name in ["router", *WORKER_ROLES]}
    try:
        mesh.add_router("least_loaded", extra_args=("--metrics-port", str(ports["router"])))
        for name, role in WORKER_ROLES.items():
            args = ("--metrics-port", str(ports[name]), "--mock-kv-blocks", "64")
            mesh.add_worker(name, wait=False, extra_args=(*args, "--role", role) if role else args)
        mesh.add_frontend("--router-policy", "kv")
        mesh.wait_for_workers(lambda ids: set(WORKER_ROLES) <= ids, what="the workers")
    except BaseException:
        print(mesh.logs())
        mesh.stop()
        raise
    urls = {name: f"http://127.0.0.1:{port}/metrics" for name, port in ports.items()}
    return mesh, {"frontend": mesh.http_url + "/metrics", **urls}


def unexported(series: dict[str, set[str]], queries: list[tuple[str, str, str]]) -> list[str]:
    """What `queries` (as `expressions()` gives them) read that `series` (name -> labels)
    does not have: a metric nothing exports, or a label none of its metrics carries."""
    problems = []
    for title, expr, legend in queries:
        names, labels = queried(expr)
        missing = names - set(series)
        if missing:
            problems.append(f"{title}: nothing exports {sorted(missing)}")
            continue
        available = set().union(*(series[n] for n in names)) | TARGET_LABELS
        labels |= set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
        if not labels <= available:
            problems.append(f"{title}: {expr} reads {sorted(labels - available)}")
    return problems


@pytest.mark.inproc
async def test_every_metric_and_label_a_panel_queries_exists(
    nats_url: str, nats_exporter_series: dict[str, set[str]]
) -> None:
    """Every /metrics of a real mesh, scraped over HTTP after some traffic, and the
    exporter's series: each name a panel queries is among them, with each label it reads."""
    mesh, urls = await asyncio.to_thread(start_mesh, nats_url)
    try:
        await traffic(mesh, decode="decode")
        pages = {name: await scrape(url) for name, url in urls.items()}
    except BaseException:
        print(mesh.logs())
        raise
    finally:
        await asyncio.to_thread(mesh.stop)

    # The hit ratio's numerator is fed: of three identical prompts on the workers the
    # frontend routes to, one found its blocks cached (the mock reports cached_tokens as
    # SGLang does).
    assert total(pages["frontend"], "genmesh_frontend_cached_tokens_total") >= len(PROMPT) - 16
    # The P/D panels' series are fed: the router paired the pinned request with the
    # prefill worker, which ran its prefill stage; the decode worker timed the handoff.
    assert total(pages["router"], "genmesh_pd_routed_total", path="disaggregated") >= 1
    assert total(pages["prefill"], "genmesh_pd_stages_total", outcome="completed") >= 1
    assert total(pages["decode"], "genmesh_pd_transfer_seconds_count") >= 1
    series = {**nats_exporter_series, **PROMETHEUS_SERIES}
    for page in pages.values():
        for name, labels in exported(page).items():
            series.setdefault(name, set()).update(labels)
    assert unexported(series, expressions()) == []
    checked = set().union(*(queried(expr)[0] for _, expr, _ in expressions()))
    assert {"genmesh_kv_index_blocks", "gnatsd_varz_in_msgs", "up"} <= checked
    assert {
        "genmesh_pd_routed_total",
        "genmesh_pd_transfer_seconds_bucket",
        "genmesh_pd_stages_total",
        "genmesh_pd_experts_omitted_total",
    } <= checked

    # The same check refuses a misspelt metric, and a label that another metric carries
    # (genmesh_pd_routed_total's `path`) but the one queried does not.
    misspelt = [
        ("transfer", "sum(rate(genmesh_pd_transfer_second_bucket[20s]))", ""),
        ("stages", "sum by (path) (rate(genmesh_pd_stages_total[20s]))", "{{outcome}}"),
    ]
    assert unexported(series, misspelt) == [
        "transfer: nothing exports ['genmesh_pd_transfer_second_bucket']",
        "stages: sum by (path) (rate(genmesh_pd_stages_total[20s])) reads ['path']",
    ]

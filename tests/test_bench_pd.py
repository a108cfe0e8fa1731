"""benchmarks/bench_pd.py's own logic: the run plan, billing processes, reading the
engines' per-half request counters, rows, P/D over aggregated ratios, the table and its options.
(The benchmark itself runs the systems; it prints figures and asserts nothing.)"""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_pd

pytestmark = pytest.mark.unit

# Excerpts of what Dynamo 1.6.1's mockers answered on /metrics after 27 requests through
# its P/D (a prefill mocker, then a decode one), and of genmesh workers' answers
# (services/worker/metrics.py): an aggregated worker, a prefill and a decode worker.
DYNAMO_PREFILL = """\
# HELP dynamo_component_requests_total Total number of requests processed by work handler
# TYPE dynamo_component_requests_total counter
dynamo_component_requests_total{dynamo_component="prefill",dynamo_endpoint="generate",\
dynamo_namespace="dynamo",worker_id="3a492f53b41e72cf"} 27
dynamo_component_requests_total{dynamo_component="prefill",dynamo_endpoint=\
"worker_kv_query_source_116544454f97e0",dynamo_namespace="dynamo",worker_id="3a492f53b41e72cf"} 3
# HELP dynamo_component_uptime_seconds Total uptime of the DistributedRuntime in seconds
# TYPE dynamo_component_uptime_seconds gauge
dynamo_component_uptime_seconds{worker_id="3a492f53b41e72cf"} 10.154203633
"""
DYNAMO_DECODE = """\
# HELP dynamo_component_requests_total Total number of requests processed by work handler
# TYPE dynamo_component_requests_total counter
dynamo_component_requests_total{dynamo_component="backend",dynamo_endpoint="generate",\
dynamo_namespace="dynamo",worker_id="7d6146f888b5d7e2"} 27
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",model_name="tiny",le="+Inf"} 27
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 27
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 0.17
"""
GENMESH_REQUESTS = """\
# HELP genmesh_worker_requests_total Requests by outcome
# TYPE genmesh_worker_requests_total counter
genmesh_worker_requests_total{{outcome="completed"}} {completed}
genmesh_worker_requests_total{{outcome="cancelled"}} 2.0
genmesh_worker_requests_total{{outcome="failed"}} 1.0
genmesh_worker_requests_total{{outcome="rejected"}} 0.0
# HELP genmesh_worker_aborts_total Engine requests stopped before they ended
# TYPE genmesh_worker_aborts_total counter
genmesh_worker_aborts_total 2.0
"""
GENMESH_STAGES = """\
# HELP genmesh_pd_stages_total Prefill stages of disaggregated requests
# TYPE genmesh_pd_stages_total counter
genmesh_pd_stages_total{{outcome="completed"}} {completed}
genmesh_pd_stages_total{{outcome="cancelled"}} 0.0
genmesh_pd_stages_total{{outcome="failed"}} 4.0
"""


def workload_result(**changes: Any) -> dict[str, Any]:
    """A kv_workload.py result as it prints it (the fields bench_pd reads)."""
    result: dict[str, Any] = {
        "n": 16,
        "ok": 16,
        "errors": 0,
        "maxtok": 32,
        "rps": 4.77,
        "ttft_ms": {"p50": 30.26, "p90": 31.55, "p99": 32.55},
        "e2e_ms": {"p50": 209.04, "p90": 209.97, "p99": 210.95},
        "loadgen_cpu_ms_per_req": 5.65,
        "cpu_frontend_ms_per_req": 10.625,
        "cpu_engines_ms_per_req": 16.875,
        "cpu_nats_ms_per_req": 5.0,
        "warmup": 4,
    }
    return result | changes


def test_every_run_has_its_own_seed_in_a_fixed_order() -> None:
    plan = bench_pd.run_plan([256, 4096], [1, 8], seed=10)
    assert plan == [(256, 1, 10), (4096, 1, 11), (256, 8, 12), (4096, 8, 13)]


def test_genmesh_processes_are_told_apart_by_their_command() -> None:
    python = "/work/.venv/bin/python"
    assert bench_pd.genmesh_role([python, "-m", "genmesh", "frontend", "--port", "1"]) == (
        "frontend"
    )
    assert bench_pd.genmesh_role([python, "-m", "genmesh", "worker"]) == "worker"
    assert bench_pd.genmesh_role([python, "-m", "genmesh"]) is None
    assert bench_pd.genmesh_role(["/usr/bin/nats-server", "-m", "0"]) is None


def test_dynamo_mockers_count_their_half_on_the_generate_endpoint() -> None:
    assert bench_pd.served_halves(DYNAMO_PREFILL) == {"prefill": 27, "decode": 0}
    assert bench_pd.served_halves(DYNAMO_DECODE) == {"prefill": 0, "decode": 27}


def test_genmesh_prefill_stages_are_not_counted_as_decode_requests() -> None:
    prefill_worker = GENMESH_REQUESTS.format(completed=27.0) + GENMESH_STAGES.format(completed=27.0)
    assert bench_pd.served_halves(prefill_worker) == {"prefill": 27, "decode": 0}
    decode_worker = GENMESH_REQUESTS.format(completed=27.0)
    assert bench_pd.served_halves(decode_worker) == {"prefill": 0, "decode": 27}
    assert bench_pd.served_halves("") == {"prefill": 0, "decode": 0}


HALVES = {"prefill": 20, "decode": 20}


def test_a_row_totals_the_cpu_of_every_mesh_process_group() -> None:
    row = bench_pd.make_row("dynamo-pd", 256, 1, workload_result(), HALVES)
    assert row["cpu_ms_per_req"] == {
        "total": 32.5,
        "frontend": 10.625,
        "engines": 16.875,
        "nats": 5.0,
    }
    assert row["halves"] == HALVES
    assert (row["system"], row["prompt_tokens"], row["concurrency"]) == ("dynamo-pd", 256, 1)
    assert (row["output_tokens"], row["ok"], row["rps"]) == (32, 16, 4.77)


def test_a_row_whose_halves_add_up_passes_the_check() -> None:
    pd = bench_pd.make_row("dynamo-pd", 256, 1, workload_result(), HALVES)
    assert bench_pd.pd_check(pd) is None
    agg = bench_pd.make_row("genmesh-agg", 256, 8, workload_result(), {"prefill": 0, "decode": 20})
    assert bench_pd.pd_check(agg) is None
    uncounted = bench_pd.make_row("genmesh-agg", 256, 1, workload_result(), None)
    assert bench_pd.pd_check(uncounted) is None


def test_a_pd_run_that_skipped_a_half_is_reported() -> None:
    row = bench_pd.make_row("genmesh-pd", 256, 1, workload_result(), {"prefill": 0, "decode": 20})
    assert bench_pd.pd_check(row) == (
        "genmesh-pd p256 c1: 20 requests sent, 0 prefill and 20 decode served (expected 20 and 20)"
    )
    row = bench_pd.make_row(
        "dynamo-pd-bootstrap", 1024, 8, workload_result(), {"prefill": 20, "decode": 17}
    )
    assert bench_pd.pd_check(row) == (
        "dynamo-pd-bootstrap p1024 c8: 20 requests sent, 20 prefill and 17 decode served "
        "(expected 20 and 20)"
    )
    row = bench_pd.make_row("dynamo-agg", 256, 1, workload_result(), {"prefill": 1, "decode": 20})
    assert bench_pd.pd_check(row) == (
        "dynamo-agg p256 c1: 20 requests sent, 1 prefill and 20 decode served (expected 0 and 20)"
    )


def agg_and_pd() -> list[dict[str, Any]]:
    agg = bench_pd.make_row(
        "dynamo-agg",
        256,
        1,
        workload_result(
            rps=5.0,
            ttft_ms={"p50": 20.0, "p90": 25.0},
            e2e_ms={"p50": 200.0},
            cpu_frontend_ms_per_req=8.0,
            cpu_engines_ms_per_req=8.0,
            cpu_nats_ms_per_req=4.0,
        ),
        {"prefill": 0, "decode": 20},
    )
    pd = bench_pd.make_row(
        "dynamo-pd",
        256,
        1,
        workload_result(rps=4.0, ttft_ms={"p50": 30.0, "p90": 50.0}, e2e_ms={"p50": 210.0}),
        HALVES,
    )
    return [agg, pd]


def test_pd_figures_are_divided_by_the_same_familys_aggregated_run() -> None:
    rows = agg_and_pd()
    genmesh_alone = bench_pd.make_row("genmesh-pd", 256, 1, workload_result(), HALVES)
    other_run = bench_pd.make_row("dynamo-pd", 1024, 1, workload_result(), HALVES)
    [ratio] = bench_pd.pd_ratios([*rows, genmesh_alone, other_run])
    assert ratio == {
        "system": "dynamo-pd/agg",
        "prompt_tokens": 256,
        "concurrency": 1,
        "rps": pytest.approx(0.8),
        "ttft_p50": pytest.approx(1.5),
        "ttft_p90": pytest.approx(2.0),
        "e2e_p50": pytest.approx(1.05),
        "cpu": pytest.approx(32.5 / 20.0),
    }


def test_a_ratio_over_nothing_is_no_ratio() -> None:
    agg, pd = agg_and_pd()
    agg["rps"] = 0.0
    agg["ttft_ms"]["p50"] = float("nan")
    [ratio] = bench_pd.pd_ratios([agg, pd])
    assert ratio["rps"] is None
    assert ratio["ttft_p50"] is None
    assert ratio["ttft_p90"] == pytest.approx(2.0)


def test_the_table_shows_each_run_its_rows_and_ratios() -> None:
    lines = bench_pd.render(agg_and_pd()).splitlines()
    assert lines[0].split() == [
        "prompt", "c", "system", "req/s", "TTFT", "p50", "p90", "e2e", "p50", "cpu/req",
        "fe", "eng", "nats", "halves", "err",
    ]  # fmt: skip
    assert lines[1].split() == [
        "256", "1", "dynamo-agg", "5.0", "20.0", "25.0", "200.0", "20.00", "8.00", "8.00",
        "4.00", "0/20", "0",
    ]  # fmt: skip
    assert lines[2].split()[:4] == ["dynamo-pd", "4.0", "30.0", "50.0"]
    assert lines[3].split() == ["dynamo-pd/agg", "0.80x", "1.50x", "2.00x", "1.05x", "1.62x"]
    assert len(lines) == 4


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_dynamo_pd_runs_one_mocker_per_half_transferring_as_genmesh_does() -> None:
    args = bench_pd.parse_args(["--speedup", "2", "--kv-bytes-per-token", "4096"])
    mockers, frontend = bench_pd.dynamo_commands(
        "py", Path("/m"), "dynamo-pd", args, http_port=18000, bootstrap_port=20001
    )
    assert [flag(m, "--disaggregation-mode") for m in mockers] == ["prefill", "decode"]
    assert "--bootstrap-ports" not in mockers[0]
    for mocker in mockers:
        assert flag(mocker, "--speedup-ratio") == "2"
        assert flag(mocker, "--kv-bytes-per-token") == "4096"
        assert flag(mocker, "--kv-transfer-bandwidth") == "50"
    assert flag(frontend, "--http-port") == "18000"
    assert flag(frontend, "--router-mode") == "round-robin"
    mockers, _ = bench_pd.dynamo_commands(
        "py", Path("/m"), "dynamo-pd-bootstrap", args, http_port=18000, bootstrap_port=20001
    )
    assert flag(mockers[0], "--bootstrap-ports") == "20001"
    mockers, _ = bench_pd.dynamo_commands(
        "py", Path("/m"), "dynamo-agg", args, http_port=18000, bootstrap_port=20001
    )
    assert len(mockers) == 2
    for mocker in mockers:
        assert "--disaggregation-mode" not in mocker
        assert "--kv-transfer-bandwidth" not in mocker


def test_metrics_ports_are_free_consecutive_and_fit_an_i16() -> None:
    ports = bench_pd.free_ports(3)
    assert ports == list(range(ports[0], ports[0] + 3))
    assert ports[0] >= 20000
    assert ports[-1] < 32768
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_unknown_systems_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_pd.parse_args(["--systems", "genmesh-agg,sglang-pd"])
    assert "unknown systems: sglang-pd (known: genmesh-agg, genmesh-pd" in capsys.readouterr().err
    args = bench_pd.parse_args(["--prompt-tokens", "128,512", "--concurrency", "2"])
    assert (args.prompt_tokens, args.concurrency) == ([128, 512], [2])
    assert args.systems == ["genmesh-agg", "genmesh-pd", "dynamo-agg", "dynamo-pd"]

"""benchmarks/bench_pd.py's own logic: the run plan, billing processes, reading Dynamo's
per-half request counters, rows, P/D over aggregated ratios, the table and its options.
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

# What kv_workload.py's `metrics_delta` held for 16 requests through Dynamo 1.6.1's P/D
# (mocker1 the prefill mocker, mocker2 the decode one), with a series of another endpoint
# and a non-counter added.
PD_DELTA = {
    "mocker1": {
        'dynamo_component_requests_total{dynamo_component="prefill",dynamo_endpoint="generate",'
        'dynamo_namespace="dynamo",worker_id="1173a84d53e58a8b"}': 16.0,
        'dynamo_component_requests_total{dynamo_component="prefill",dynamo_endpoint='
        '"worker_kv_query_source_76a146fe606c1",dynamo_namespace="dynamo",worker_id="9a5"}': 3.0,
    },
    "mocker2": {
        'dynamo_component_requests_total{dynamo_component="backend",dynamo_endpoint="generate",'
        'dynamo_namespace="dynamo",worker_id="eb64e4622b7896f0"}': 16.0,
        'vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"}': 16.0,
    },
}


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
        "metrics_delta": PD_DELTA,
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


def test_requests_per_half_count_only_the_generate_endpoint() -> None:
    assert bench_pd.component_requests(PD_DELTA) == {"prefill": 16, "backend": 16}
    assert bench_pd.component_requests({}) == {}


def test_a_row_totals_the_cpu_of_every_mesh_process_group() -> None:
    row = bench_pd.make_row("dynamo-pd", 256, 1, workload_result())
    assert row["cpu_ms_per_req"] == {
        "total": 32.5,
        "frontend": 10.625,
        "engines": 16.875,
        "nats": 5.0,
    }
    assert row["halves"] == {"prefill": 16, "decode": 16}
    assert (row["system"], row["prompt_tokens"], row["concurrency"]) == ("dynamo-pd", 256, 1)
    assert (row["output_tokens"], row["ok"], row["rps"]) == (32, 16, 4.77)


def test_a_row_without_dynamo_counters_has_no_halves() -> None:
    row = bench_pd.make_row("genmesh-agg", 256, 1, workload_result(metrics_delta={}))
    assert row["halves"] is None
    assert bench_pd.pd_check(row) is None


def test_a_pd_run_that_skipped_a_half_is_reported() -> None:
    delta = {"mocker2": PD_DELTA["mocker2"]}
    row = bench_pd.make_row("dynamo-pd", 256, 1, workload_result(metrics_delta=delta))
    assert row["halves"] == {"prefill": None, "decode": 16}
    assert bench_pd.pd_check(row) == "dynamo-pd: 0 of 16 requests hit prefill"
    short = dict(PD_DELTA["mocker1"])
    short[next(iter(short))] = 12.0
    row = bench_pd.make_row(
        "dynamo-pd-bootstrap", 256, 1, workload_result(metrics_delta=PD_DELTA | {"mocker1": short})
    )
    assert bench_pd.pd_check(row) == "dynamo-pd-bootstrap: 12 of 16 requests hit prefill"
    assert bench_pd.pd_check(bench_pd.make_row("dynamo-pd", 256, 1, workload_result())) is None


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
    )
    pd = bench_pd.make_row(
        "dynamo-pd",
        256,
        1,
        workload_result(rps=4.0, ttft_ms={"p50": 30.0, "p90": 50.0}, e2e_ms={"p50": 210.0}),
    )
    return [agg, pd]


def test_pd_figures_are_divided_by_the_same_familys_aggregated_run() -> None:
    rows = agg_and_pd()
    genmesh_alone = bench_pd.make_row("genmesh-pd", 256, 1, workload_result())
    other_run = bench_pd.make_row("dynamo-pd", 1024, 1, workload_result())
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
        "4.00", "16/16", "0",
    ]  # fmt: skip
    assert lines[2].split()[:4] == ["dynamo-pd", "4.0", "30.0", "50.0"]
    assert lines[3].split() == ["dynamo-pd/agg", "0.80x", "1.50x", "2.00x", "1.05x", "1.62x"]
    assert len(lines) == 4


def test_dynamo_pd_runs_one_mocker_per_half() -> None:
    mockers, frontend = bench_pd.dynamo_commands(
        "py", Path("/m"), "dynamo-pd", 1.0, http_port=18000, bootstrap_port=20001
    )
    assert [m[m.index("--disaggregation-mode") + 1] for m in mockers] == ["prefill", "decode"]
    assert "--bootstrap-ports" not in mockers[0]
    assert all(m[m.index("--speedup-ratio") + 1] == "1" for m in mockers)
    assert frontend[frontend.index("--http-port") + 1] == "18000"
    assert frontend[frontend.index("--router-mode") + 1] == "round-robin"
    mockers, _ = bench_pd.dynamo_commands(
        "py", Path("/m"), "dynamo-pd-bootstrap", 1.0, http_port=18000, bootstrap_port=20001
    )
    assert mockers[0][mockers[0].index("--bootstrap-ports") + 1] == "20001"
    mockers, _ = bench_pd.dynamo_commands(
        "py", Path("/m"), "dynamo-agg", 1.0, http_port=18000, bootstrap_port=20001
    )
    assert len(mockers) == 2
    assert not any("--disaggregation-mode" in m for m in mockers)


def test_a_mockers_metrics_port_is_free_and_fits_an_i16() -> None:
    port = bench_pd.free_system_port()
    assert 20000 <= port < 32768
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_unknown_systems_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench_pd.parse_args(["--systems", "genmesh-agg,sglang-pd"])
    assert "unknown systems: sglang-pd (known: genmesh-agg, genmesh-pd" in capsys.readouterr().err
    args = bench_pd.parse_args(["--prompt-tokens", "128,512", "--concurrency", "2"])
    assert (args.prompt_tokens, args.concurrency) == ([128, 512], [2])
    assert args.systems == ["genmesh-agg", "genmesh-pd", "dynamo-agg", "dynamo-pd"]

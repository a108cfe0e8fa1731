"""`genmesh bench` (docs/bench.md): against a running mesh (the module's in-process mesh
over real NATS and HTTP), against the testkit's mock SGLang and vLLM servers (both of
SGLang's stream modes), its workload's bodies, its refusals and its error counts."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from genmesh import cli
from genmesh.bench.apis import APIS, Failed
from genmesh.bench.config import BenchConfig
from genmesh.bench.main import bench
from genmesh.bench.plot import MISSING_EXTRA
from genmesh.bench.workload import Workload
from genmesh.formats.sglang.schema import validate_body
from genmesh.formats.vllm.schema import GenerateRequest
from genmesh.shared.lifecycle import stop_signals
from genmesh.shared.loop import run
from genmesh.shared.settings import parse
from genmesh.testkit.common import serving
from genmesh.testkit.config import MockServerConfig
from genmesh.testkit.sglang import build_app as sglang_app
from genmesh.testkit.vllm import build_app as vllm_app
from genmesh.testkit.vllm.app import Profile
from tests.conftest import SHARED_WORKERS
from tests.inproc import InProcessMesh
from tests.mesh import wait_until
from tests.test_mesh_behaviour import card

# The shared mesh's mock workers know 1000 token ids (tests/conftest.py SHARED_WORKERS).
VOCAB = "1000"


def _bench(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["bench", "--no-progress", *argv])
    out, err = capsys.readouterr()
    return code, " ".join(out.split()), err  # (the table's lines wrap where they will)


def _read(path: Path) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(path.read_text())
    return document


def _sane(dist: dict[str, float]) -> None:
    assert dist["count"] > 0
    assert 0 <= dist["p50"] <= dist["p90"] <= dist["p99"] <= dist["max"]


@pytest.mark.inproc
def test_sse_run_against_a_mesh_gives_figures_json_and_png(
    mesh: InProcessMesh, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json, out_png = tmp_path / "run.json", tmp_path / "run.png"
    code, out, _ = _bench(
        capsys,
        *("--url", mesh.http_url, "--stream", "-n", "40", "-c", "4", "--warmup", "5"),
        *("--input-len", "24", "--output-len", "8", "--vocab-size", VOCAB),
        *("--json-out", str(out_json), "--plot", str(out_png)),
    )
    assert code == 0, out
    assert "TTFT (ms)" in out
    assert "40/40 ok" in out
    document = _read(out_json)
    summary = document["summary"]
    assert (summary["requests"], summary["completed"], summary["errors"]) == (40, 40, {})
    assert summary["output_tokens"] == 40 * 8
    assert summary["short_outputs"] == 0
    for name in ("ttft_ms", "itl_ms", "e2e_ms"):
        _sane(summary[name])
    assert document["config"]["stream"] is True
    assert document["url"].endswith("/generate")
    records = document["requests"]
    assert [r["index"] for r in records] == list(range(40))  # warm-up left out
    for r in records:
        assert (r["prompt_tokens"], r["output_tokens"], r["error"]) == (24, 8, None)
        assert r["ttft_ms"] <= r["e2e_ms"]
        # The tokens after the first event each have their gap.
        assert len(r["itl_ms"]) < 8
    assert summary["itl_ms"]["count"] == sum(len(r["itl_ms"]) for r in records)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.inproc
def test_unary_vllm_run_with_sampled_lengths_and_an_html_plot(
    mesh: InProcessMesh, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json, page = tmp_path / "run.json", tmp_path / "run.html"
    code, out, _ = _bench(
        capsys,
        *("--url", mesh.http_url, "--format", "vllm", "-n", "30", "-c", "3"),
        *("--input-len", "20", "--input-len-range", "0.5"),
        *("--output-len", "10", "--output-len-range", "0.5", "--vocab-size", VOCAB),
        *("--json-out", str(out_json), "--plot", str(page)),
    )
    assert code == 0, out
    records = _read(out_json)["requests"]
    assert len(records) == 30
    for r in records:
        assert 10 <= r["prompt_tokens"] <= 30
        assert 5 <= r["asked_tokens"] <= 15
        assert r["output_tokens"] == r["asked_tokens"]  # ignore_eos: exactly as asked
        assert r["ttft_ms"] == r["e2e_ms"]
        assert r["itl_ms"] == []
    assert len({r["asked_tokens"] for r in records}) > 1
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>")
    assert "<svg" in text
    assert "time to first token" in text
    assert "throughput over time" in text
    assert "/inference/v1/generate" in text
    assert "<script" not in text


@pytest.mark.inproc
def test_open_loop_sends_the_count_asked(
    mesh: InProcessMesh, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "run.json"
    code, out, _ = _bench(
        capsys,
        *("--url", mesh.http_url, "--request-rate", "300", "--max-concurrency", "4"),
        *("-n", "30", "--output-len", "4", "--vocab-size", VOCAB, "--json-out", str(out_json)),
    )
    assert code == 0, out
    assert "open loop 300.0 req/s, at most 4 in flight" in out
    records = _read(out_json)["requests"]
    assert len(records) == 30
    assert all(r["error"] is None for r in records)
    assert all(r["sent_ms"] >= r["arrived_ms"] for r in records)


@pytest.mark.inproc
def test_open_loop_duration_sends_the_seeded_arrivals(
    mesh: InProcessMesh, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The arrivals are seeded: a --duration run sends those due within it (fewer only if
    the loop stalls past the end), never more: the rate is honoured."""
    out_json = tmp_path / "run.json"
    rate, seconds, seed = 40.0, 1.0, 7
    code, out, _ = _bench(
        capsys,
        *("--url", mesh.http_url, "--request-rate", str(rate), "--duration", str(seconds)),
        *("--seed", str(seed), "--output-len", "4", "--vocab-size", VOCAB),
        *("--json-out", str(out_json)),
    )
    assert code == 0, out
    gaps = random.Random(f"{seed}:arrivals")
    due, expected = gaps.expovariate(rate), 0
    while due < seconds:
        expected += 1
        due += gaps.expovariate(rate)
    sent = len(_read(out_json)["requests"])
    assert expected - 3 <= sent <= expected
    assert 20 <= expected <= 60  # the seed's draw is near rate x duration


@pytest.mark.inproc
def test_refused_requests_are_counted_by_status(
    mesh: InProcessMesh, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "run.json"
    code, out, _ = _bench(
        capsys,
        *("--url", mesh.http_url, "--format", "vllm", "--model", "no-such-model", "-n", "6"),
        *("--vocab-size", VOCAB, "--json-out", str(out_json)),
    )
    assert code == 1
    assert "errors: http 404: 6" in out
    summary = _read(out_json)["summary"]
    assert summary["errors"] == {"http 404": 6}
    assert summary["completed"] == 0
    assert summary["ttft_ms"]["count"] == 0
    assert summary["ttft_ms"]["p50"] is None


@pytest.mark.unit
def test_unreachable_server_counts_connection_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out_json = tmp_path / "run.json"
    code, _, _ = _bench(
        capsys, "--url", f"http://127.0.0.1:{port}", "-n", "3", "--json-out", str(out_json)
    )
    assert code == 1
    assert _read(out_json)["summary"]["errors"] == {"ClientConnectorError": 3}


@pytest.mark.unit
@pytest.mark.parametrize("incremental", [False, True])
async def test_sglang_streams_count_tokens_in_both_modes(incremental: bool) -> None:
    """SGLang sends the whole output so far on every chunk by default, only the new tokens
    with --incremental-streaming-output: both count each token once (the testkit's mock
    SGLang server streams either way, as SGLang does)."""
    app = sglang_app(MockServerConfig(incremental=incremental, token_delay_ms=1.0))
    async with serving(app) as url:
        config = parse(BenchConfig, ["--url", url, "--stream", "-n", "6", "-c", "2"])
        _, phase, summary = await bench(config)
    assert summary.errors == {}
    assert summary.output_tokens == 6 * 32
    for record in phase.records:
        assert record.output_tokens == 32
        # A token per event (1 ms apart): every token after the first has its gap.
        assert len(record.itl) == 31


@pytest.mark.unit
async def test_engine_failures_are_counted_by_kind() -> None:
    """The testkit's SGLang server fails the next requests as asked (testkit/common.py):
    each failure is its own kind; a stream cut short with its `[DONE]` is a short output."""
    faults = [
        {"kind": "http_error", "status": 503},
        {"kind": "drop", "after_tokens": 3},
        {"kind": "no_terminal", "after_tokens": 3},
        {"kind": "abort", "after_tokens": 3, "message": "stopped"},
        {"kind": "done_early", "after_tokens": 3},
    ]
    async with serving(sglang_app(MockServerConfig())) as url:
        async with aiohttp.ClientSession() as session:
            for fault in faults:
                async with session.post(url + "/testkit/faults", json=fault) as queued:
                    assert queued.status == 200
        argv = ["--url", url, "--stream", "-n", "7", "-c", "1"]
        _, phase, summary = await bench(parse(BenchConfig, argv))
    assert summary.errors == {
        "http 503": 1,
        "ClientPayloadError": 1,  # the connection dropped mid-stream
        "incomplete": 1,
        "abort": 1,
    }
    assert (summary.completed, summary.short, summary.output_tokens) == (3, 1, 3 + 32 + 32)
    assert [r.error for r in phase.records][:4] == [
        "http 503",
        "ClientPayloadError",
        "incomplete",
        "abort",
    ]


@pytest.mark.unit
@pytest.mark.parametrize("api", ["new", "old"])
async def test_vllm_server_streaming_or_ignoring_stream(api: Profile) -> None:
    """A vLLM that streams sends deltas; one that ignores `stream` (v0.11-v0.18) answers
    one JSON body, measured as unary."""
    app = vllm_app(MockServerConfig(token_delay_ms=1.0), profile=api)
    async with serving(app) as url:
        argv = ["--url", url, "--format", "vllm", "--stream", "-n", "4", "--output-len", "12"]
        _, phase, summary = await bench(parse(BenchConfig, argv))
    assert summary.errors == {}
    assert summary.output_tokens == 4 * 12
    for record in phase.records:
        if api == "new":
            assert len(record.itl) == 11
        else:
            assert record.itl == []
            assert record.ttft == record.e2e


@pytest.mark.unit
def test_shared_prefixes_are_shared_within_groups_only() -> None:
    argv = ["--url", "http://x:1", "--prefix-groups", "3", "--prefix-len", "16"]
    config = parse(BenchConfig, [*argv, "--input-len", "40", "--input-len-range", "0.5"])
    config.check()
    workload = Workload(config)
    bodies = [json.loads(workload.request(i).body) for i in range(12)]
    prompts = [b["input_ids"] for b in bodies]
    for i, prompt in enumerate(prompts):
        assert 20 <= len(prompt) <= 60
        for j in range(i + 1, 12):
            same_group = i % 3 == j % 3
            assert (prompt[:16] == prompts[j][:16]) is same_group
            assert prompt[16:20] != prompts[j][16:20]  # the rest is each request's own
    # The warm-up's requests are others, with the same group prefixes.
    warmup = json.loads(Workload(config, "warmup").request(1).body)["input_ids"]
    assert warmup[:16] == prompts[1][:16]
    assert warmup != prompts[1]
    # The same seed, the same bodies.
    again = Workload(config)
    assert [again.request(i).body for i in range(3)] == [
        json.dumps(b, separators=(",", ":")).encode() for b in bodies[:3]
    ]


@pytest.mark.unit
def test_bodies_are_what_each_format_accepts() -> None:
    for fmt in ("sglang", "vllm"):
        config = parse(
            BenchConfig, ["--url", "http://x:1", "--format", fmt, "--stream", "--model", "m"]
        )
        body = json.loads(Workload(config).request(0).body)
        if fmt == "sglang":
            request = validate_body(body)
            assert request.sampling_params == {"max_new_tokens": 32, "ignore_eos": True}
            assert request.stream is True
            assert len(request.input_ids) == 128
        else:
            vllm = GenerateRequest.model_validate(body)
            assert vllm.sampling_params.max_tokens == 32
            assert vllm.sampling_params.ignore_eos
            assert vllm.stream is True
            assert len(vllm.token_ids) == 128
        assert body["model"] == "m"


@pytest.mark.unit
def test_sglang_count_without_meta_info_and_in_band_failures() -> None:
    counter = APIS["sglang"].counter()
    # A server that sends no running total: each event's output_ids are new tokens.
    assert [counter.count({"output_ids": [1, 2]}), counter.count({"output_ids": [3]})] == [2, 1]
    with pytest.raises(Failed, match=r"^abort$"):
        APIS["sglang"].count_body(
            {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort"}}}
        )
    with pytest.raises(Failed, match=r"^error$"):
        APIS["vllm"].counter().count({"error": {"message": "boom"}})
    with pytest.raises(Failed, match=r"^abort$"):
        APIS["vllm"].count_body({"choices": [{"token_ids": [1], "finish_reason": "abort"}]})


@pytest.mark.unit
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--max-concurrency", "4"],
            "--max-concurrency caps an open loop: give --request-rate too "
            "(a closed loop's cap is --concurrency)",
        ),
        (["--prefix-groups", "2"], "shared prefixes need both --prefix-groups and --prefix-len"),
        (
            ["--prefix-groups", "2", "--prefix-len", "80", "--input-len-range", "0.5"],
            "--prefix-len 80 is longer than the shortest prompt (64 tokens from --input-len "
            "and --input-len-range)",
        ),
        (["--plot", "x.svg"], "--plot x.svg: the file must end in .png or .html"),
    ],
)
def test_options_that_cannot_go_together_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _bench(capsys, "--url", "http://127.0.0.1:9", *argv)
    assert code == 2
    assert out == ""
    assert err == f"genmesh bench: error: {message} (see genmesh bench --help)\n"


@pytest.mark.unit
def test_requests_and_concurrency_have_one_letter_flags() -> None:
    config = parse(BenchConfig, ["--url", "http://h:1", "-n", "7", "-c", "2"])
    assert (config.requests, config.concurrency) == (7, 2)


@pytest.mark.unit
def test_bad_values_are_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in (
        (["--url", "localhost:8000"], "argument --url: 'localhost:8000' must be an http://"),
        (["--url", "http://h:1", "--input-len-range", "1"], "must be at least 0 and below 1"),
        (["--url", "http://h:1", "-n", "0"], "argument -n/--requests: '0'"),
    ):
        with pytest.raises(SystemExit) as stopped:
            cli.main(["bench", *argv])
        assert stopped.value.code == 2
        assert message in capsys.readouterr().err


@pytest.mark.unit
def test_plot_without_the_extra_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    code, out, err = _bench(capsys, "--url", "http://127.0.0.1:9", "--plot", "x.png")
    assert code == 2
    assert out == ""
    assert err == f"genmesh bench: error: {MISSING_EXTRA}\n"
    assert "pip install 'genmesh[bench]'" in MISSING_EXTRA


@pytest.mark.process
def test_the_command_prints_its_table_on_stdout_and_progress_on_stderr(
    mesh: InProcessMesh, tmp_path: Path
) -> None:
    """`genmesh bench` as a user runs it: the table on stdout, the progress bar on stderr
    (without a terminal, rich draws only its final state)."""
    done = subprocess.run(
        [
            *(sys.executable, "-m", "genmesh", "bench", "--url", mesh.http_url, "--stream"),
            *("-n", "20", "--vocab-size", VOCAB),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    stdout = " ".join(done.stdout.split())
    assert "TTFT (ms)" in stdout
    assert "20/20 ok" in stdout
    assert "TTFT" not in done.stderr
    assert "bench" in done.stderr
    assert "20/20" in done.stderr
    assert "errors 0" in done.stderr


def _frontend_answers(mesh: InProcessMesh, status: str) -> float:
    """Generate requests the frontend finished with `status` (its /metrics)."""
    with urllib.request.urlopen(mesh.http_url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("genmesh_frontend_requests_total{") and f'status="{status}"' in line
    )


@pytest.mark.process
@pytest.mark.parametrize(
    ("stop", "loop"),
    [
        (signal.SIGINT, ("-c", "4")),
        (signal.SIGTERM, ("--request-rate", "50", "--max-concurrency", "4")),
    ],
)
def test_a_stopped_run_reports_what_completed_and_exits_130(
    empty_mesh: InProcessMesh, tmp_path: Path, stop: signal.Signals, loop: tuple[str, ...]
) -> None:
    """Ctrl-C (or SIGTERM) in the middle of a run against a slow mock: the requests in
    flight are cancelled (the worker sees them go) and counted as cut off, not as errors;
    the table, the JSON file and the plot hold the requests that completed."""
    empty_mesh.add_router()
    empty_mesh.add_frontend()
    # The timing model in real time, with the shared mesh's vocabulary (tests/conftest.py).
    worker = empty_mesh.add_worker(speedup=1.0, **SHARED_WORKERS)
    out_json, out_png = tmp_path / "run.json", tmp_path / "run.png"
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "genmesh", "bench", "--url", empty_mesh.http_url),
            *("--stream", "-n", "1000", *loop, "--output-len", "64", "--vocab-size", "1000"),
            *("--json-out", str(out_json), "--plot", str(out_png)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: _frontend_answers(empty_mesh, "200") >= 3, timeout=60)
        proc.send_signal(stop)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    summary = _read(out_json)["summary"]
    assert summary["stopped"] is True
    assert summary["completed"] >= 3
    assert summary["errors"] == {}
    assert summary["requests"] == summary["completed"]  # the cut off are not records
    if "-c" in loop:
        assert summary["cut_off"] == 4  # a closed loop always has its 4 clients in flight
    else:
        assert summary["cut_off"] >= 1  # in flight, or arrived and waiting for a slot
    assert summary["output_tokens"] == summary["completed"] * 64
    table = " ".join(out.split())
    assert "TTFT (ms)" in table
    assert f"{summary['completed']}/{summary['completed']} ok" in table
    assert f"stopped by a signal: {summary['cut_off']} in flight cut off (not counted)" in table
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Cancelled, not abandoned: the frontend sees each client go (499; in an open loop,
    # arrivals still waiting for a slot never reached it), and the worker stops them.
    wait_until(lambda: card(empty_mesh, worker.name)["inflight"] == 0, timeout=20)
    gone = _frontend_answers(empty_mesh, "499")
    if "-c" in loop:
        assert gone == 4
    else:
        assert 1 <= gone <= min(4, summary["cut_off"])


@pytest.mark.unit
async def test_a_stop_in_the_warm_up_measures_nothing() -> None:
    """Stopped before the measured phase began: an empty, stopped phase (warm-up requests
    are never the measured phase's, not even as cut off)."""
    app = sglang_app(MockServerConfig(token_delay_ms=20.0))
    async with serving(app) as url:
        config = parse(BenchConfig, ["--url", url, "--stream", "--warmup", "50", "-c", "2"])
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.5, stop.set)
        _, phase, summary = await bench(config, stop)
    assert (phase.records, phase.stopped, phase.cut_off) == ([], True, 0)
    assert (summary.requests, summary.stopped, summary.cut_off) == (0, True, 0)


@pytest.mark.unit
@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
def test_a_second_stop_signal_interrupts_at_once(event_loop: str) -> None:
    """The first signal sets the stop; the second, while that stop is still under way,
    raises KeyboardInterrupt out of the loop (either loop: the bench runs on uvloop), whose
    tasks are cancelled; then Ctrl-C is Python's again."""
    events: list[str] = []

    async def stopping_slowly() -> None:
        async with stop_signals(insist=True) as stop:
            os.kill(os.getpid(), signal.SIGINT)
            await stop.wait()
            events.append("stopping")
            os.kill(os.getpid(), signal.SIGINT)
            try:
                await asyncio.sleep(30)  # a clean stop that takes long
            finally:
                events.append("cancelled")

    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run(stopping_slowly(), event_loop)
    assert events == ["stopping", "cancelled"]
    assert time.monotonic() - started < 10
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

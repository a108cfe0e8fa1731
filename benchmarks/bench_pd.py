"""Prefill/decode disaggregation against aggregated serving: genmesh and NVIDIA Dynamo
1.6.1 (its mocker) side by side, one after another in one run, on the same workload.

    .venv/bin/python benchmarks/bench_pd.py [--systems genmesh-agg,genmesh-pd,dynamo-agg,dynamo-pd]
        [--prompt-tokens 256,1024,4096] [--concurrency 1,8] [--output-tokens 32]
        [--requests 64] [--warmup 8] [--out results.jsonl]

The systems, each started on its own, measured, and stopped before the next (two mock
engines each, both timed by the same polynomials in real time, `--speedup 1`):

  genmesh-agg   genmesh up --workers 2 --routers 0 --mock-speedup 1
  genmesh-pd    genmesh up --prefill-workers 1 --decode-workers 1 --routers 0 --mock-speedup 1
                (skipped, saying so, while `genmesh up` has no --prefill-workers or the
                mock cannot pair)
  dynamo-agg    dynamo.frontend + 2 x dynamo.mocker
  dynamo-pd     dynamo.frontend + dynamo.mocker --disaggregation-mode prefill
                                + dynamo.mocker --disaggregation-mode decode
  dynamo-pd-bootstrap   as dynamo-pd, the prefill mocker with --bootstrap-ports: SGLang's
                rendezvous, prefill and decode sent at once (not in the default set)

The P/D mocks of both move the KV alike: --kv-bytes-per-token per prompt token at
--transfer-gbps (genmesh's --mock-kv-bytes-per-token and --mock-transfer-gbps, the
mocker's --kv-bytes-per-token and --kv-transfer-bandwidth).

Dynamo runs from the peers' install (`--peers`, default /tmp/peers: `bash
../shared/peers/setup.sh` makes it) as `../shared/peers/kv_anchor.sh` runs it: file
discovery (no etcd), TCP request plane, NATS event plane, SGLang's native `/generate`.
Every system gets its own nats-server (the same binary), started and stopped here.

For each concurrency C and prompt length P, the shared load generator
(`../shared/peers/kv_workload.py`: raw HTTP/1.1 with TCP_QUICKACK, so no Nagle stall ends
up in TTFT) sends WARMUP then REQUESTS streamed `/generate` requests in a closed loop of C:
prompts of P random token ids, unique per request (its seed differs per run and a
warm-up's prompts are its own, so no prefix cache hides a prefill; every system gets the
same prompts), `max_new_tokens` T with `ignore_eos`. Figures are over the measured
requests: req/s, TTFT p50/p90 and end-to-end latency p50 (ms), and the CPU ms per request
of every mesh process (psutil user+sys over the measured phase): genmesh's frontend,
workers and nats-server; Dynamo's frontend, mockers and nats-server. (`genmesh up`
itself, a supervisor that waits on its children, about 0.1 ms per request, is not
billed.) `halves` is what the
engines' own metrics counted over the run, warm-up included: prefill/decode requests
(decode: those of an aggregated system's engines too), the proof that every P/D request
went through both halves (Dynamo: each mocker's `dynamo_component_requests_total` of its
`generate` endpoint; genmesh: the prefill workers' `genmesh_pd_stages_total` and the
other workers' `genmesh_worker_requests_total`, completed ones). A run whose halves do not
add up is flagged on stderr. `pd/agg` rows divide each P/D figure by its aggregated one.

Prints one table (progress on stderr); `--out FILE` also writes one JSON line per system
and run (a skipped system: one line saying why), each with kv_workload's whole result.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench_generate import loadavg, run_benchmark, say
from genmesh.engines.base import disaggregating
from genmesh.engines.mock import MockEngine
from genmesh.shared.settings import parse
from genmesh.supervisor import Supervisor, clean_environment, free_port, wait_http_ok
from genmesh.up.config import UpConfig

HERE = Path(__file__).resolve().parent
WORKLOAD = HERE.parent.parent / "shared" / "peers" / "kv_workload.py"
READY_TIMEOUT_S = 120.0
# The engines count a request once its stream has ended, which the client may see first.
COUNTERS_SETTLE_S = 0.5
GENMESH_WORKERS = 2  # aggregated: 2; P/D: 1 prefill + 1 decode
DYNAMO_MODEL = "tiny"  # the peers' weight-less model dir, served under this name
SYSTEMS = ("genmesh-agg", "genmesh-pd", "dynamo-agg", "dynamo-pd", "dynamo-pd-bootstrap")
DEFAULT_SYSTEMS = "genmesh-agg,genmesh-pd,dynamo-agg,dynamo-pd"


@dataclass
class Target:
    """A running system, as the load generator needs it."""

    system: str
    url: str
    model: str  # the body's "model" ("" = none: genmesh serves one model and wants none)
    cpu: dict[str, list[int]]  # process group -> pids, billed over the measured phase
    metrics: list[str] = field(default_factory=list)  # the engines' Prometheus endpoints


class Skipped(Exception):
    """A system that cannot run here; the message says why."""


# ----------------------------------------------------------------- pure helpers


def run_plan(
    prompt_tokens: Iterable[int], concurrency: Iterable[int], seed: int
) -> list[tuple[int, int, int]]:
    """(prompt tokens, concurrency, workload seed) per run. Each run of a system gets a
    seed of its own (kv_workload derives every prompt from it, and a longer prompt with
    the same seed would start with a shorter one's tokens), the same for every system."""
    return [
        (p, c, seed + i)
        for i, (c, p) in enumerate((c, p) for c in concurrency for p in prompt_tokens)
    ]


def genmesh_role(cmdline: list[str]) -> str | None:
    """The service a `python -m genmesh <command>` process runs, from its command line."""
    for i, arg in enumerate(cmdline[:-2]):
        if arg == "-m" and cmdline[i + 1] == "genmesh":
            return cmdline[i + 2]
    return None


def served_halves(text: str) -> dict[str, int]:
    """Requests the prefill and the decode (or aggregated) half have served so far, by an
    engine's Prometheus text. Dynamo's mocker counts the requests of its `generate`
    endpoint, component "prefill" for a prefill mocker, "backend" otherwise. A genmesh
    worker counts its completed requests, a prefill worker its prefill stages too (which
    its requests include)."""
    halves = {"prefill": 0, "decode": 0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels, value = sample.labels, round(sample.value)
            if sample.name == "dynamo_component_requests_total":
                if labels.get("dynamo_endpoint") == "generate":
                    half = "prefill" if labels.get("dynamo_component") == "prefill" else "decode"
                    halves[half] += value
            elif labels.get("outcome") == "completed":
                if sample.name == "genmesh_pd_stages_total":
                    halves["prefill"] += value
                    halves["decode"] -= value
                elif sample.name == "genmesh_worker_requests_total":
                    halves["decode"] += value
    return halves


def make_row(
    system: str, prompt: int, conc: int, result: dict[str, Any], halves: dict[str, int] | None
) -> dict[str, Any]:
    """One table row (and JSON line) from kv_workload's result, with CPU per group and in
    total, and the requests each half served over the run (None: not counted)."""
    cpu = {
        key[len("cpu_") : -len("_ms_per_req")]: value
        for key, value in result.items()
        if key.startswith("cpu_") and key.endswith("_ms_per_req")
    }
    return {
        "system": system,
        "prompt_tokens": prompt,
        "concurrency": conc,
        "output_tokens": result["maxtok"],
        "requests": result["n"],
        "warmup": result["warmup"],
        "ok": result["ok"],
        "errors": result["errors"],
        "rps": result["rps"],
        "ttft_ms": result["ttft_ms"],
        "e2e_ms": result["e2e_ms"],
        "cpu_ms_per_req": {"total": round(sum(cpu.values()), 3), **cpu},
        "halves": halves,
        "workload": result,
    }


def pd_check(row: dict[str, Any]) -> str | None:
    """Why a run's requests did not go the way its system routes them, or None: a P/D
    system's each through both halves, an aggregated one's none through a prefill."""
    halves = row["halves"]
    if halves is None:
        return None
    sent = row["requests"] + row["warmup"]
    prefill = sent if "-pd" in row["system"] else 0
    if (halves["prefill"], halves["decode"]) == (prefill, sent):
        return None
    return (
        f"{row['system']} p{row['prompt_tokens']} c{row['concurrency']}: {sent} requests "
        f"sent, {halves['prefill']} prefill and {halves['decode']} decode served "
        f"(expected {prefill} and {sent})"
    )


def _ratio(pd: float | None, agg: float | None) -> float | None:
    if pd is None or agg is None or agg == 0 or math.isnan(pd) or math.isnan(agg):
        return None
    return pd / agg


def pd_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each family (genmesh, dynamo) and run: its P/D row's figures over its
    aggregated row's (dynamo-pd-bootstrap is compared with dynamo-agg too)."""
    by_key = {(r["system"], r["prompt_tokens"], r["concurrency"]): r for r in rows}
    out = []
    for r in rows:
        family, _, mode = r["system"].partition("-")
        agg = by_key.get((f"{family}-agg", r["prompt_tokens"], r["concurrency"]))
        if not mode.startswith("pd") or agg is None:
            continue
        out.append(
            {
                "system": f"{r['system']}/agg",
                "prompt_tokens": r["prompt_tokens"],
                "concurrency": r["concurrency"],
                "rps": _ratio(r["rps"], agg["rps"]),
                "ttft_p50": _ratio(r["ttft_ms"]["p50"], agg["ttft_ms"]["p50"]),
                "ttft_p90": _ratio(r["ttft_ms"]["p90"], agg["ttft_ms"]["p90"]),
                "e2e_p50": _ratio(r["e2e_ms"]["p50"], agg["e2e_ms"]["p50"]),
                "cpu": _ratio(r["cpu_ms_per_req"]["total"], agg["cpu_ms_per_req"]["total"]),
            }
        )
    return out


def _num(value: float | None, width: int, digits: int = 1) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def _times(value: float | None, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{f'{value:.2f}x':>{width}}"


def render(rows: list[dict[str, Any]]) -> str:
    """The table: per prompt length and concurrency, each system's row, then its family's
    pd/agg ratios. CPU columns: fe = frontend, eng = workers (genmesh) or mockers."""
    ratios = {(r["system"], r["prompt_tokens"], r["concurrency"]): r for r in pd_ratios(rows)}
    lines = [
        f"{'prompt':>6} {'c':>3}  {'system':<24} {'req/s':>6} {'TTFT p50':>8} {'p90':>7} "
        f"{'e2e p50':>7} {'cpu/req':>7} {'fe':>6} {'eng':>6} {'nats':>5} {'halves':>9} "
        f"{'err':>4}"
    ]
    runs = dict.fromkeys((r["prompt_tokens"], r["concurrency"]) for r in rows)
    for prompt, conc in runs:
        lead = f"{prompt:>6} {conc:>3}"
        for r in (r for r in rows if (r["prompt_tokens"], r["concurrency"]) == (prompt, conc)):
            cpu = r["cpu_ms_per_req"]
            halves = r["halves"]
            served = "-" if halves is None else f"{halves['prefill']}/{halves['decode']}"
            lines.append(
                f"{lead}  {r['system']:<24} {r['rps']:>6.1f} {r['ttft_ms']['p50']:>8.1f} "
                f"{r['ttft_ms']['p90']:>7.1f} {r['e2e_ms']['p50']:>7.1f} "
                f"{cpu['total']:>7.2f} {_num(cpu.get('frontend'), 6, 2)} "
                f"{_num(cpu.get('engines'), 6, 2)} {_num(cpu.get('nats'), 5, 2)} "
                f"{served:>9} {r['errors']:>4}"
            )
            lead = " " * len(lead)
            q = ratios.get((f"{r['system']}/agg", prompt, conc))
            if q is not None:
                lines.append(
                    f"{lead}  {q['system']:<24} {_times(q['rps'], 6)} "
                    f"{_times(q['ttft_p50'], 8)} {_times(q['ttft_p90'], 7)} "
                    f"{_times(q['e2e_p50'], 7)} {_times(q['cpu'], 7)}"
                )
    return "\n".join(lines)


# ----------------------------------------------------------------- the systems


def genmesh_pd_pending() -> str | None:
    """Why genmesh cannot run a P/D mesh of mock workers yet, or None."""
    help_text = subprocess.run(
        [sys.executable, "-m", "genmesh", "up", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    if "--prefill-workers" not in help_text:
        return "`genmesh up --help` has no --prefill-workers yet (issue 14, item 1)"
    # What a worker of role prefill or decode checks before it starts.
    if disaggregating(MockEngine()) is None:
        return "the mock engine cannot take part in P/D yet (issue 14, item 5)"
    return None


def start_genmesh(args: argparse.Namespace, system: str, procs: Supervisor) -> Target:
    shape = ["--workers", "2"]
    if system == "genmesh-pd":
        pending = genmesh_pd_pending()
        if pending:
            raise Skipped(f"{pending}: the genmesh P/D row is pending")
        shape = [
            "--prefill-workers", "1", "--decode-workers", "1",
            "--mock-kv-bytes-per-token", str(args.kv_bytes_per_token),
            "--mock-transfer-gbps", f"{args.transfer_gbps:g}",
        ]  # fmt: skip
    port = free_port()
    # `up` gives its workers (no routers) one metrics port each, counting up from this.
    metrics_port = free_ports(GENMESH_WORKERS)[0]
    nats_url = procs.start_nats()
    up = parse(
        UpConfig,
        [
            *shape, "--routers", "0", "--mock-speedup", f"{args.speedup:g}",
            "--port", str(port), "--nats-url", nats_url, "--metrics-port", str(metrics_port),
            *shlex.split(args.up_args),
        ],
        environ={},
    )  # fmt: skip
    child = procs.spawn_genmesh("up", up)
    url = f"http://127.0.0.1:{port}"
    asyncio.run(wait_http_ok(url + "/health", timeout_s=READY_TIMEOUT_S, watch=[child]))
    asyncio.run(first_generate(url, "", procs.check_alive))
    assert procs.nats is not None
    assert procs.nats.pid is not None
    groups: dict[str, list[int]] = {"frontend": [], "engines": [], "nats": [procs.nats.pid]}
    for proc in psutil.Process(child.pid).children():
        role = genmesh_role(proc.cmdline())
        groups["frontend" if role == "frontend" else "engines"].append(proc.pid)
    metrics = [f"http://127.0.0.1:{metrics_port + i}/metrics" for i in range(GENMESH_WORKERS)]
    return Target(system, url, "", groups, metrics)


def dynamo_env(peers_run: Path, nats_url: str) -> dict[str, str]:
    """The runtime's environment as ../shared/peers/kv_anchor.sh (`dyn_env`) sets it: file
    discovery (no etcd), TCP request plane, NATS event plane, every listener on
    127.0.0.1, and the frontend's SGLang-native /generate route (experimental in 1.6.1)."""
    host = "127.0.0.1"
    return {
        "NATS_SERVER": nats_url,
        "DYN_DISCOVERY_BACKEND": "file",
        "DYN_FILE_KV": str(peers_run / "dyn_kv"),
        "DYN_REQUEST_PLANE": "tcp",
        "DYN_EVENT_PLANE": "nats",
        "DYN_TCP_RPC_HOST": host,
        "DYN_TCP_RESPONSE_STREAM_HOST": host,
        "DYN_EVENT_PLANE_HOST": host,
        "DYN_SYSTEM_HOST": host,
        "DYN_HTTP_RPC_HOST": host,
        "DYN_SELF_HOST_METADATA": "0",
        "DYN_LOG": "warn",
        "DYN_SGLANG_ENABLE_GENERATE": "1",
    }


def dynamo_commands(
    python: str,
    model: Path,
    system: str,
    args: argparse.Namespace,
    http_port: int,
    bootstrap_port: int,
) -> tuple[list[list[str]], list[str]]:
    """The mockers' command lines and the frontend's, for a Dynamo system. P/D follows
    Dynamo's own mocker example (examples/backends/mocker/deploy/disagg.yaml: one mocker
    per half, `--disaggregation-mode prefill|decode`); the frontend sees a prefill worker
    register and activates its PrefillRouter (prefill first, then decode with the
    prefill's KV handle), or, with a bootstrap port on the prefill mocker, sends both at
    once and lets them meet there (SGLang's rendezvous). A P/D mocker times the KV's
    transfer as genmesh's mock does (bytes per prompt token over a bandwidth in GB/s);
    left alone it would take this tiny model's 256 bytes per token."""
    mocker = [
        python, "-m", "dynamo.mocker", "--model-path", str(model),
        "--model-name", DYNAMO_MODEL, "--speedup-ratio", f"{args.speedup:g}",
        "--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "nats",
        "--sglang-generate",
    ]  # fmt: skip
    if system == "dynamo-agg":
        mockers = [mocker, mocker]
    else:
        mocker += [
            "--kv-bytes-per-token", str(args.kv_bytes_per_token),
            "--kv-transfer-bandwidth", f"{args.transfer_gbps:g}",
        ]  # fmt: skip
        prefill = [*mocker, "--disaggregation-mode", "prefill"]
        if system == "dynamo-pd-bootstrap":
            prefill += ["--bootstrap-ports", str(bootstrap_port)]
        mockers = [prefill, [*mocker, "--disaggregation-mode", "decode"]]
    frontend = [
        python, "-m", "dynamo.frontend", "--http-host", "127.0.0.1",
        "--http-port", str(http_port), "--discovery-backend", "file", "--request-plane", "tcp",
        "--event-plane", "nats", "--router-mode", "round-robin",
        "--router-min-initial-workers", "2" if system == "dynamo-agg" else "1",
    ]  # fmt: skip
    return mockers, frontend


def start_dynamo(args: argparse.Namespace, system: str, procs: Supervisor, workdir: Path) -> Target:
    python = args.peers / "venv" / "bin" / "python"
    model = args.peers / "tiny-model"
    if not (python.exists() and model.is_dir()):
        raise Skipped(f"no Dynamo in {args.peers}: run `bash ../shared/peers/setup.sh`")
    nats_url = procs.start_nats()
    env = dynamo_env(workdir, nats_url)
    port = free_port()
    mockers, frontend = dynamo_commands(str(python), model, system, args, port, free_port())
    metrics_ports = free_ports(len(mockers))
    engines = []
    for i, argv in enumerate(mockers):
        system_env = {"DYN_SYSTEM_ENABLED": "true", "DYN_SYSTEM_PORT": str(metrics_ports[i])}
        engines.append(procs.spawn("worker", f"mocker{i + 1}", argv, env=env | system_env))
    fe = procs.spawn("frontend", "frontend", frontend, env=env)
    url = f"http://127.0.0.1:{port}"
    asyncio.run(wait_http_ok(url + "/health", timeout_s=READY_TIMEOUT_S, watch=[fe, *engines]))
    asyncio.run(first_generate(url, DYNAMO_MODEL, procs.check_alive))
    if system != "dynamo-agg":
        # The frontend routes without P/D until it has seen the prefill mocker register.
        prefill_metrics = f"http://127.0.0.1:{metrics_ports[0]}/metrics"
        asyncio.run(wait_prefill_serving(url, prefill_metrics, procs.check_alive))
    assert procs.nats is not None
    assert procs.nats.pid is not None
    groups = {
        "frontend": [fe.pid],
        "engines": [e.pid for e in engines],
        "nats": [procs.nats.pid],
    }
    metrics = [f"http://127.0.0.1:{p}/metrics" for p in metrics_ports]
    return Target(system, url, DYNAMO_MODEL, groups, metrics)


def free_ports(count: int) -> list[int]:
    """`count` consecutive ports on 127.0.0.1, free a moment ago, below 32768: `up` numbers
    its workers' metrics ports from one, and Dynamo 1.6.1 reads DYN_SYSTEM_PORT as an i16
    (it refuses to start on a kernel-chosen ephemeral port, 32768 and up)."""
    for base in random.sample(range(20000, 32768 - count), 200):
        with contextlib.ExitStack() as held:
            try:
                for port in range(base, base + count):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
            return list(range(base, base + count))
    raise RuntimeError(f"no {count} free consecutive ports below 32768")


async def first_generate(url: str, model: str, check_alive: Callable[[], None]) -> None:
    """One streamed request through, so the system serves before the clock runs (Dynamo
    answers /health before it has found a worker); `check_alive` raises if a process of
    the system died meanwhile."""
    body: dict[str, Any] = {
        "input_ids": [7, 8, 9],
        "sampling_params": {"max_new_tokens": 2},
        "stream": True,
    }
    if model:
        body["model"] = model
    deadline = time.monotonic() + READY_TIMEOUT_S
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            async with session.post(url + "/generate", json=body) as reply:
                text = await reply.text()
                if reply.status == 200 and "[DONE]" in text:
                    return
            check_alive()
            await asyncio.sleep(0.25)
    raise RuntimeError(f"{url} answers no /generate")


async def wait_prefill_serving(
    url: str, prefill_metrics: str, check_alive: Callable[[], None]
) -> None:
    """Send requests until the prefill mocker has served one."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        await first_generate(url, DYNAMO_MODEL, check_alive)
        if (await scrape_halves([prefill_metrics]))["prefill"]:
            return
        await asyncio.sleep(0.25)
    raise RuntimeError("the Dynamo prefill mocker served no request")


async def scrape_halves(urls: list[str]) -> dict[str, int]:
    """`served_halves` summed over the engines' metrics endpoints."""
    total = {"prefill": 0, "decode": 0}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for url in urls:
            async with session.get(url) as reply:
                reply.raise_for_status()
                for half, served in served_halves(await reply.text()).items():
                    total[half] += served
    return total


# ----------------------------------------------------------------- running


def measure(
    args: argparse.Namespace, target: Target, prompt: int, conc: int, seed: int, out: Path
) -> tuple[dict[str, Any], dict[str, int]]:
    """One kv_workload.py run against `target`: its result (the last line it appends),
    and the requests each half served meanwhile."""
    command = [
        sys.executable, str(args.workload), "--url", target.url, "--model", target.model,
        "--groups", "1", "--prefix-len", "0", "--suffix-len", str(prompt),
        "--maxtok", str(args.output_tokens), "-c", str(conc), "-n", str(args.requests),
        "--warmup", str(args.warmup), "--seed", str(seed), "--settle", "0.5",
        "--label", f"{target.system} p{prompt} c{conc}", "--json-out", str(out),
    ]  # fmt: skip
    for group, pids in target.cpu.items():
        command += ["--cpu", f"{group}={','.join(map(str, pids))}"]
    say(f"{target.system}: prompt {prompt}, c={conc}")
    before = asyncio.run(scrape_halves(target.metrics))
    subprocess.run(command, stdout=subprocess.DEVNULL, check=False)
    time.sleep(COUNTERS_SETTLE_S)
    after = asyncio.run(scrape_halves(target.metrics))
    result: dict[str, Any] = json.loads(out.read_text().splitlines()[-1])
    return result, {half: after[half] - before[half] for half in after}


def run_system(
    args: argparse.Namespace,
    system: str,
    workdir: Path,
    live: list[Supervisor],
    emit: Callable[[dict[str, Any]], None],
) -> list[dict[str, Any]]:
    logdir = workdir / system
    logdir.mkdir()
    env = clean_environment(prefixes=("GENMESH_", "OTEL_", "DYN_", "NATS_"))
    procs = Supervisor(logdir=logdir, env=env, report=say)
    live.append(procs)
    rows = []
    try:
        if system.startswith("genmesh"):
            target = start_genmesh(args, system, procs)
        else:
            target = start_dynamo(args, system, procs, logdir)
        for prompt, conc, seed in run_plan(args.prompt_tokens, args.concurrency, args.seed):
            result, halves = measure(args, target, prompt, conc, seed, logdir / "results.jsonl")
            procs.check_alive()
            row = make_row(system, prompt, conc, result, halves)
            problem = pd_check(row)
            if problem:
                say(f"WARNING {problem}")
            rows.append(row)
            emit(row)
    except Skipped as skip:
        say(f"{system} skipped: {skip}")
        emit({"system": system, "skipped": str(skip)})
    finally:
        procs.stop()
        live.remove(procs)
    return rows


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument(
        "--systems",
        default=DEFAULT_SYSTEMS,
        help=f"comma-separated, in order, of: {', '.join(SYSTEMS)} (default: {DEFAULT_SYSTEMS})",
    )
    p.add_argument(
        "--prompt-tokens",
        type=int_list,
        default=[256, 1024, 4096],
        help="prompt lengths, comma-separated: a run each (default: 256,1024,4096)",
    )
    p.add_argument(
        "--concurrency",
        type=int_list,
        default=[1, 8],
        help="closed-loop clients, comma-separated: a run each (default: 1,8)",
    )
    p.add_argument(
        "--output-tokens",
        type=int,
        default=32,
        help="max_new_tokens, with ignore_eos (default: 32)",
    )
    p.add_argument(
        "--requests", type=int, default=64, help="measured requests per run (default: 64)"
    )
    p.add_argument("--warmup", type=int, default=8, help="warm-up requests per run (default: 8)")
    p.add_argument("--seed", type=int, default=1, help="first run's workload seed")
    p.add_argument(
        "--speedup", type=float, default=1.0,
        help="genmesh's --mock-speedup and the mocker's --speedup-ratio (1 = real time)",
    )  # fmt: skip
    p.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=131072,
        help="P/D: the KV a prefill hands over per prompt token, for genmesh's mock and "
        "Dynamo's mocker alike (default: the mock's, a Llama-3-8B fp16 token)",
    )
    p.add_argument(
        "--transfer-gbps",
        type=float,
        default=50.0,
        help="P/D: KV transfer bandwidth in GB/s, both systems (default: the mock's, 50)",
    )
    p.add_argument("--up-args", default="", help="more `genmesh up` options (both genmesh rows)")
    p.add_argument(
        "--peers",
        type=Path,
        default=Path(os.environ.get("PEERS", "/tmp/peers")),
        help="Dynamo's install: venv/ and tiny-model/ (default: $PEERS or /tmp/peers)",
    )
    p.add_argument("--workload", type=Path, default=WORKLOAD, help="path to kv_workload.py")
    p.add_argument("--out", help="also write one JSON line per system and run here")
    p.add_argument(
        "--keep-logs",
        action="store_true",
        help="keep every process's log (always kept when the benchmark fails)",
    )
    args = p.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown systems: {', '.join(sorted(unknown))} (known: {', '.join(SYSTEMS)})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="genmesh-bench-pd-"))
    live: list[Supervisor] = []
    out = Path(args.out) if args.out else None
    if out is not None:
        out.write_text("")

    def emit(line: dict[str, Any]) -> None:
        if out is not None:
            with out.open("a") as f:
                f.write(json.dumps(line) + "\n")

    def body() -> dict[str, Any]:
        started = time.monotonic()
        start_load = loadavg()
        rows = [row for s in args.systems for row in run_system(args, s, workdir, live, emit)]
        print()
        print(
            f"P/D vs aggregated: {', '.join(args.systems)}; 2 mock engines each at speed-up "
            f"{args.speedup:g}; {args.requests} requests per run after {args.warmup} warm-up, "
            f"{args.output_tokens} output tokens, unique prompts; loadavg "
            f"{' '.join(start_load)} -> {' '.join(loadavg())}"
        )
        print(
            "ms; cpu/req = CPU ms per request of all mesh processes: fe = frontend, eng = "
            "workers or mockers, nats; halves = requests the prefill/decode halves served; "
            "pd/agg = P/D over aggregated"
        )
        print()
        print(render(rows), flush=True)
        print(f"\n(took {time.monotonic() - started:.0f} s)")
        return {"rows": rows}

    def stop() -> None:
        for procs in live:
            procs.stop()

    return run_benchmark(body, stop, workdir, args.keep_logs, None)


if __name__ == "__main__":
    sys.exit(main())

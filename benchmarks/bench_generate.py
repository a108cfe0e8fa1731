"""Benchmark SGLang /generate (or vLLM's /inference/v1/generate) through the genmesh mesh
against a direct-engine baseline.

    .venv/bin/python benchmarks/bench_generate.py [--requests N] [--concurrency 1,32]
        [--output-tokens 16] [--prompt-tokens 32] [--workers 1] [--repeats R] [--json FILE]
        [--format sglang|vllm]

Starts a nats-server and a mesh (1 router, `--workers` instant mock workers, 1 frontend),
each its own OS process, and the direct-engine baseline (`benchmarks/direct_engine.py`: the same
MockEngine, format and rendering in one aiohttp process, no NATS). For every mode (sse,
unary) and concurrency it warms both up, then runs a closed-loop load against mesh and
baseline alternately, `--repeats` times, and reports the median of the repeats: req/s,
latency and time-to-first-byte percentiles, errors, and server CPU per request (from
/proc/<pid>/stat) and per output token, by process (the workers summed), plus the ratio
mesh/baseline. A separate scenario measures how long a
cancel takes to stop a generation on a (slow) worker. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import nats

from genmesh.client import request as mesh_request
from genmesh.codecs import CodecError, get_codec
from genmesh.engines.mock import MockConfig
from genmesh.services.frontend.config import FrontendConfig
from genmesh.services.router.config import RouterConfig
from genmesh.services.worker.config import WorkerConfig, WorkerProcessConfig
from genmesh.shared.connection import MeshConnection
from genmesh.shared.ids import new_worker_id
from genmesh.shared.subjects import Subjects
from genmesh.supervisor import (
    ChildExited,
    Supervisor,
    clean_environment,
    free_port,
    wait_discovered,
    wait_http_ok,
)

HERE = Path(__file__).resolve().parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
READY_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 60.0
MESH_PROCS = ("frontend", "router", "worker")  # and nats
NAMESPACE = "bench"


# --------------------------------------------------------------------------- processes


def mesh_connection(nats_url: str) -> MeshConnection:
    return MeshConnection(nats_url, NAMESPACE, log_level="warning")


def instant_worker(nats_url: str, **service: Any) -> WorkerProcessConfig:
    """A mock worker; at speed-up 0 unless `mock` says otherwise."""
    mock = service.pop("mock", MockConfig(speedup=0.0))
    return WorkerProcessConfig(
        mesh=mesh_connection(nats_url), service=WorkerConfig(**service), mock=mock
    )


def start_mesh(
    procs: Supervisor, nats_url: str, http_port: int, *workers: Any, fmt: str = "sglang"
) -> None:
    """1 router, the workers given (an instant mock if none; named worker-1, ...), a
    frontend on `http_port` serving `fmt`."""
    mesh = mesh_connection(nats_url)
    procs.spawn_genmesh("router", RouterConfig(mesh=mesh))
    for index, worker in enumerate(workers or (instant_worker(nats_url),), 1):
        procs.spawn_genmesh(f"worker-{index}", worker)
    frontend = FrontendConfig(mesh=mesh, host="127.0.0.1", port=http_port, generate_format=fmt)
    procs.spawn_genmesh("frontend", frontend)


def cpu_ticks(pid: int) -> int:
    """utime + stime of `pid`, in clock ticks (fields 14 and 15 of /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    fields = data[data.rindex(b")") + 2 :].split()
    return int(fields[11]) + int(fields[12])


def cpu_snapshot(pids: dict[str, list[int]]) -> dict[str, int]:
    """CPU ticks by process group (several workers count as one "worker")."""
    return {name: sum(cpu_ticks(pid) for pid in group) for name, group in pids.items()}


# --------------------------------------------------------------------------- load


@dataclass
class Target:
    name: str  # "mesh" or "direct"
    url: str
    pids: dict[str, list[int]]  # the server processes whose CPU counts, by group
    session: aiohttp.ClientSession | None = None
    fmt: str = "sglang"  # the format it serves (PATHS)


@dataclass
class RunResult:
    target: str
    mode: str
    concurrency: int
    requests: int
    wall_s: float
    latencies_ms: list[float]
    ttfbs_ms: list[float]
    errors: int
    error_kinds: Counter[str]
    cpu_ms: dict[str, float]
    client_cpu_ms: float
    output_tokens: int

    def summary(self) -> dict[str, Any]:
        ok = len(self.latencies_ms)
        out: dict[str, Any] = {
            "requests": self.requests,
            "ok": ok,
            "errors": self.errors,
            "wall_s": round(self.wall_s, 4),
            "req_s": self.requests / self.wall_s if self.wall_s > 0 else 0.0,
            "cpu_ms_per_req": sum(self.cpu_ms.values()) / self.requests,
            "cpu_ms_per_req_by_proc": {k: v / self.requests for k, v in self.cpu_ms.items()},
            "client_cpu_ms_per_req": self.client_cpu_ms / self.requests,
        }
        # What a streamed token costs, for long outputs (issue 12: µs per token by process).
        tokens = self.requests * self.output_tokens
        out["cpu_us_per_token"] = sum(self.cpu_ms.values()) * 1000.0 / tokens
        out["cpu_us_per_token_by_proc"] = {k: v * 1000.0 / tokens for k, v in self.cpu_ms.items()}
        for label, values in (("lat", self.latencies_ms), ("ttfb", self.ttfbs_ms)):
            for q in (50, 90, 99):
                out[f"{label}_p{q}_ms"] = percentile(values, q)
        if self.error_kinds:
            out["error_kinds"] = dict(self.error_kinds.most_common(5))
        return out


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


# The formats the benchmark speaks (`--format`), by the path each serves.
PATHS = {"sglang": "/generate", "vllm": "/inference/v1/generate"}


def request_body(
    prompt_tokens: int, output_tokens: int, stream: bool, fmt: str = "sglang"
) -> bytes:
    prompt = [(7 * i + 1) % 50_000 for i in range(prompt_tokens)]
    body: dict[str, Any] = (
        {"token_ids": prompt, "sampling_params": {"max_tokens": output_tokens}}
        if fmt == "vllm"
        else {"input_ids": prompt, "sampling_params": {"max_new_tokens": output_tokens}}
    )
    body["sampling_params"]["ignore_eos"] = True
    body["stream"] = stream
    return json.dumps(body, separators=(",", ":")).encode()


def output_of(data: dict[str, Any], fmt: str) -> tuple[int, bool]:
    """The output ids in a unary body or SSE chunk, and whether it carries the finish."""
    if fmt == "vllm":  # vLLM's last chunk may carry only the usage, with no choices
        choices = data["choices"]
        return sum(len(c["token_ids"]) for c in choices), any(
            c["finish_reason"] is not None for c in choices
        )
    return len(data["output_ids"]), data["meta_info"]["finish_reason"] is not None


class Incomplete(Exception):
    pass


JSON_HEADERS = {"Content-Type": "application/json"}


async def one_request(
    session: aiohttp.ClientSession,
    url: str,
    payload: bytes,
    stream: bool,
    tokens: int,
    fmt: str = "sglang",
) -> tuple[float, float]:
    """(latency, ttfb) in seconds; raises on any failure or incomplete response."""
    t0 = time.perf_counter()
    async with session.post(url, data=payload, headers=JSON_HEADERS) as resp:
        if resp.status != 200:
            await resp.read()
            raise Incomplete(f"HTTP {resp.status}")
        ttfb = 0.0
        if stream:
            count = 0
            done = finished = False
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                if not ttfb:
                    ttfb = time.perf_counter() - t0
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    raise Incomplete("SSE error event")
                ids, ends = output_of(chunk, fmt)
                count += ids
                finished = finished or ends
            if not (done and finished):
                raise Incomplete("SSE stream ended early")
        else:
            parts = [await resp.content.readany()]
            ttfb = time.perf_counter() - t0
            while True:
                part = await resp.content.readany()
                if not part:
                    break
                parts.append(part)
            count = output_of(json.loads(b"".join(parts)), fmt)[0]
    latency = time.perf_counter() - t0
    if count != tokens:
        raise Incomplete(f"{count} output ids, expected {tokens}")
    return latency, ttfb


async def run_load(
    target: Target,
    *,
    mode: str,
    requests: int,
    concurrency: int,
    prompt_tokens: int,
    output_tokens: int,
    procs: Supervisor,
    measure: bool = True,
) -> RunResult:
    """A closed loop: `concurrency` clients, each sending its next request when one ends."""
    assert target.session is not None
    session = target.session
    stream = mode == "sse"
    payload = request_body(prompt_tokens, output_tokens, stream, target.fmt)
    url = target.url + PATHS[target.fmt]
    issued = itertools.count()
    latencies: list[float] = []
    ttfbs: list[float] = []
    errors: Counter[str] = Counter()

    async def client() -> None:
        while next(issued) < requests:
            try:
                latency, ttfb = await one_request(
                    session, url, payload, stream, output_tokens, target.fmt
                )
            except (aiohttp.ClientError, OSError, Incomplete, ValueError, KeyError) as exc:
                errors[f"{type(exc).__name__}: {exc}"[:120]] += 1
                continue
            latencies.append(latency * 1000.0)
            ttfbs.append(ttfb * 1000.0)

    before = cpu_snapshot(target.pids) if measure else {}
    client_before = os.times()
    start = time.perf_counter()
    load = asyncio.gather(*(client() for _ in range(min(concurrency, requests))))
    while True:
        # A service that dies mid-run would leave requests hanging until their timeouts.
        done, _ = await asyncio.wait({load}, timeout=0.5)
        if done:
            break
        try:
            procs.check_alive()
        except ChildExited:
            load.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await load
            raise
    load.result()
    wall = time.perf_counter() - start
    client_after = os.times()
    after = cpu_snapshot(target.pids) if measure else {}
    cpu = {name: (after[name] - before[name]) * 1000.0 / CLK_TCK for name in before}
    client_cpu = (
        client_after.user + client_after.system - client_before.user - client_before.system
    ) * 1000.0
    return RunResult(
        target=target.name,
        mode=mode,
        concurrency=concurrency,
        requests=requests,
        wall_s=wall,
        latencies_ms=latencies,
        ttfbs_ms=ttfbs,
        errors=sum(errors.values()),
        error_kinds=errors,
        cpu_ms=cpu,
        client_cpu_ms=client_cpu,
        output_tokens=output_tokens,
    )


# --------------------------------------------------------------------------- readiness


async def wait_generate_ok(target: Target, procs: Supervisor) -> None:
    """One request end to end (the router may learn of the worker after the frontend)."""
    assert target.session is not None
    deadline = time.monotonic() + READY_TIMEOUT_S
    last = ""
    while time.monotonic() < deadline:
        procs.check_alive()
        try:
            await one_request(
                target.session,
                target.url + PATHS[target.fmt],
                request_body(4, 2, False, target.fmt),
                False,
                2,
                target.fmt,
            )
            return
        except (aiohttp.ClientError, OSError, TimeoutError, Incomplete) as exc:
            last = str(exc)
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{target.name}: /generate did not succeed: {last}")


# --------------------------------------------------------------------------- cancellation


async def cancel_scenario(
    nats_url: str, worker_id: str, trials: int, prompt_tokens: int
) -> dict[str, Any]:
    """Open a stream on the slow worker, cancel after its 2nd `out` frame, time the `err`.

    Raw nats-py, not MeshClient: MeshClient stops listening when its generator is closed,
    and the point is to see the worker's final `err` frame arrive.
    """
    subjects = Subjects(NAMESPACE)
    codec = get_codec(None)
    nc = await nats.connect(nats_url, name="genmesh-bench-cancel")
    inbox = nc.new_inbox()
    queues: dict[str, asyncio.Queue[dict[str, Any]]] = {}

    async def on_reply(msg: Any) -> None:
        queue = queues.get(msg.subject)
        # Empty messages (a stream terminator after the last frame) carry no frame.
        if queue is not None and msg.data:
            try:
                queue.put_nowait(codec.decode(msg.data))
            except CodecError:
                queue.put_nowait({"t": "unreadable"})

    sub = await nc.subscribe(f"{inbox}.*", cb=on_reply)
    latencies: list[float] = []
    steps: list[float] = []
    failures: Counter[str] = Counter()
    prompt = list(range(1, prompt_tokens + 1))
    try:
        trial = 0
        attempts = 0
        while trial < trials:
            attempts += 1
            if attempts > trials * 3:
                break
            reply = f"{inbox}.{attempts}"
            queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
            queues[reply] = queue
            envelope = mesh_request(prompt, max_tokens=4096, ignore_eos=True, worker=worker_id)
            await nc.publish(
                subjects.router_generate, codec.encode(envelope.to_wire()), reply=reply
            )
            outs = 0
            out_at: list[float] = []
            cancelled_at = 0.0
            try:
                async with asyncio.timeout(15.0):
                    while True:
                        frame = await queue.get()
                        kind = frame.get("t")
                        if kind == "out":
                            outs += 1
                            out_at.append(time.perf_counter())
                            if outs == 2 and not cancelled_at:
                                cancelled_at = time.perf_counter()
                                await nc.publish(
                                    subjects.cancel,
                                    codec.encode({"id": envelope.id, "reason": "bench"}),
                                )
                        elif kind in ("err", "end", "unreadable"):
                            break
            except TimeoutError:
                failures["timeout"] += 1
                trial += 1
                continue
            finally:
                queues.pop(reply, None)
            if kind == "err" and frame.get("code") == "no_worker" and not cancelled_at:
                await asyncio.sleep(0.1)  # the router has not heard of the worker yet
                continue
            trial += 1
            if kind == "err" and frame.get("code") == "cancelled" and cancelled_at:
                latencies.append((time.perf_counter() - cancelled_at) * 1000.0)
                steps.append((out_at[1] - out_at[0]) * 1000.0)
            else:
                failures[f"{kind}: {frame.get('code')}"] += 1
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        await nc.drain()
    return {
        "trials": trials,
        "ok": len(latencies),
        "failures": dict(failures),
        "p50_ms": percentile(latencies, 50),
        "p90_ms": percentile(latencies, 90),
        "p99_ms": percentile(latencies, 99),
        "max_ms": max(latencies) if latencies else float("nan"),
        "token_interval_p50_ms": percentile(steps, 50),
    }


# --------------------------------------------------------------------------- reporting


def median_of(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Each metric's median over the repeats (errors: the total)."""
    keys = [k for k, v in summaries[0].items() if isinstance(v, int | float)]
    out: dict[str, Any] = {k: statistics.median(s[k] for s in summaries) for k in keys}
    out["errors"] = sum(s["errors"] for s in summaries)
    for by_proc in ("cpu_ms_per_req_by_proc", "cpu_us_per_token_by_proc"):
        out[by_proc] = {
            p: statistics.median(s[by_proc][p] for s in summaries) for p in summaries[0][by_proc]
        }
    out["req_s_min"] = min(s["req_s"] for s in summaries)
    out["req_s_max"] = max(s["req_s"] for s in summaries)
    return out


RATIO_KEYS = (
    "req_s",
    "lat_p50_ms",
    "lat_p90_ms",
    "lat_p99_ms",
    "ttfb_p50_ms",
    "ttfb_p99_ms",
    "cpu_ms_per_req",
)


def ratios(mesh: dict[str, Any], direct: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key in RATIO_KEYS:
        d = direct[key]
        out[key] = mesh[key] / d if d else float("nan")
    return out


COLUMNS = (
    # header, width, key, format
    ("mode", 5, "mode", "s"),
    ("conc", 4, "concurrency", "d"),
    ("target", 6, "target", "s"),
    ("req/s", 7, "req_s", ".0f"),
    ("p50", 6, "lat_p50_ms", ".2f"),
    ("p90", 6, "lat_p90_ms", ".2f"),
    ("p99", 6, "lat_p99_ms", ".2f"),
    ("ttfb50", 6, "ttfb_p50_ms", ".2f"),
    ("ttfb99", 6, "ttfb_p99_ms", ".2f"),
    ("err", 3, "errors", "d"),
    ("cpu/req", 7, "cpu_ms_per_req", ".3f"),
    ("fe", 5, "frontend", ".3f"),
    ("router", 6, "router", ".3f"),
    ("worker", 6, "worker", ".3f"),
    ("nats", 5, "nats", ".3f"),
    ("client", 6, "client_cpu_ms_per_req", ".3f"),
)


def _cell(value: Any, width: int, fmt: str) -> str:
    if value is None:
        return " " * (width - 1) + "-"
    if fmt == "ratio":
        return f"{value:.2f}x".rjust(width)
    return f"{value:{fmt}}".rjust(width) if fmt != "s" else f"{value:<{width}}"


def render_table(results: list[dict[str, Any]]) -> str:
    header = "  ".join(
        f"{h:<{w}}" if fmt == "s" else f"{h:>{w}}" for h, w, _, fmt in COLUMNS
    ).rstrip()
    lines = [header, "-" * len(header)]
    for res in results:
        for row_name in ("mesh", "direct", "ratio"):
            if row_name == "ratio":
                data: dict[str, Any] = res["ratio"]
            else:
                data = dict(res[row_name])
                data.pop("cpu_us_per_token_by_proc")
                data.update(data.pop("cpu_ms_per_req_by_proc"))
            cells = []
            for _, width, key, fmt in COLUMNS:
                if key == "mode":
                    value: Any = res["mode"] if row_name == "mesh" else ""
                    cells.append(_cell(value, width, "s"))
                elif key == "concurrency":
                    cells.append(_cell(res["concurrency"], width, "d"))
                elif key == "target":
                    cells.append(_cell("m/d" if row_name == "ratio" else row_name, width, "s"))
                elif row_name == "ratio":
                    value = data.get(key)
                    cells.append(_cell(value, width, "ratio") if value is not None else " " * width)
                else:
                    cells.append(_cell(data.get(key), width, fmt))
            lines.append("  ".join(cells).rstrip())
        lines.append("")
    return "\n".join(lines).rstrip()


def render_per_token(results: list[dict[str, Any]], output_tokens: int) -> str:
    """Server CPU per output token in µs, by process: what long outputs cost."""
    procs = ("frontend", "router", "worker", "nats")
    header = f"{'mode':<5}  {'conc':>4}  {'target':<6}  {'µs/token':>8}" + "".join(
        f"  {p:>8}" for p in procs
    )
    lines = [f"server CPU per output token, µs ({output_tokens} tokens per request):", header]
    for res in results:
        for name in ("mesh", "direct"):
            data = res[name]
            by_proc = data["cpu_us_per_token_by_proc"]
            cells = "".join(
                f"  {by_proc[p]:8.1f}" if p in by_proc else f"  {'-':>8}" for p in procs
            )
            lines.append(
                f"{res['mode'] if name == 'mesh' else '':<5}  {res['concurrency']:>4}  "
                f"{name:<6}  {data['cpu_us_per_token']:8.1f}{cells}"
            )
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def _csv_ints(value: str) -> list[int]:
    numbers = [int(part) for part in value.split(",") if part.strip()]
    if not numbers or any(n < 1 for n in numbers):
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,32: {value!r}")
    return numbers


def _modes(value: str) -> list[str]:
    modes = [part.strip() for part in value.split(",") if part.strip()]
    if not modes or any(m not in ("sse", "unary") for m in modes):
        raise argparse.ArgumentTypeError(f"modes are sse and unary: {value!r}")
    return modes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="genmesh mesh vs direct-engine benchmark for SGLang /generate (or vLLM's)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--requests", type=int, default=4000, help="requests per measured run")
    p.add_argument("--concurrency", type=_csv_ints, default=[1, 32], help="e.g. 1,32")
    p.add_argument("--modes", type=_modes, default=["sse", "unary"], help="sse,unary")
    p.add_argument("--output-tokens", type=int, default=16, help="max_new_tokens per request")
    p.add_argument("--prompt-tokens", type=int, default=32, help="input_ids per request")
    p.add_argument(
        "--workers", type=int, default=1, help="instant mock workers (compare_dynamo.sh: 2)"
    )
    p.add_argument("--repeats", type=int, default=3, help="measured runs per target")
    p.add_argument(
        "--warmup", type=int, default=100, help="warm-up requests per target and combination"
    )
    p.add_argument("--cancel-trials", type=int, default=30, help="0 skips the cancel scenario")
    p.add_argument(
        "--cancel-speedup", type=float, default=0.05, help="mock speed-up of the slow worker"
    )
    p.add_argument("--format", choices=PATHS, default="sglang", help="the generate format to load")
    p.add_argument("--json", metavar="FILE", help="also save every result as JSON")
    p.add_argument("--keep-logs", action="store_true", help="keep the service logs directory")
    args = p.parse_args(argv)
    if args.requests < 1 or args.repeats < 1 or args.output_tokens < 1:
        p.error("--requests, --repeats and --output-tokens must be at least 1")
    if args.prompt_tokens < 1 or args.workers < 1:
        p.error("--prompt-tokens and --workers must be at least 1")
    if args.prompt_tokens + args.output_tokens > MockConfig().max_model_len:
        p.error(
            f"--prompt-tokens + --output-tokens must fit the mock's context length "
            f"({MockConfig().max_model_len})"
        )
    return args


def say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


async def bench(
    args: argparse.Namespace, procs: Supervisor, nats_url: str, ports: dict[str, int]
) -> dict[str, Any]:
    assert procs.nats is not None
    assert procs.nats.pid is not None
    mesh = Target(
        "mesh",
        f"http://127.0.0.1:{ports['frontend']}",
        {role: [c.pid for c in procs.children if c.role == role] for role in MESH_PROCS}
        | {"nats": [procs.nats.pid]},
        fmt=args.format,
    )
    direct = Target(
        "direct",
        f"http://127.0.0.1:{ports['direct']}",
        {"direct": [procs.get("direct").pid]},
        fmt=args.format,
    )
    limit = max(args.concurrency)
    for target in (mesh, direct):
        target.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=limit, keepalive_timeout=120),
            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
        )
    try:
        assert mesh.session is not None
        assert direct.session is not None
        for target, what in ((mesh, "the frontend"), (direct, "the direct engine")):
            await wait_http_ok(
                target.url + "/health", timeout_s=READY_TIMEOUT_S, watch=procs.children, what=what
            )
        await wait_generate_ok(mesh, procs)
        await wait_generate_ok(direct, procs)
        say("mesh and baseline are ready")

        results: list[dict[str, Any]] = []
        shape = {"prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens}
        for mode in args.modes:
            for conc in args.concurrency:
                for target in (mesh, direct):
                    await run_load(
                        target,
                        mode=mode,
                        requests=max(min(args.warmup, args.requests), conc),
                        concurrency=conc,
                        procs=procs,
                        measure=False,
                        **shape,
                    )
                runs: dict[str, list[dict[str, Any]]] = {"mesh": [], "direct": []}
                for rep in range(args.repeats):
                    # Alternate which goes first, so neither always gets the quieter slot.
                    order = (mesh, direct) if rep % 2 == 0 else (direct, mesh)
                    for target in order:
                        run = await run_load(
                            target,
                            mode=mode,
                            requests=args.requests,
                            concurrency=conc,
                            procs=procs,
                            **shape,
                        )
                        procs.check_alive()
                        summary = run.summary()
                        runs[target.name].append(summary)
                        say(
                            f"{mode:<5} c={conc:<3} rep {rep + 1}/{args.repeats} "
                            f"{target.name:<6} {summary['req_s']:7.0f} req/s  "
                            f"p50 {summary['lat_p50_ms']:6.2f} ms  "
                            f"p99 {summary['lat_p99_ms']:6.2f} ms  "
                            f"cpu {summary['cpu_ms_per_req']:.3f} ms/req  "
                            f"errors {summary['errors']}"
                        )
                        if run.error_kinds:
                            say(f"  errors: {dict(run.error_kinds.most_common(3))}")
                m, d = median_of(runs["mesh"]), median_of(runs["direct"])
                results.append(
                    {
                        "mode": mode,
                        "concurrency": conc,
                        "mesh": m,
                        "direct": d,
                        "ratio": ratios(m, d),
                        "repeats": runs,
                    }
                )

        cancel: dict[str, Any] | None = None
        if args.cancel_trials > 0:
            cancel = await run_cancel(args, procs, nats_url, mesh)
        return {"results": results, "cancel": cancel}
    finally:
        for target in (mesh, direct):
            if target.session is not None:
                await target.session.close()


async def run_cancel(
    args: argparse.Namespace, procs: Supervisor, nats_url: str, mesh: Target
) -> dict[str, Any]:
    # Started only now: while it is up, the router would send it unpinned requests too.
    slow_id = "wslow" + new_worker_id()[1:]
    slow = instant_worker(nats_url, worker_id=slow_id, mock=MockConfig(speedup=args.cancel_speedup))
    await asyncio.to_thread(procs.spawn_genmesh, "slow-worker", slow)
    await wait_discovered(
        nats_url, NAMESPACE, workers=[slow_id], timeout_s=READY_TIMEOUT_S, watch=procs.children
    )
    say(f"cancel scenario: {args.cancel_trials} trials on worker {slow_id}")
    cancel = await cancel_scenario(nats_url, slow_id, args.cancel_trials, args.prompt_tokens)
    await asyncio.to_thread(procs.get("slow-worker").terminate, 10.0)
    return cancel


def loadavg() -> list[str]:
    with contextlib.suppress(OSError):
        return Path("/proc/loadavg").read_text().split()[:3]
    return ["?"]


def environment() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "loadavg_at_start": loadavg(),
    }


def print_report(args: argparse.Namespace, report: dict[str, Any]) -> None:
    print()
    print(
        f"genmesh {PATHS[args.format]} benchmark: {args.requests} requests/run, "
        f"prompt {args.prompt_tokens} tokens, output {args.output_tokens} tokens, "
        f"median of {args.repeats} repeats; {report['env']['cpus']} CPUs, "
        f"loadavg at start {' '.join(report['env']['loadavg_at_start'])}, "
        f"at end {' '.join(report['env']['loadavg_at_end'])}"
    )
    print(
        "latencies in ms (client-side); cpu = server CPU ms per request: total, then per "
        "mesh process (fe = frontend); client = the load generator's own CPU ms per request; "
        "m/d = mesh / direct"
    )
    print()
    print(render_table(report["results"]), flush=True)
    print()
    print(render_per_token(report["results"], args.output_tokens), flush=True)
    cancel = report.get("cancel")
    if cancel:
        print()
        print(
            f"cancellation (cancel published -> worker's err 'cancelled' received), "
            f"{cancel['ok']}/{cancel['trials']} trials, worker speed-up {args.cancel_speedup:g} "
            f"(~{cancel['token_interval_p50_ms']:.0f} ms/token):"
        )
        print(
            f"  p50 {cancel['p50_ms']:.2f} ms   p90 {cancel['p90_ms']:.2f} ms   "
            f"p99 {cancel['p99_ms']:.2f} ms   max {cancel['max_ms']:.2f} ms"
            + (f"   failures {cancel['failures']}" if cancel["failures"] else "")
        )


def run_benchmark(
    body: Callable[[], dict[str, Any]],
    stop: Callable[[], None],
    workdir: Path,
    keep_logs: bool,
    json_path: str | None,
) -> int:
    """Run a benchmark's `body` (it prints its report and returns what `--json` saves) and
    always `stop` its processes: exit status 0, 130 when Ctrl-C or SIGTERM ended it, 1 when
    it failed, and then the services' logs in `workdir` are kept (else removed, unless
    `keep_logs`)."""
    failed = True
    # SIGTERM ends the benchmark like Ctrl-C: through the finally below.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        report = body()
        if json_path:
            Path(json_path).write_text(json.dumps(report, indent=2, default=str) + "\n")
            say(f"results saved to {json_path}")
        failed = False
        return 0
    except KeyboardInterrupt:
        failed = False
        say("interrupted; stopping")
        return 130
    except Exception as exc:
        say(f"failed: {type(exc).__name__}: {exc}")
        return 1
    finally:
        # Ctrl-C during the cleanup must not leave processes behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop()
        if failed or keep_logs:
            say(f"service logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="genmesh-bench-"))
    procs = Supervisor(logdir=workdir, env=clean_environment(prefixes=("GENMESH_",)))

    def body() -> dict[str, Any]:
        env = environment()
        started = time.monotonic()
        nats_url = procs.start_nats()
        ports = {"frontend": free_port(), "direct": free_port()}
        workers = [instant_worker(nats_url) for _ in range(args.workers)]
        start_mesh(procs, nats_url, ports["frontend"], *workers, fmt=args.format)
        procs.spawn(
            "direct",
            "direct",
            [sys.executable, str(HERE / "direct_engine.py"), "--host", "127.0.0.1",
             "--port", str(ports["direct"]), "--format", args.format],
        )  # fmt: skip
        say(
            f"started nats, router, {args.workers} worker(s), frontend, direct engine "
            f"(logs in {workdir})"
        )
        report = asyncio.run(bench(args, procs, nats_url, ports))
        env["loadavg_at_end"] = loadavg()
        report["env"] = env
        report["config"] = {
            k: getattr(args, k)
            for k in (
                "requests",
                "concurrency",
                "modes",
                "output_tokens",
                "prompt_tokens",
                "workers",
                "format",
                "repeats",
                "warmup",
                "cancel_trials",
                "cancel_speedup",
            )
        }
        report["elapsed_s"] = round(time.monotonic() - started, 1)
        print_report(args, report)
        print(f"\n(took {report['elapsed_s']:.0f} s)")
        return report

    return run_benchmark(body, procs.stop, workdir, args.keep_logs, args.json)


if __name__ == "__main__":
    sys.exit(main())

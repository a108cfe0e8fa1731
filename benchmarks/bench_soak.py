"""Soak: a mesh under mixed traffic and faults for a long time, its memory and fds watched.

    .venv/bin/python benchmarks/bench_soak.py [--minutes 30] [--clients 8] [--workers 3]
        [--kill-every 120] [--blip-every 180] [--sample-every 5] [--json FILE]

Starts a nats-server on a fixed port and a mesh of OS processes (1 router, N mock workers
at 4x real time, 1 frontend: tests/mesh.py's Mesh, the supervisor `genmesh up` uses).
`--clients` closed-loop clients send, for the whole run, a mix of both formats (SGLang
`/generate`, vLLM `/inference/v1/generate`), unary and SSE; one SSE request in ten is
dropped by its client after the first chunk (a client disconnect). Meanwhile a worker is
SIGKILLed every `--kill-every` seconds (and a new one started), and NATS is killed and
restarted on its port every `--blip-every` seconds (down for `--blip-seconds`).

Every answer is checked (status 200, exactly the asked number of tokens). A client
honours a 503 with `Retry-After` as the formats document it: it sends the request again,
for up to `--retry-for` seconds. A request is **lost** if it has no correct answer by
then. Every `--sample-every` seconds the RSS and open fds of every process (nats-server,
router, workers, frontend) are sampled; the table gives each one's start (the first
sample after the warm-up, the first tenth of the run), peak and end.

tests/test_soak.py runs the same for about a minute in CI and asserts zero lost requests
and bounded growth.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.mesh import Mesh, Service

from genmesh.shared.natsserver import NatsServer
from genmesh.supervisor import free_port

NAMESPACE = "soak"
VOCAB, EOS = 1000, 7
WORKER = {"vocab_size": VOCAB, "eos_token_id": EOS, "speedup": 4.0}


@dataclass(frozen=True)
class SoakConfig:
    seconds: float = 1800.0
    clients: int = 8
    workers: int = 3
    kill_every_s: float = 120.0
    blip_every_s: float = 180.0
    blip_s: float = 1.0
    sample_every_s: float = 5.0
    retry_for_s: float = 30.0
    max_tokens: int = 24
    seed: int = 1


@dataclass
class Sample:
    t: float
    rss_mb: float
    fds: int


@dataclass
class SoakReport:
    config: SoakConfig
    outcomes: Counter[str] = field(default_factory=Counter)
    lost: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    samples: dict[str, list[Sample]] = field(default_factory=dict)
    # processes that lived the whole run (not killed, not started as replacements)
    survivors: list[str] = field(default_factory=list)

    def start_peak_end(self, name: str) -> tuple[Sample, Sample, Sample]:
        series = self.samples[name]
        warm = self.config.seconds / 10
        after = [s for s in series if s.t >= warm] or series
        return after[0], max(after, key=lambda s: s.rss_mb), after[-1]

    def to_json(self) -> dict[str, Any]:
        return {
            "config": asdict(self.config),
            "outcomes": dict(self.outcomes),  # asdict would rebuild a Counter from pairs
            "lost": self.lost,
            "events": self.events,
            "survivors": self.survivors,
            "samples": {n: [asdict(s) for s in series] for n, series in self.samples.items()},
        }

    def table(self) -> str:
        o = self.outcomes
        lines = [
            f"soak: {self.config.seconds:.0f}s, {self.config.clients} clients, "
            f"{self.config.workers} workers; {sum(o.values())} requests: "
            + ", ".join(f"{k} {v}" for k, v in sorted(o.items())),
            f"requests lost: {len(self.lost)}",
            *(f"  lost: {why}" for why in self.lost[:10]),
            f"events: {', '.join(self.events) or 'none'}",
            f"{'process':<22} {'RSS MB start':>12} {'peak':>8} {'end':>8}   "
            f"{'fds start':>9} {'peak':>5} {'end':>5}",
        ]
        for name in self.samples:
            start, peak, end = self.start_peak_end(name)
            fds_peak = max(s.fds for s in self.samples[name])
            mark = "" if name in self.survivors else "  (killed or started mid-run)"
            lines.append(
                f"{name:<22} {start.rss_mb:12.1f} {peak.rss_mb:8.1f} {end.rss_mb:8.1f}   "
                f"{start.fds:9d} {fds_peak:5d} {end.fds:5d}{mark}"
            )
        return "\n".join(lines)


# ---------------------------------------------------------------- traffic


def _request(rng: random.Random, max_tokens: int) -> tuple[str, dict[str, Any], dict[str, str]]:
    prompt = [rng.randrange(8, VOCAB) for _ in range(rng.randrange(4, 64))]
    if rng.random() < 0.5:
        body = {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True},
        }
        return "/generate", body, {}
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True}}
    return "/inference/v1/generate", body, {"Content-Type": "application/json"}


def _tokens(path: str, body: Any) -> int:
    if path == "/generate":
        return len(body["output_ids"])
    return len(body["choices"][0]["token_ids"])


def _sse_tokens(path: str, events: list[Any]) -> int:
    """Tokens of an SSE answer: SGLang's chunks carry the new ids (incremental output),
    vLLM's each choice's new ids."""
    if path == "/generate":
        return sum(len(e.get("output_ids", [])) for e in events)
    return sum(len(c.get("token_ids") or []) for e in events for c in e.get("choices", []))


async def _one(
    session: aiohttp.ClientSession, url: str, rng: random.Random, config: SoakConfig
) -> str:
    """One request until it has a correct answer: its outcome (`ok`, `ok after 503`,
    `disconnected`), or raises `_Lost` with why."""
    path, body, headers = _request(rng, config.max_tokens)
    stream = rng.random() < 0.5
    disconnect = stream and rng.random() < 0.1
    body["stream"] = stream
    give_up = time.monotonic() + config.retry_for_s
    retried = False
    while True:
        try:
            async with session.post(url + path, json=body, headers=headers) as resp:
                if resp.status == 503 and "Retry-After" in resp.headers:
                    why = (await resp.text())[:200]
                else:
                    if resp.status != 200:
                        raise _Lost(f"{path} HTTP {resp.status}: {(await resp.text())[:200]}")
                    if disconnect:
                        await resp.content.readline()
                        return "disconnected"
                    got = await _count(path, resp, stream)
                    if got != config.max_tokens:
                        raise _Lost(f"{path} stream={stream}: {got} of {config.max_tokens} tokens")
                    return "ok after 503" if retried else "ok"
        except aiohttp.ClientError as exc:
            why = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= give_up:
            raise _Lost(f"{path} stream={stream}: still failing after {config.retry_for_s}s: {why}")
        retried = True
        await asyncio.sleep(1.0)


async def _count(path: str, resp: aiohttp.ClientResponse, stream: bool) -> int:
    if not stream:
        return _tokens(path, await resp.json())
    events = []
    async for line in resp.content:
        text = line.decode().strip()
        if text.startswith("data: ") and text != "data: [DONE]":
            events.append(json.loads(text[len("data: ") :]))
    return _sse_tokens(path, events)


class _Lost(Exception):
    pass


async def _client(url: str, seed: int, config: SoakConfig, stop: float, report: SoakReport) -> None:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=config.retry_for_s + 30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while time.monotonic() < stop:
            try:
                report.outcomes[await _one(session, url, rng, config)] += 1
            except _Lost as exc:
                report.outcomes["lost"] += 1
                report.lost.append(str(exc))


# ---------------------------------------------------------------- faults and samples


class _Nats:
    """A nats-server on a fixed port that can be killed and started again there."""

    def __init__(self) -> None:
        self.port = free_port()
        self.server = NatsServer(port=self.port)
        self.url = self.server.start()
        self.name = "nats-server"

    def blip(self, seconds: float) -> None:
        self.server.kill()
        self.server.stop()  # its directory
        time.sleep(seconds)
        self.server = NatsServer(port=self.port)
        self.server.start()
        self.name = f"nats-server {self.server.pid}"  # another process: a series of its own

    @property
    def pid(self) -> int | None:
        return self.server.pid


def _sample(name: str, pid: int | None, t: float, report: SoakReport) -> None:
    if pid is None:
        return
    try:
        proc = psutil.Process(pid)
        sample = Sample(t, proc.memory_info().rss / 2**20, proc.num_fds())
    except psutil.Error:
        return  # gone between the listing and the reading: killed
    report.samples.setdefault(name, []).append(sample)


async def _sampler(
    mesh: Mesh, nats: _Nats, started: float, stop: float, config: SoakConfig, report: SoakReport
) -> None:
    while time.monotonic() < stop:
        t = time.monotonic() - started
        _sample(nats.name, nats.pid, t, report)
        for child in list(mesh.services):
            if child.alive:
                _sample(child.name, child.pid, t, report)
        await asyncio.sleep(config.sample_every_s)


async def _killer(
    mesh: Mesh, rng: random.Random, stop: float, config: SoakConfig, report: SoakReport
) -> None:
    started = time.monotonic()
    while time.monotonic() + config.kill_every_s < stop:
        await asyncio.sleep(config.kill_every_s)
        victim: Service = rng.choice(mesh.workers)
        await asyncio.to_thread(victim.kill)
        await asyncio.to_thread(mesh.add_worker, **WORKER)
        report.events.append(f"{time.monotonic() - started:.0f}s killed {victim.name}")


async def _blipper(
    mesh: Mesh, nats: _Nats, stop: float, config: SoakConfig, report: SoakReport
) -> None:
    started = time.monotonic()
    while time.monotonic() + config.blip_every_s < stop:
        await asyncio.sleep(config.blip_every_s)
        await asyncio.to_thread(nats.blip, config.blip_s)
        report.events.append(f"{time.monotonic() - started:.0f}s NATS down {config.blip_s:g}s")
        await asyncio.to_thread(mesh.wait_for_workers, lambda ids: len(ids) >= config.workers, 30.0)


async def run_soak(config: SoakConfig, workdir: Path) -> SoakReport:
    """Start the mesh, run the traffic and the faults for `config.seconds`, stop it all."""
    report = SoakReport(config)
    nats = _Nats()
    mesh = Mesh(nats.url, workdir, NAMESPACE)
    try:
        mesh.add_router()
        for _ in range(config.workers):
            mesh.add_worker(wait=False, **WORKER)
        mesh.add_frontend()
        mesh.wait_for_workers(lambda ids: len(ids) >= config.workers, timeout=30)
        originals = [s.name for s in mesh.services]
        rng = random.Random(config.seed)
        started = time.monotonic()
        stop = started + config.seconds
        await asyncio.gather(
            _sampler(mesh, nats, started, stop, config, report),
            _killer(mesh, rng, stop, config, report),
            _blipper(mesh, nats, stop, config, report),
            *(
                _client(mesh.http_url, config.seed * 1000 + i, config, stop, report)
                for i in range(config.clients)
            ),
        )
        report.survivors = [n for n in originals if _alive(mesh, n)]
        if nats.name == "nats-server":  # never restarted
            report.survivors.append(nats.name)
    finally:
        mesh.stop()
        nats.server.stop()
    return report


def _alive(mesh: Mesh, name: str) -> bool:
    return any(s.name == name and s.alive for s in mesh.services)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=8, help="closed-loop HTTP clients")
    parser.add_argument("--workers", type=int, default=3, help="mock workers kept running")
    parser.add_argument("--kill-every", type=float, default=120.0, help="s between worker kills")
    parser.add_argument("--blip-every", type=float, default=180.0, help="s between NATS restarts")
    parser.add_argument("--blip-seconds", type=float, default=1.0, help="NATS down this long")
    parser.add_argument("--sample-every", type=float, default=5.0, help="s between samples")
    parser.add_argument("--retry-for", type=float, default=30.0, help="a client's retries on 503")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="save the report and every sample")
    args = parser.parse_args()
    config = SoakConfig(
        seconds=args.minutes * 60,
        clients=args.clients,
        workers=args.workers,
        kill_every_s=args.kill_every,
        blip_every_s=args.blip_every,
        blip_s=args.blip_seconds,
        sample_every_s=args.sample_every,
        retry_for_s=args.retry_for,
        max_tokens=args.max_tokens,
        seed=args.seed,
    )
    with tempfile.TemporaryDirectory(prefix="genmesh-soak-") as workdir:
        report = asyncio.run(run_soak(config, Path(workdir)))
    print(report.table())
    if args.json:
        args.json.write_text(json.dumps(report.to_json(), indent=1))
    return 1 if report.lost else 0


if __name__ == "__main__":
    sys.exit(main())

"""Fault tolerance of the whole mesh, measured: graceful drain and rolling restarts, NATS
outages, cancellation at scale, deadlines.

Every mesh here is real processes (`tests/mesh.py`). The outage test runs its own
nats-server on a fixed port so it can kill and restart it; the others use the session's.
Tests print one `RESILIENCE ...` line with what they measured (see it with `pytest -s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import nats
import pytest

from genmesh.client import MeshClient, MigrationReason, request
from genmesh.codecs import get_codec
from genmesh.engines.mock import MockConfig, MockEngine
from genmesh.services.frontend.serve import start_frontend
from genmesh.shared.bus import flush_in_order
from genmesh.shared.frames import ack as ack_frame
from genmesh.shared.natsserver import NatsServer
from genmesh.shared.subjects import Subjects
from tests.conftest import unique_namespace
from tests.http_util import parse_sse
from tests.mesh import Mesh, Service, free_port, frontend_options, start_mesh, wait_until

pytestmark = pytest.mark.process

VOCAB, EOS = 1000, 7
WORKER_OPTS: dict[str, Any] = {"vocab_size": VOCAB, "eos_token_id": EOS}
SGLANG_PATH, VLLM_PATH = "/generate", "/inference/v1/generate"
TIMEOUT_HEADER = "X-Request-Timeout"
# The slow mesh's mock workers: about 0.83 s of prefill, then a token every 0.29 s.
SLOW_SPEEDUP = 0.02


def report(what: str, **numbers: Any) -> None:
    print(f"RESILIENCE {what}: " + json.dumps(numbers, sort_keys=True))


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class Job:
    """One HTTP request of a known answer (ignore_eos: exactly `max_tokens` tokens)."""

    fmt: str  # "sglang" | "vllm"
    stream: bool
    prompt: tuple[int, ...]
    max_tokens: int
    seed: int

    @property
    def path(self) -> str:
        return SGLANG_PATH if self.fmt == "sglang" else VLLM_PATH

    def body(self) -> dict[str, Any]:
        if self.fmt == "sglang":
            sp = {"max_new_tokens": self.max_tokens, "ignore_eos": True, "sampling_seed": self.seed}
            return {"input_ids": list(self.prompt), "sampling_params": sp, "stream": self.stream}
        body: dict[str, Any] = {
            "token_ids": list(self.prompt),
            "sampling_params": {
                "max_tokens": self.max_tokens,
                "ignore_eos": True,
                # Greedy: a seeded sampler (temperature > 0) is refused for migration,
                # since vLLM's per-request generator would restart on the new worker.
                "temperature": 0.0,
                "seed": self.seed,
            },
            "stream": self.stream,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        return body


def random_job(rng: random.Random, *, stream: bool, low: int = 8, high: int = 120) -> Job:
    return Job(
        fmt="sglang" if rng.random() < 0.75 else "vllm",
        stream=stream,
        prompt=tuple(rng.randrange(VOCAB) for _ in range(rng.randint(2, 12))),
        max_tokens=rng.randint(low, high),
        seed=rng.randrange(1 << 31),
    )


_expected: dict[tuple[tuple[int, ...], int, int], list[int]] = {}


async def expected_tokens(job: Job) -> list[int]:
    """What an uninterrupted run returns: the in-process MockEngine, as the workers run it."""
    key = (job.prompt, job.max_tokens, job.seed)
    if key not in _expected:
        engine = MockEngine(MockConfig(vocab_size=VOCAB, eos_token_id=EOS))
        env = request(list(job.prompt), max_tokens=job.max_tokens, seed=job.seed, ignore_eos=True)
        _expected[key] = [t async for out in engine.generate(env) for t in out.tokens]
    return _expected[key]


@dataclass
class Outcome:
    job: Job
    started: float  # time.monotonic()
    ended: float
    status: int  # 0: no HTTP answer at all
    error: str  # "" unless the request ended in an error (HTTP status or in-band)
    wrong: str  # "" unless it "succeeded" with a wrong answer
    events: list[Any]  # SSE payloads, or [body] for unary

    @property
    def ok(self) -> bool:
        return not self.error and not self.wrong

    @property
    def elapsed(self) -> float:
        return self.ended - self.started


def _error_message(payload: Any) -> str | None:
    """The message of a format's error body or in-band SSE error event, else None."""
    if not isinstance(payload, dict):
        return None
    if payload.get("object") == "error":  # SGLang's legacy shape (5xx)
        return str(payload.get("message"))
    err = payload.get("error")
    if isinstance(err, dict):
        return str(err.get("message"))
    return None


def _verify(job: Job, events: list[Any], expected: list[int]) -> str:
    """ "" when `events` (SSE payloads without [DONE], or [unary body]) are what an
    uninterrupted run returns; else what is wrong."""
    n = job.max_tokens
    try:
        if job.fmt == "sglang" and not job.stream:
            (body,) = events
            meta = body["meta_info"]
            tokens, finish, count = (
                body["output_ids"],
                meta["finish_reason"],
                meta["completion_tokens"],
            )
            want_finish: Any = {"type": "length", "length": n}
        elif job.fmt == "sglang":
            tokens, counts = [], []
            for chunk in events:
                tokens += chunk["output_ids"]
                counts.append(chunk["meta_info"]["completion_tokens"])
                if counts[-1] != len(tokens):
                    return f"completion_tokens {counts[-1]} after {len(tokens)} tokens"
            finish, count = events[-1]["meta_info"]["finish_reason"], counts[-1]
            want_finish = {"type": "length", "length": n}
        elif not job.stream:
            (body,) = events
            (choice,) = body["choices"]
            tokens, finish = choice["token_ids"], choice["finish_reason"]
            count = body["usage"]["completion_tokens"]
            want_finish = "length"
        else:
            *chunks, usage_chunk = events
            tokens = []
            for chunk in chunks:
                tokens += chunk["choices"][0]["token_ids"]
                if chunk["usage"]["completion_tokens"] != len(tokens):
                    return f"usage {chunk['usage']['completion_tokens']} after {len(tokens)} tokens"
            finish = chunks[-1]["choices"][0]["finish_reason"]
            assert usage_chunk["choices"] == []
            count = usage_chunk["usage"]["completion_tokens"]
            want_finish = "length"
    except (KeyError, IndexError, TypeError, ValueError, AssertionError) as exc:
        return f"unexpected shape ({exc!r}): {str(events)[:300]}"
    if tokens != expected:
        return f"tokens differ from an uninterrupted run: {tokens} != {expected}"
    if count != n or finish != want_finish:
        return f"count {count} / finish {finish!r}, expected {n} / {want_finish!r}"
    return ""


async def run_job(
    session: aiohttp.ClientSession,
    base_url: str,
    job: Job,
    *,
    headers: dict[str, str] | None = None,
    timeout_s: float = 30.0,
) -> Outcome:
    """Send `job`, read the whole answer, and judge it against the MockEngine."""
    started = time.monotonic()
    status, events, error = 0, [], ""
    try:
        async with session.post(
            base_url + job.path,
            json=job.body(),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            status = resp.status
            raw = await resp.text()
            if resp.content_type == "text/event-stream":
                events = parse_sse(raw)
                if not events or events[-1] != "[DONE]":
                    error = f"SSE stream without [DONE]: {raw[-300:]!r}"
                events = [e for e in events if e != "[DONE]"]
            else:
                try:
                    events = [json.loads(raw)]
                except ValueError:
                    events = [raw]
    except (aiohttp.ClientError, TimeoutError) as exc:
        error = f"no answer: {exc!r}"
    ended = time.monotonic()
    if not error and status != 200:
        error = f"HTTP {status}: {_error_message(events[0]) if events else None}"
    if not error:
        in_band = [m for e in events if (m := _error_message(e)) is not None]
        if in_band:
            error = f"in-band error after HTTP 200: {in_band[0]}"
    wrong = "" if error else _verify(job, events, await expected_tokens(job))
    return Outcome(job, started, ended, status, error, wrong, events)


class Load:
    """`concurrency` closed loops of requests (alternately SSE and unary) until stopped."""

    def __init__(
        self,
        base_url: str,
        concurrency: int,
        *,
        headers: dict[str, str] | None = None,
        low: int = 8,
        high: int = 120,
        seed: int = 0,
    ) -> None:
        self.base_url = base_url
        self.concurrency = concurrency
        self.headers = headers
        self.low, self.high = low, high
        self.seed = seed
        self.outcomes: list[Outcome] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Load:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self._tasks = [asyncio.create_task(self._loop(i)) for i in range(self.concurrency)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        # Each loop finishes the request it is in: nothing is abandoned half-way.
        await asyncio.gather(*self._tasks)
        assert self._session is not None
        await self._session.close()

    async def _loop(self, index: int) -> None:
        assert self._session is not None
        rng = random.Random(self.seed * 1000 + index)
        stream = index % 2 == 0
        while not self._stop.is_set():
            job = random_job(rng, stream=stream, low=self.low, high=self.high)
            stream = not stream
            outcome = await run_job(self._session, self.base_url, job, headers=self.headers)
            self.outcomes.append(outcome)
            if outcome.status == 503:  # not ready (NATS down): as a client would, back off
                await asyncio.sleep(0.2)


# --------------------------------------------------------------------------- mesh helpers


def cards(mesh: Mesh) -> dict[str, dict[str, Any]]:
    return {w["id"]: w for w in mesh.server_info()["genmesh"]["workers"]}


def stats_total(mesh: Mesh, key: str) -> int:
    return sum(int(c["stats"][key]) for c in cards(mesh).values())


def inflight_total(mesh: Mesh) -> int:
    return sum(int(c["inflight"]) for c in cards(mesh).values())


def fd_count(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def until(predicate: Any, timeout: float, what: str, interval: float = 0.02) -> float:
    """Wait (off the event loop) until `predicate()`; return how long it took."""
    started = time.monotonic()
    await asyncio.to_thread(wait_until, predicate, timeout, interval, what)
    return time.monotonic() - started


def migrations_in(log: str) -> Counter[str]:
    """Migrations the frontend's client logged, by reason."""
    reasons: Counter[str] = Counter()
    for match in re.finditer(r"request \S+: attempt \d+ after: (.*?) \(\d+ tokens", log):
        reason = match.group(1)
        reasons[re.sub(r"\bworker w[0-9a-f]{8}\b", "worker W", reason)] += 1
    return reasons


@pytest.fixture
def own_mesh(nats_url: str, tmp_path: Path) -> Iterator[Mesh]:
    """An empty mesh for one test (its logs are attached to a failure report)."""
    mesh = Mesh(nats_url, tmp_path, unique_namespace("res"))
    yield mesh
    mesh.stop()


@pytest.fixture(scope="module")
def mesh(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """This module's shared mesh: 1 router, 2 *slow* mock workers with room for 1,000
    requests each, a frontend. (Named `mesh` so failures attach its logs.)"""
    slow = start_mesh(
        nats_url,
        tmp_path_factory.mktemp("slow"),
        namespace=unique_namespace("slow"),
        worker_opts={**WORKER_OPTS, "speedup": SLOW_SPEEDUP, "max_concurrency": 1000},
    )
    yield slow
    slow.stop()


# --------------------------------------------------------------------------- 1. drain


async def _start_in_flight(
    mesh: Mesh, session: aiohttp.ClientSession, workers: list[Service], jobs: list[Job]
) -> tuple[list[asyncio.Task[Outcome]], dict[str, int]]:
    """Send `jobs` and wait until `workers` admitted them all; how many each admitted."""
    before = {w.name: cards(mesh)[w.name]["stats"]["admitted"] for w in workers}
    tasks = [asyncio.create_task(run_job(session, mesh.http_url, job)) for job in jobs]

    def admitted() -> dict[str, int]:
        return {w: cards(mesh)[w]["stats"]["admitted"] - n for w, n in before.items()}

    await until(lambda: sum(admitted().values()) == len(jobs), 5, "the requests to start")
    return tasks, admitted()


@pytest.mark.chaos
async def test_drain_lets_in_flight_requests_finish(own_mesh: Mesh) -> None:
    """SIGTERM with a drain timeout long enough: the worker leaves discovery at once, new
    requests go to the other worker, and its own requests finish in place (no migration)."""
    own_mesh.add_router()
    frontend = own_mesh.add_frontend()
    # 0.25: about 23 ms a token, so these take 1.4-2.8 s; the drain allows 10 s.
    old = own_mesh.add_worker(speedup=0.25, drain_timeout=10, **WORKER_OPTS)
    other = own_mesh.add_worker(speedup=0.25, **WORKER_OPTS)
    rng = random.Random(1)
    jobs = [random_job(rng, stream=i % 2 == 0, low=60, high=120) for i in range(8)]
    async with aiohttp.ClientSession() as session:
        in_flight, admitted = await _start_in_flight(own_mesh, session, [old, other], jobs)
        assert admitted[old.name] >= 2, admitted  # round robin: about half each
        old.process.send_signal(signal.SIGTERM)
        sigterm = time.monotonic()
        left = await until(
            lambda: old.name not in own_mesh.worker_ids(), 2.0, "the drained worker to leave"
        )
        assert left < 1.0, f"it took {left:.2f}s to leave discovery"
        assert old.alive, "it left discovery but must still be draining"

        # New requests go elsewhere while the old worker drains.
        fresh = [random_job(rng, stream=i % 2 == 0, low=4, high=12) for i in range(8)]
        answers = await asyncio.gather(*(run_job(session, own_mesh.http_url, j) for j in fresh))
        assert all(a.ok for a in answers), [(a.error, a.wrong) for a in answers if not a.ok]
        outcomes = await asyncio.gather(*in_flight)
        drained = time.monotonic() - sigterm
    assert all(o.ok for o in outcomes), [(o.error, o.wrong) for o in outcomes if not o.ok]
    assert await asyncio.to_thread(old.process.wait, 10) == 0
    exited = time.monotonic() - sigterm
    draining = re.search(r"draining (\d+) requests", old.log())
    assert draining is not None
    assert int(draining.group(1)) >= 1
    assert "rejected request" not in old.log()  # nothing new was sent to it
    # The other worker served the new requests and nothing else: no request migrated.
    expected = admitted[other.name] + len(fresh)
    await until(lambda: cards(own_mesh)[other.name]["inflight"] == 0, 5, "the other to finish")
    assert cards(own_mesh)[other.name]["stats"]["admitted"] == expected
    assert cards(own_mesh)[other.name]["stats"]["completed"] == expected
    assert not migrations_in(frontend.log())
    report(
        "drain (in-flight fits the drain timeout)",
        in_flight_on_drained_worker=int(draining.group(1)),
        completed_in_place=sum(o.ok for o in outcomes),
        left_discovery_s=round(left, 3),
        last_in_flight_done_s=round(drained, 2),
        worker_exited_s=round(exited, 2),
    )


@pytest.mark.chaos
async def test_drain_timeout_hands_the_rest_over(own_mesh: Mesh) -> None:
    """SIGTERM with a short drain timeout: what is still running is handed back and
    continues on the other worker; the answers equal uninterrupted runs', event for event."""
    own_mesh.add_router()
    frontend = own_mesh.add_frontend()
    # 0.1: about 57 ms a token: 3.4-6.9 s of work; the drain allows only 0.5 s.
    old = own_mesh.add_worker(speedup=0.1, drain_timeout=0.5, **WORKER_OPTS)
    other = own_mesh.add_worker(speedup=1.0, **WORKER_OPTS)
    rng = random.Random(2)
    # Both formats, SSE and unary.
    jobs = [random_job(rng, stream=i % 2 == 0, low=60, high=120) for i in range(8)]
    async with aiohttp.ClientSession() as session:
        in_flight, admitted = await _start_in_flight(own_mesh, session, [old, other], jobs)
        assert admitted[old.name] >= 2, admitted
        await asyncio.sleep(0.3)  # a few tokens in
        sigterm = time.monotonic()
        code = await asyncio.to_thread(old.terminate)
        exited = time.monotonic() - sigterm
        outcomes = await asyncio.gather(*in_flight)
        # The same requests, uninterrupted, on the remaining worker.
        reruns = await asyncio.gather(*(run_job(session, own_mesh.http_url, j) for j in jobs))
    assert code == 0
    assert exited < 0.5 + 2.0, f"the worker took {exited:.2f}s to stop"
    assert all(o.ok for o in outcomes), [(o.error, o.wrong) for o in outcomes if not o.ok]
    assert all(r.ok for r in reruns)
    for moved, straight in zip(outcomes, reruns, strict=True):
        assert normalized(moved.events) == normalized(straight.events), moved.job
    # Every request of the drained worker was handed over, once, to the other one.
    reasons = migrations_in(frontend.log())
    assert reasons == {"worker is shutting down": admitted[old.name]}, reasons
    # The other worker: its own share, the handed-over continuations, and the reruns.
    assert cards(own_mesh)[other.name]["stats"]["admitted"] == 2 * len(jobs)
    report(
        "drain (short drain timeout: hand over)",
        in_flight_on_drained_worker=admitted[old.name],
        migrated=sum(reasons.values()),
        completed_correctly=sum(o.ok for o in outcomes),
        worker_exited_s=round(exited, 2),
    )


def normalized(events: list[Any]) -> list[Any]:
    """Events without what differs between two runs of the same request (ids, timings)."""

    def clean(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {
                k: clean(v) for k, v in obj.items() if k not in ("id", "request_id", "e2e_latency")
            }
        if isinstance(obj, list):
            return [clean(v) for v in obj]
        return obj

    return [clean(e) for e in events]


@pytest.mark.chaos
async def test_rolling_restart_under_load_loses_nothing(own_mesh: Mesh) -> None:
    """Every worker SIGTERMed in turn (each replaced, and the replacement discovered, before
    the next) under 24 concurrent clients (SSE and unary, SGLang and vLLM): no request
    fails and every answer equals an uninterrupted run's."""
    own_mesh.add_router()
    frontend = own_mesh.add_frontend()
    # 0.5: about 11.5 ms a token, so requests take 0.1-1.7 s against a 1 s drain timeout:
    # most finish in place, the longest are handed over.
    opts = {"speedup": 0.5, "drain_timeout": 1.0, **WORKER_OPTS}
    originals = [own_mesh.add_worker(**opts) for _ in range(3)]
    restarts: list[dict[str, float]] = []
    async with Load(own_mesh.http_url, 24, high=150, seed=3) as load:
        await asyncio.sleep(1.0)
        for old in originals:
            started = time.monotonic()
            code = await asyncio.to_thread(old.terminate)
            assert code == 0, old.log()[-3000:]
            stopped = time.monotonic()
            await asyncio.to_thread(own_mesh.add_worker, **opts)  # returns once discovered
            restarts.append(
                {
                    "stop_s": round(stopped - started, 2),
                    "replace_s": round(time.monotonic() - stopped, 2),
                }
            )
            await asyncio.sleep(0.5)
        await asyncio.sleep(0.5)
    outcomes = load.outcomes
    lost = [o for o in outcomes if o.error]
    wrong = [o for o in outcomes if o.wrong]
    reasons = migrations_in(frontend.log())
    report(
        "rolling restart (3 workers, 24 concurrent clients)",
        requests=len(outcomes),
        sse=sum(o.job.stream for o in outcomes),
        unary=sum(not o.job.stream for o in outcomes),
        vllm=sum(o.job.fmt == "vllm" for o in outcomes),
        lost=len(lost),
        wrong=len(wrong),
        migrations=dict(reasons),
        restarts=restarts,
    )
    assert not lost, [(o.job, o.error) for o in lost[:5]]
    assert not wrong, [(o.job, o.wrong) for o in wrong[:5]]
    assert len(outcomes) > 50
    assert sum(reasons.values()) > 0, "no request was long enough to be handed over"


# --------------------------------------------------------------------------- 2. NATS outage


@dataclass
class HealthProbe:
    """Polls the frontend's /health every 50 ms: (time.monotonic(), status, text)."""

    url: str
    seen: list[tuple[float, int, str]]

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=1.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                try:
                    async with session.get(self.url + "/health") as resp:
                        self.seen.append((time.monotonic(), resp.status, await resp.text()))
                except (aiohttp.ClientError, TimeoutError) as exc:
                    self.seen.append((time.monotonic(), 0, repr(exc)))
                await asyncio.sleep(0.05)

    def first(self, since: float, status: int) -> float:
        """Seconds from `since` to the first probe with `status` after it."""
        for at, got, _ in self.seen:
            if at >= since and got == status:
                return at - since
        raise AssertionError(f"/health never answered {status} after the mark: {self.seen[-5:]}")

    async def wait_for(self, since: float, status: int, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(AssertionError):
                return self.first(since, status)
            await asyncio.sleep(0.02)
        return self.first(since, status)

    def between(self, start: float, end: float) -> list[tuple[int, str]]:
        return [(status, text) for at, status, text in self.seen if start <= at < end]


def _clear_error(outcome: Outcome) -> bool:
    """An HTTP 503/504, or an in-band error after a 200, with a message in the format's
    error shape (`run_job` reads the message out of that shape)."""
    match = re.fullmatch(r"(HTTP (503|504)|in-band error after HTTP 200): (.+)", outcome.error)
    return match is not None and match.group(3) != "None"


def _error_kind(error: str) -> str:
    return re.sub(r"\bw[0-9a-f]{8}\b", "W", re.sub(r"'outage\d+'", "'NS'", error))


@dataclass
class Outage:
    down_for_s: float
    killed: float = 0.0
    restarted: float = 0.0
    recovered: float = 0.0
    health_503_s: float = 0.0
    health_200_s: float = 0.0

    def summary(self, outcomes: list[Outcome], probe: HealthProbe) -> dict[str, Any]:
        in_flight = [o for o in outcomes if o.started < self.killed < o.ended]
        during = [o for o in outcomes if self.killed <= o.started < self.recovered]
        errors = Counter(_error_kind(o.error) for o in in_flight if o.error)
        health = Counter(
            _error_kind(t) for s, t in probe.between(self.killed, self.recovered) if s != 200
        )
        return {
            "down_for_s": self.down_for_s,
            "in_flight_at_kill": len(in_flight),
            "in_flight_completed": sum(o.ok for o in in_flight),
            "in_flight_failed": sum(not o.ok for o in in_flight),  # each with a clear error
            "in_flight_errors": dict(errors),
            "sent_while_not_ready": dict(Counter(o.status for o in during)),
            "health_503_after_kill_s": round(self.health_503_s, 3),
            "health_200_after_restart_s": round(self.health_200_s, 3),
            "health_while_not_ready": dict(health),
        }


@pytest.mark.chaos
async def test_nats_restart_under_load(tmp_path: Path) -> None:
    """Kill the NATS server under load and restart it on the same port, twice: a short blip,
    then an outage past discovery's expiry (3 heartbeats). /health follows, nothing hangs
    past its deadline, and service resumes."""
    port = free_port()
    servers = [NatsServer(port=port)]
    url = servers[0].start()
    mesh = Mesh(url, tmp_path, unique_namespace("outage"))
    timeout_s, margin_s = 4.0, 0.5
    outages = [Outage(0.3), Outage(3.5)]
    try:
        mesh.add_router()
        frontend = mesh.add_frontend()
        for _ in range(2):
            mesh.add_worker(speedup=0.5, **WORKER_OPTS)
        probe = HealthProbe(mesh.http_url, [])
        probing = asyncio.create_task(probe.run())
        headers = {TIMEOUT_HEADER: str(timeout_s)}
        async with Load(mesh.http_url, 12, headers=headers, high=100, seed=4) as load:
            for outage in outages:
                await asyncio.sleep(1.5)  # steady load
                outage.killed = time.monotonic()
                await asyncio.to_thread(servers[-1].kill)
                outage.health_503_s = await probe.wait_for(outage.killed, 503, 2.0)
                await asyncio.sleep(max(0.0, outage.killed + outage.down_for_s - time.monotonic()))
                servers.append(NatsServer(port=port))
                outage.restarted = time.monotonic()
                await asyncio.to_thread(servers[-1].start)
                outage.health_200_s = await probe.wait_for(outage.restarted, 200, 10.0)
                outage.recovered = outage.restarted + outage.health_200_s
            await asyncio.sleep(1.5)  # load after the recovery
        # Fresh requests after the recovery, one of each kind.
        async with aiohttp.ClientSession() as session:
            rng = random.Random(5)
            fresh = await asyncio.gather(
                *(run_job(session, mesh.http_url, random_job(rng, stream=s)) for s in (True, False))
            )
        probing.cancel()
        await asyncio.gather(probing, return_exceptions=True)
        alive = [s.name for s in mesh.services if s.alive]
    except BaseException:
        print(mesh.logs())
        raise
    finally:
        mesh.stop()
        for server in servers:
            server.stop()

    outcomes = load.outcomes
    blip, long = outages
    after = [o for o in outcomes if o.started >= long.recovered]
    report(
        "NATS restart under load (12 clients, X-Request-Timeout 4 s)",
        requests=len(outcomes),
        short_blip=blip.summary(outcomes, probe),
        long_outage=long.summary(outcomes, probe),
        sent_after_recovery=len(after),
        failed_after_recovery=sum(not o.ok for o in after),
        slowest_answer_s=round(max(o.elapsed for o in outcomes), 2),
    )
    assert len(alive) == len(mesh.services), "a service died in the outage"
    for outage in outages:
        # /health: 503 within a second of the kill, saying why, until the restart.
        assert outage.health_503_s < 1.0
        first_503 = probe.between(outage.killed, outage.killed + outage.health_503_s + 0.01)
        assert first_503[-1] == (503, "genmesh is not ready: not connected to NATS")
        down = probe.between(outage.killed + outage.health_503_s, outage.restarted)
        assert all(s == 503 for s, _ in down)
        not_ready = probe.between(outage.killed + outage.health_503_s, outage.recovered)
        assert all(t.startswith("genmesh is not ready: ") for _, t in not_ready)
    assert all(s == 200 for s, _ in probe.between(0, blip.killed))
    assert all(s == 200 for s, _ in probe.between(blip.recovered, long.killed))
    assert all(s == 200 for s, _ in probe.between(long.recovered, time.monotonic()))
    # Nothing hung: every request had its answer within its deadline and a margin.
    slow = [o for o in outcomes if o.elapsed > timeout_s + margin_s]
    assert not slow, [(o.elapsed, o.error) for o in slow]
    assert not [o for o in outcomes if o.wrong]  # an answer is right, or it is an error
    # Each failure says what happened, in the format's error shape: 503 (not ready, or
    # nothing to route to while the mesh finds itself again) or 504 (the deadline).
    assert all(o.status in (200, 503, 504) for o in outcomes), Counter(o.status for o in outcomes)
    unclear = [o.error for o in outcomes if o.error and not _clear_error(o)]
    assert not unclear, unclear
    # Once /health says 200, requests succeed.
    assert after
    assert all(o.ok for o in after), [o.error for o in after if not o.ok]
    assert all(o.ok for o in fresh), [o.error for o in fresh]
    assert frontend.log().count("reconnected") == 2


@pytest.mark.inproc
@pytest.mark.parametrize("still_running", [False, True])
async def test_a_stream_whose_last_frames_were_lost_migrates(
    nats_url: str, still_running: bool
) -> None:
    """The outage case the sequence numbers cannot catch: the *last* frames of a stream are
    lost (published while the requester was reconnecting), so no later frame shows a gap.
    The requester's ping names the request; a worker that no longer runs it says so, and
    the request continues elsewhere at once instead of waiting for its idle timeout. A
    worker that still runs it (just slow) keeps the stream."""
    namespace = unique_namespace("tail")
    subjects = Subjects(namespace)
    codec = get_codec(None)
    nc = await nats.connect(nats_url)
    pings: list[bytes] = []
    replies: dict[str, str] = {}

    async def route(msg: Any) -> None:  # plays router and worker
        env = codec.decode(msg.data)
        rid, reply = env["id"], msg.reply
        second = rid.endswith("~2")
        worker = "wnext" if second else "wlost"
        replies[rid] = reply
        await nc.publish(reply, codec.encode(ack_frame(rid, worker, dispatch=rid)))
        if second:
            end = {"t": "end", "id": rid, "seq": 1, "tokens": [2], "finish": {"reason": "length"}}
            await nc.publish(reply, codec.encode(end | {"usage": {}}))
        else:  # one token, then the rest of the stream "lost"
            await nc.publish(reply, codec.encode({"t": "out", "id": rid, "seq": 1, "tokens": [1]}))

    async def pong(msg: Any) -> None:
        pings.append(msg.data)
        await nc.publish(msg.reply, b"" if still_running else b"not running")

    await nc.subscribe(subjects.router_generate, cb=route)
    await nc.subscribe(subjects.worker_ping("wlost"), cb=pong)
    await flush_in_order(nc)  # live before the client (another connection) sends
    try:
        async with await MeshClient.connect(
            nats_url, namespace, ping_after_s=0.2, idle_timeout_s=1.5
        ) as client:
            env = request([7], max_tokens=2)
            started = time.monotonic()
            got = [f async for f in client.generate(env)]
            elapsed = time.monotonic() - started
    finally:
        await nc.close()
    assert pings
    assert pings[0] == env.id.encode()  # the ping names the attempt
    assert [f["t"] for f in got] == ["ack", "out", "mig", "ack", "end"]
    if still_running:  # alive and running: only the idle timeout ends the wait
        assert got[2]["reason"] == MigrationReason.IDLE_TIMEOUT
        assert got[2]["message"] == "no worker sent a frame within 1.5s"
        assert elapsed >= 1.5
    else:
        assert got[2]["reason"] == MigrationReason.NOT_RUNNING
        assert (
            got[2]["message"]
            == "worker wlost no longer runs the request (its last frames were lost)"
        )
        assert got[2]["delivered"] == 1
        assert elapsed < 0.2 + 0.5
    assert [t for f in got if f["t"] in ("out", "end") for t in f["tokens"]] == [1, 2]


# --------------------------------------------------------------------------- 3. cancellation


def _frontend(mesh: Mesh) -> Service:
    return next(s for s in mesh.services if s.role == "frontend")


def _service_fds(mesh: Mesh) -> dict[str, int]:
    return {s.name: fd_count(s.pid) for s in mesh.services if s.role in ("frontend", "worker")}


async def _settled_service_fds(mesh: Mesh) -> dict[str, int]:
    """The services' fd counts once they hold still (the frontend closes the sockets of
    our last /get_server_info calls a moment after they end)."""
    last = _service_fds(mesh)
    for _ in range(20):
        await asyncio.sleep(0.1)
        now = _service_fds(mesh)
        if now == last:
            return now
        last = now
    return last


async def _all_cancelled(mesh: Mesh, cancelled_before: int, n: int) -> float:
    """Seconds until the workers report `n` more cancelled requests and none in flight."""
    return await until(
        lambda: (
            stats_total(mesh, "cancelled") - cancelled_before == n and inflight_total(mesh) == 0
        ),
        20,
        f"{n} engine requests to be cancelled",
    )


async def test_a_thousand_nats_streams_cancelled_at_once(mesh: Mesh, nats_url: str) -> None:
    """1,000 MeshClient.generate streams on slow workers, their tasks cancelled at once:
    every engine request is cancelled (worker stats, inflight 0), and neither this process
    (streams, subscriptions, tasks, fds) nor the services (fds) keep anything."""
    n = 1000
    before = {k: stats_total(mesh, k) for k in ("admitted", "cancelled", "completed")}
    fds_before = await _settled_service_fds(mesh)
    # No pings: they would open the request inbox of nats-py, one subscription more.
    client = await MeshClient.connect(nats_url, mesh.namespace, ping_after_s=60)
    try:
        subs, tasks_before, fds = len(client.nc._subs), len(asyncio.all_tasks()), fd_count()
        acked = asyncio.Semaphore(0)

        async def consume(i: int) -> None:
            env = request([i % VOCAB, 1, 2], max_tokens=2000, ignore_eos=True)
            async for frame in client.generate(env):
                if frame["t"] == "ack":
                    acked.release()

        tasks = [asyncio.create_task(consume(i)) for i in range(n)]
        async with asyncio.timeout(30):
            for _ in range(n):
                await acked.acquire()
        assert client.active_streams == n
        await until(lambda: inflight_total(mesh) == n, 10, "the workers to report 1000")

        cancelled = time.monotonic()
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        local_s = time.monotonic() - cancelled
        assert all(isinstance(r, asyncio.CancelledError) for r in results)
        await _all_cancelled(mesh, before["cancelled"], n)
        engines_s = time.monotonic() - cancelled
        await flush_in_order(client.nc)
        # Nothing is left behind in this process.
        assert client.active_streams == 0
        assert client._by_worker == {}
        assert len(client.nc._subs) == subs
        assert len(asyncio.all_tasks()) == tasks_before
        assert fd_count() == fds
    finally:
        await client.close()
    assert stats_total(mesh, "admitted") - before["admitted"] == n
    assert stats_total(mesh, "completed") == before["completed"]
    await until(lambda: _service_fds(mesh) == fds_before, 5, "service fds back to before")
    report(
        "1,000 NATS streams cancelled at once",
        streams=n,
        tasks_done_s=round(local_s, 3),
        all_engine_requests_cancelled_s=round(engines_s, 3),
        service_fds=fds_before,
    )


async def test_a_thousand_sse_streams_closed_at_once(mesh: Mesh) -> None:
    """1,000 SSE requests from one aiohttp client, each past its first token, then every
    connection closed at once: every engine request is cancelled, and the frontend's and
    workers' fd counts (and this process's fds and tasks) return to what they were."""
    n = 1000
    before = {k: stats_total(mesh, k) for k in ("admitted", "cancelled", "completed")}
    fds_before = await _settled_service_fds(mesh)
    tasks_before, fds = len(asyncio.all_tasks()), fd_count()
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    responses: list[aiohttp.ClientResponse] = []
    streaming = asyncio.Semaphore(0)
    problems: list[str] = []

    async def open_stream(i: int) -> None:
        body = {
            "input_ids": [i % VOCAB, 3, 4],
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
            "stream": True,
        }
        try:
            resp = await session.post(mesh.http_url + SGLANG_PATH, json=body)
            responses.append(resp)
            if resp.status != 200:
                problems.append(f"HTTP {resp.status}")
            else:
                await resp.content.readuntil(b"\n\n")  # the first token is out
        except aiohttp.ClientError as exc:
            problems.append(repr(exc))
        streaming.release()
        await asyncio.Event().wait()  # hold the stream open until cancelled

    opening = time.monotonic()
    tasks = [asyncio.create_task(open_stream(i)) for i in range(n)]
    try:
        async with asyncio.timeout(60):
            for _ in range(n):
                await streaming.acquire()
        all_open_s = time.monotonic() - opening
        assert not problems, Counter(problems)
        await until(lambda: inflight_total(mesh) == n, 10, "the workers to report 1000")
        frontend_fds_open = fd_count(_frontend(mesh).pid)

        closed = time.monotonic()
        for resp in responses:
            resp.close()  # drops the connection
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await session.close()
    await _all_cancelled(mesh, before["cancelled"], n)
    engines_s = time.monotonic() - closed
    assert stats_total(mesh, "admitted") - before["admitted"] == n
    assert stats_total(mesh, "completed") == before["completed"]
    # No socket, task or connection left behind, here or in the services.
    await until(lambda: fd_count() == fds, 5, "this process's fds back to before")
    assert len(asyncio.all_tasks()) == tasks_before
    try:
        fds_back_s = await until(lambda: _service_fds(mesh) == fds_before, 10, "service fds")
    except TimeoutError:
        raise AssertionError(f"{fds_before} -> {_service_fds(mesh)}") from None
    report(
        "1,000 SSE streams closed at once",
        streams=n,
        all_streaming_after_s=round(all_open_s, 2),
        all_engine_requests_cancelled_s=round(engines_s, 3),
        frontend_fds_before_open_after=[
            fds_before[_frontend(mesh).name],
            frontend_fds_open,
            _service_fds(mesh)[_frontend(mesh).name],
        ],
        service_fds_back_after_s=round(fds_back_s, 3),
    )


# --------------------------------------------------------------------------- 4. deadlines


def _assert_504_shape(fmt: str, payload: Any) -> None:
    """A 504 in the format's own error shape."""
    message = "the request's deadline passed"
    if fmt == "sglang":  # SGLang raises 5xx as HTTPExceptions: the legacy shape
        assert payload == {
            "object": "error",
            "message": message,
            "type": "504",
            "param": None,
            "code": 504,
        }, payload
    else:
        assert payload == {
            "error": {"message": message, "type": "GatewayTimeoutError", "param": None, "code": 504}
        }, payload


async def _engine_work_ended(mesh: Mesh, before: dict[str, int], n: int) -> None:
    """`n` more requests ended at the workers without completing (cancelled at the deadline,
    by the worker's own timer or the frontend's cancel, whichever came first)."""

    def ended() -> bool:
        stopped = stats_total(mesh, "cancelled") + stats_total(mesh, "failed")
        return stopped - before["stopped"] == n and inflight_total(mesh) == 0

    await until(ended, 10, f"{n} requests to end at the workers")
    assert stats_total(mesh, "completed") == before["completed"]


def _stopped_before(mesh: Mesh) -> dict[str, int]:
    return {
        "stopped": stats_total(mesh, "cancelled") + stats_total(mesh, "failed"),
        "completed": stats_total(mesh, "completed"),
    }


async def test_request_timeout_header_is_a_504_that_stops_the_engine(mesh: Mesh) -> None:
    """X-Request-Timeout on slow requests (prefill alone takes ~0.8 s): before any output a
    504 in the format's error shape; after output started, the 504 error event in-band."""
    before = _stopped_before(mesh)
    slow = [
        Job(fmt, stream, (5, 6, 7), 200, 1)
        for fmt in ("sglang", "vllm")
        for stream in (False, True)
    ]
    started = [Job(fmt, True, (8, 9), 200, 2) for fmt in ("sglang", "vllm")]
    async with aiohttp.ClientSession() as session:
        early, late = await asyncio.gather(
            asyncio.gather(
                *(run_job(session, mesh.http_url, j, headers={TIMEOUT_HEADER: "0.5"}) for j in slow)
            ),
            asyncio.gather(
                *(
                    run_job(session, mesh.http_url, j, headers={TIMEOUT_HEADER: "1.5"})
                    for j in started
                )
            ),
        )
    for outcome in early:
        assert outcome.status == 504, outcome.error
        assert 0.5 <= outcome.elapsed < 0.5 + 0.5, outcome.elapsed
        (body,) = outcome.events
        _assert_504_shape(outcome.job.fmt, body)
    for outcome in late:
        assert outcome.status == 200
        assert 1.5 <= outcome.elapsed < 1.5 + 0.5, outcome.elapsed
        *tokens, error = outcome.events
        assert tokens, "output had started"
        _assert_504_shape(outcome.job.fmt, error)
    await _engine_work_ended(mesh, before, len(slow) + len(started))
    report(
        "X-Request-Timeout",
        answered_after_s=[round(o.elapsed, 3) for o in early + late],
        asked_s=[0.5] * len(early) + [1.5] * len(late),
    )


async def test_frontend_request_timeout_caps_every_request(mesh: Mesh, nats_url: str) -> None:
    """--request-timeout: every request's limit; a header may shorten it, never lengthen it."""
    frontend = await start_frontend(
        frontend_options(nats_url, mesh.namespace, request_timeout_s=0.6)
    )
    try:
        ready = frontend.state.backend.not_ready_reason
        await until(lambda: ready() is None, 5, "discovery")
        before = _stopped_before(mesh)
        url = f"http://127.0.0.1:{frontend.port}"
        job = Job("sglang", False, (1, 2), 200, 3)
        async with aiohttp.ClientSession() as session:
            plain, longer, shorter, vllm = await asyncio.gather(
                run_job(session, url, job),
                run_job(session, url, job, headers={TIMEOUT_HEADER: "30"}),
                run_job(session, url, job, headers={TIMEOUT_HEADER: "0.3"}),
                run_job(session, url, Job("vllm", True, (1, 2), 200, 3)),
            )
        for outcome, limit in ((plain, 0.6), (longer, 0.6), (shorter, 0.3), (vllm, 0.6)):
            assert outcome.status == 504, outcome.error
            assert limit <= outcome.elapsed < limit + 0.5, (limit, outcome.elapsed)
            _assert_504_shape(outcome.job.fmt, outcome.events[0])
        await _engine_work_ended(mesh, before, 4)
    finally:
        await frontend.close()


@pytest.mark.parametrize("value", ["abc", "0", "-1", "inf", "nan", ""])
async def test_a_bad_request_timeout_header_is_a_400(mesh: Mesh, value: str) -> None:
    async with aiohttp.ClientSession() as session:
        sglang, vllm = await asyncio.gather(
            *(
                run_job(
                    session,
                    mesh.http_url,
                    Job(f, False, (1,), 1, 0),
                    headers={TIMEOUT_HEADER: value},
                )
                for f in ("sglang", "vllm")
            )
        )
    message = "X-Request-Timeout must be a positive number of seconds"
    assert sglang.status == vllm.status == 400
    assert sglang.events == [{"error": {"message": message}}]
    assert vllm.events == [
        {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}
    ]


async def _raw_exchange(nats_url: str, namespace: str, envelope: dict[str, Any]) -> list[Any]:
    """Publish one envelope to the routers with a plain nats-py inbox; collect its frames."""
    codec = get_codec(None)
    nc = await nats.connect(nats_url, allow_reconnect=False)
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(Subjects(namespace).router_generate, codec.encode(envelope), reply=inbox)
        frames: list[Any] = []
        while not frames or frames[-1]["t"] not in ("end", "err"):
            msg = await sub.next_msg(timeout=10)
            frames.append(codec.decode(msg.data))
        return frames
    finally:
        await nc.close()


async def test_deadlines_at_nats_level(mesh: Mesh, nats_url: str) -> None:
    """An envelope's deadline, without the HTTP frontend: past at admission, or reached
    while running (the worker's own timer), or through MeshClient; `deadline_exceeded`."""
    before = _stopped_before(mesh)
    # A deadline already past: the worker refuses the request outright.
    past = request([1, 2], max_tokens=50).to_wire() | {"deadline": time.time() - 1}
    (frame,) = await _raw_exchange(nats_url, mesh.namespace, past)
    assert frame["t"] == "err"
    assert frame["code"] == "deadline_exceeded"
    assert frame["retryable"] is False
    assert "origin" not in frame  # the worker's, not made up by a client

    # A near deadline: admitted, then ended by the worker's own timer, client or not.
    near = request([1, 2], max_tokens=50).to_wire() | {"deadline": time.time() + 0.4}
    started = time.monotonic()
    frames = await _raw_exchange(nats_url, mesh.namespace, near)
    elapsed = time.monotonic() - started
    assert [f["t"] for f in frames] == ["ack", "err"]  # prefill takes ~0.8 s
    assert frames[-1]["code"] == "deadline_exceeded"
    assert "origin" not in frames[-1]
    assert [f["seq"] for f in frames] == [0, 1]
    assert 0.3 < elapsed < 0.4 + 0.3

    # Through MeshClient: the same, and never a migration.
    async with await MeshClient.connect(nats_url, mesh.namespace) as client:
        env = request([1, 2], max_tokens=50)
        env.deadline = time.time() + 0.4
        started = time.monotonic()
        frames = [f async for f in client.generate(env)]
        elapsed = time.monotonic() - started
    assert [f["t"] for f in frames] == ["ack", "err"]
    assert frames[-1]["code"] == "deadline_exceeded"
    assert elapsed < 0.4 + 0.3
    await _engine_work_ended(mesh, before, 2)


@pytest.mark.chaos
def test_services_stop_cleanly_while_nats_is_down(tmp_path: Path) -> None:
    """Asked to stop in an outage (or after a Ctrl-C took NATS down first), a service has
    no server to drain to: it closes, exits 0 at once and logs no traceback."""
    server = NatsServer()
    mesh = Mesh(server.start(), tmp_path, unique_namespace("stopdown"))
    try:
        mesh.add_router()
        mesh.add_worker()
        mesh.add_frontend()
        server.kill()
        for service in list(mesh.services):
            wait_until(
                lambda s=service: "disconnected from" in s.log(), what=f"{service.name} to notice"
            )
            code = service.terminate(timeout=5.0)  # killed (-9) if it does not stop by then
            log = service.log()
            assert code == 0, log[-3000:]
            assert "Traceback" not in log, log[-3000:]
    finally:
        mesh.stop()
        server.stop()

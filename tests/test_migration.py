"""Mid-stream migration, end to end: the law, refusals, the limit, the NATS-level view.

The law: for any request, a client whose worker fails mid-stream (its engine breaks, or
the worker process is SIGKILLed) gets exactly what an uninterrupted run returns: the same
tokens, logprobs, routed experts, finish reason and usage, unary and SSE, SGLang and vLLM
formats, through the in-process mock engine and through the SGLang and vLLM adapters in
front of failing mock servers. The uninterrupted run is the same request sent first,
with no fault, through the same mesh.

Where the fault lands: every mesh here routes round robin (in its one frontend, or its one
router for NATS-level requests), so after a request served by worker i the next goes to
worker i+1 (in id order). Each example learns i from
the workers' request counters during its uninterrupted run and queues the fault on i+1
only; a fault queued on every worker would also hit the continuations (each attempt
excludes only the workers that failed it).

Case counts: GENMESH_LAW_EXAMPLES (default 25) examples of the law with injected engine
faults on mock workers, GENMESH_ADAPTER_LAW_EXAMPLES (default 10) per engine adapter, and
8 fixed SIGKILL cases. Each law test prints how many examples it ran (`pytest -s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import nats
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.aio.msg import Msg

from genmesh.client import MIG, MeshClient, MigrationReason, request
from genmesh.shared import frames
from genmesh.shared.bus import flush_in_order
from genmesh.shared.subjects import Subjects
from tests.answers import Case, Result, call, cases, content, differences, token_count
from tests.conftest import unique_namespace
from tests.inproc import AnyMesh, InProcessMesh, start_inproc_mesh
from tests.mesh import Mesh, Service, start_mesh, wait_until

pytestmark = pytest.mark.inproc

VOCAB, EOS = 64, 7  # a small vocabulary, so stop tokens and EOS do end generations
SPEEDUP = 2.0  # the mock engine: ~8 ms prefill, ~3 ms a token
TOKEN_DELAY_MS = 2  # the mock engine servers
LAW_EXAMPLES = int(os.environ.get("GENMESH_LAW_EXAMPLES", "25"))
ADAPTER_EXAMPLES = int(os.environ.get("GENMESH_ADAPTER_LAW_EXAMPLES", "10"))
WORKER_OPTS: dict[str, Any] = {
    "speedup": SPEEDUP,
    "vocab_size": VOCAB,
    "eos_token_id": EOS,
    "testkit_faults": True,
    # Discovery drops a SIGKILLed worker after 3 missed heartbeats: 1.5 s, not 3 s.
    "heartbeat": 0.5,
}
# Engine failures the law covers; `hang` waits for the idle timeout: a test of its own.
MOCK_FAULTS = ("drop", "no_terminal", "done_early", "http_error", "abort")
# The vLLM mock's abort is a finish reason (the request ends, 200), not a failure.
SERVER_FAULTS = {"sglang": MOCK_FAULTS, "vllm": ("drop", "no_terminal", "done_early", "http_error")}
ATTEMPT_LOG = re.compile(r"request (\S+): attempt (\d+) after: (.*) \((\d+) tokens delivered\)")


@dataclass(frozen=True)
class FaultDraw:
    kind: str
    status: int
    where: int  # per mille of the uninterrupted run's tokens


@st.composite
def faults(draw: st.DrawFn, kinds: tuple[str, ...] = MOCK_FAULTS) -> FaultDraw:
    kind = draw(st.sampled_from(kinds))
    status = draw(st.sampled_from([503, 500])) if kind == "http_error" else 500
    return FaultDraw(kind, status, draw(st.integers(0, 999)))


# ---------------------------------------------------------------- fault control


class FaultControl:
    """Faults and request counters of a mesh's engines, by worker id."""

    worker_ids: list[str]

    async def received(self) -> dict[str, int]:
        raise NotImplementedError

    async def inject(self, worker_id: str, fault: dict[str, Any]) -> None:
        raise NotImplementedError

    async def pending(self, worker_id: str) -> int:
        raise NotImplementedError

    async def running(self, worker_id: str) -> list[str]:
        raise NotImplementedError

    async def clear(self) -> None:
        raise NotImplementedError


class WorkerFaults(FaultControl):
    """Workers started with --testkit-faults: faults go over NATS to their FaultyEngine."""

    def __init__(self, nc: Any, mesh: AnyMesh) -> None:
        self.nc = nc
        self.mesh = mesh
        self.worker_ids = sorted(w.name for w in mesh.workers)

    async def _ask(self, worker_id: str, body: dict[str, Any]) -> dict[str, Any]:
        subject = Subjects(self.mesh.namespace).testkit(worker_id)
        msg = await self.nc.request(subject, json.dumps(body).encode(), timeout=5)
        answer: dict[str, Any] = json.loads(msg.data)
        assert "error" not in answer, answer
        return answer

    async def received(self) -> dict[str, int]:
        states = await asyncio.gather(*(self._ask(w, {}) for w in self.worker_ids))
        return {w: s["received"] for w, s in zip(self.worker_ids, states, strict=True)}

    async def inject(self, worker_id: str, fault: dict[str, Any]) -> None:
        await self._ask(worker_id, fault)

    async def pending(self, worker_id: str) -> int:
        return len((await self._ask(worker_id, {}))["faults_pending"])

    async def running(self, worker_id: str) -> list[str]:
        return list((await self._ask(worker_id, {}))["running"])

    async def clear(self) -> None:
        await asyncio.gather(*(self._ask(w, {"clear": True}) for w in self.worker_ids))


class ServerFaults(FaultControl):
    """Workers in front of mock engine servers: faults go to the servers' admin routes."""

    def __init__(self, session: aiohttp.ClientSession, servers: dict[str, str]) -> None:
        self.session = session
        self.servers = servers  # worker id -> its server's URL
        self.worker_ids = sorted(servers)

    async def _state(self, worker_id: str) -> dict[str, Any]:
        async with self.session.get(self.servers[worker_id] + "/testkit/state") as resp:
            state: dict[str, Any] = await resp.json()
            return state

    async def received(self) -> dict[str, int]:
        states = await asyncio.gather(*(self._state(w) for w in self.worker_ids))
        return {w: s["received"] for w, s in zip(self.worker_ids, states, strict=True)}

    async def inject(self, worker_id: str, fault: dict[str, Any]) -> None:
        url = self.servers[worker_id] + "/testkit/faults"
        async with self.session.post(url, json=fault) as resp:
            assert resp.status == 200, await resp.text()

    async def pending(self, worker_id: str) -> int:
        return len((await self._state(worker_id))["faults_pending"])

    async def running(self, worker_id: str) -> list[str]:
        return list((await self._state(worker_id))["running"])

    async def clear(self) -> None:
        for url in self.servers.values():
            async with self.session.delete(url + "/testkit/faults") as resp:
                assert resp.status == 200


@contextlib.asynccontextmanager
async def worker_faults(mesh: AnyMesh) -> AsyncIterator[WorkerFaults]:
    nc = await nats.connect(mesh.nats_url)
    try:
        yield WorkerFaults(nc, mesh)
    finally:
        await nc.close()


async def landing(
    control: FaultControl, run: Callable[[], Awaitable[Result]]
) -> tuple[str, Result]:
    """Run a request; return the worker that served it (exactly one) and its result."""
    before = await control.received()
    result = await run()
    after = await control.received()
    served = [w for w in control.worker_ids if after[w] != before[w]]
    assert len(served) == 1, (before, after)
    return served[0], result


def successor(control: FaultControl, worker_id: str) -> str:
    """Where round-robin routing sends the next request."""
    ordered = control.worker_ids
    return ordered[(ordered.index(worker_id) + 1) % len(ordered)]


def attempts_logged(frontend: Any) -> list[tuple[str, int, str, int]]:
    return [(m[1], int(m[2]), m[3], int(m[4])) for m in ATTEMPT_LOG.finditer(frontend.log())]


def frontend_of(mesh: AnyMesh) -> Any:
    return next(s for s in mesh.services if s.role == "frontend")


async def check_law(mesh: AnyMesh, control: FaultControl, case: Case, fault: FaultDraw) -> None:
    """The uninterrupted run, then the same request with `fault` where it will land."""
    served, reference = await landing(control, lambda: call(mesh, case.fmt, case.body, case.stream))
    expected = content(case.fmt, case.body, reference)
    n = token_count(case.fmt, expected)
    assert n >= 1
    victim = successor(control, served)
    spec = {"kind": fault.kind, "status": fault.status, "after_tokens": fault.where * n // 1000}
    frontend = frontend_of(mesh)
    logged = len(attempts_logged(frontend))
    await control.inject(victim, spec)
    try:
        result = await call(mesh, case.fmt, case.body, case.stream)
        assert await control.pending(victim) == 0, f"the request did not reach {victim}"
    finally:
        await control.clear()
    assert result.status == 200, (spec, result.body, result.events)
    got = content(case.fmt, case.body, result)
    assert got == expected, (spec, differences(got, expected))
    # It did fail, and moved once: its first attempt failed, the second did not.
    attempts = attempts_logged(frontend)[logged:]
    assert [n for _, n, _, _ in attempts] == [2], (spec, attempts)
    delivered = attempts[0][3]
    if isinstance(control, WorkerFaults):
        wanted = 0 if fault.kind == "http_error" else spec["after_tokens"]
        assert delivered == wanted, (spec, attempts)
    else:  # through an adapter, a dropped connection may lose what was in flight
        assert delivered <= spec["after_tokens"], (spec, attempts)


def run_law(
    mesh: AnyMesh,
    make_control: Callable[[], contextlib.AbstractAsyncContextManager[FaultControl]],
    examples: int,
    strategy: st.SearchStrategy[tuple[Case, FaultDraw]],
    label: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ran = 0

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,  # CI runs the same cases every time
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(strategy)
    def law(drawn: tuple[Case, FaultDraw]) -> None:
        nonlocal ran
        ran += 1
        case, fault = drawn

        async def example() -> None:
            async with make_control() as control:
                await check_law(mesh, control, case, fault)

        asyncio.run(example())

    started = time.monotonic()
    law()
    with capsys.disabled():
        print(f"\n{label}: {ran} examples in {time.monotonic() - started:.1f}s", end="")
    assert ran >= min(examples, 5)


# ---------------------------------------------------------------- the mock-engine mesh


@pytest.fixture(scope="module")
def law_mesh(nats_url: str) -> Iterator[InProcessMesh]:
    """1 router (round robin), 3 mock workers with injectable faults, a frontend; in
    process (faults are injected over NATS, nothing is killed)."""
    mesh = start_inproc_mesh(
        nats_url, namespace=unique_namespace("law"), workers=3, worker_opts=WORKER_OPTS
    )
    yield mesh
    mesh.stop()


@pytest.fixture(scope="module")
def kill_mesh(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """The law mesh as OS processes, for the law with SIGKILL."""
    mesh = start_mesh(
        nats_url,
        tmp_path_factory.mktemp("law"),
        namespace=unique_namespace("kill"),
        workers=3,
        worker_opts=WORKER_OPTS,
    )
    yield mesh
    mesh.stop()


def test_the_law_with_engine_faults(
    law_mesh: InProcessMesh, capsys: pytest.CaptureFixture[str]
) -> None:
    run_law(
        law_mesh,
        lambda: worker_faults(law_mesh),
        LAW_EXAMPLES,
        st.tuples(cases(VOCAB), faults()),
        "migration law, engine faults, mock workers",
        capsys,
    )


# ---------------------------------------------------------------- refusal


REFUSING = {
    "sglang": {
        "input_ids": [3, 1, 4, 1, 5],
        "rid": "refusing",
        "sampling_params": {"max_new_tokens": 20, "ignore_eos": True, "presence_penalty": 0.5},
    },
    "vllm": {
        "token_ids": [3, 1, 4, 1, 5],
        "request_id": "refusing",
        "sampling_params": {"max_tokens": 20, "ignore_eos": True, "frequency_penalty": 0.5},
    },
}


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "sse"])
async def test_a_refusing_request_fails_with_the_reason_after_tokens(
    law_mesh: InProcessMesh, fmt: str, stream: bool
) -> None:
    penalty = "presence_penalty" if fmt == "sglang" else "frequency_penalty"
    async with worker_faults(law_mesh) as control:
        served, _ = await landing(control, lambda: call(law_mesh, fmt, REFUSING[fmt], False))
        await control.inject(successor(control, served), {"kind": "drop", "after_tokens": 4})
        before = await control.received()
        try:
            result = await call(law_mesh, fmt, REFUSING[fmt], stream)
            after = await control.received()
        finally:
            await control.clear()
    assert sum(after.values()) - sum(before.values()) == 1  # no second attempt
    reason = (
        f"(not migrated: {penalty} counts generated tokens, which a continuation sees as prompt)"
    )
    if not stream:
        assert result.status == 503
        message = result.body["message"] if fmt == "sglang" else result.body["error"]["message"]
        if fmt == "sglang":
            assert result.body["code"] == 503
            assert result.body["object"] == "error"
        else:
            assert result.body["error"]["code"] == 503
            assert result.body["error"]["type"] == "ServiceUnavailableError"
        assert message.endswith(reason), message
        return
    assert result.status == 200  # the stream had started: the error is in-band
    assert result.events is not None
    assert result.events[-1] == "[DONE]"
    error = result.events[-2]
    message = error["message"] if fmt == "sglang" else error["error"]["message"]
    assert message.endswith(reason), error
    delivered = result.events[:-2]
    tokens = [
        t
        for chunk in delivered
        for t in (chunk["output_ids"] if fmt == "sglang" else chunk["choices"][0]["token_ids"])
    ]
    assert len(tokens) == 4


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "sse"])
async def test_a_refusing_request_still_restarts_before_any_token(
    law_mesh: InProcessMesh, fmt: str, stream: bool
) -> None:
    async with worker_faults(law_mesh) as control:
        served, reference = await landing(
            control, lambda: call(law_mesh, fmt, REFUSING[fmt], stream)
        )
        await control.inject(successor(control, served), {"kind": "drop", "after_tokens": 0})
        before = await control.received()
        try:
            result = await call(law_mesh, fmt, REFUSING[fmt], stream)
            after = await control.received()
        finally:
            await control.clear()
    assert sum(after.values()) - sum(before.values()) == 2
    assert content(fmt, REFUSING[fmt], result) == content(fmt, REFUSING[fmt], reference)


# ---------------------------------------------------------------- the migration limit


LIMITED = {
    "input_ids": [2, 7, 1, 8, 2, 8],
    "rid": "limit-test",
    "sampling_params": {"max_new_tokens": 12, "ignore_eos": True},
}
# On every worker: after 5 tokens. Attempt 1 fails after 5, attempt 2 after 5 more, and
# attempt 3, with 2 tokens left, ends before its fault: exactly two attempts fail.
EVERY_ATTEMPT = {"kind": "drop", "after_tokens": 5}


@pytest.fixture(scope="module")
def limited_frontend(law_mesh: InProcessMesh) -> Iterator[InProcessMesh]:
    """A second frontend on the law mesh's namespace: --migration-limit 1, and an idle
    timeout of 1 s (a live worker that sends nothing for 1 s has a hung engine)."""
    mesh = InProcessMesh(law_mesh.nats_url, law_mesh.namespace)
    mesh.add_frontend("--migration-limit", "1", "--idle-timeout", "1")
    mesh.wait_for_workers(lambda ids: len(ids) == 3, what="the law mesh's workers")
    yield mesh
    mesh.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "sse"])
async def test_the_migration_limit_ends_a_request_after_its_attempts(
    law_mesh: InProcessMesh, limited_frontend: InProcessMesh, stream: bool
) -> None:
    async with worker_faults(law_mesh) as control:
        for worker_id in control.worker_ids:
            await control.inject(worker_id, EVERY_ATTEMPT)
        before = await control.received()
        try:
            result = await call(limited_frontend, "sglang", LIMITED, stream)
            after = await control.received()
        finally:
            await control.clear()
    assert sum(after.values()) - sum(before.values()) == 2  # the first attempt and one more
    if stream:
        assert result.status == 200
        assert result.events is not None
        assert result.events[-1] == "[DONE]"
        error = result.events[-2]
        tokens = [t for chunk in result.events[:-2] for t in chunk["output_ids"]]
        assert len(tokens) == 10
    else:
        assert result.status == 503
        error = result.body
    assert error["code"] == 503
    assert "connection dropped" in error["message"]
    logged = attempts_logged(frontend_of(limited_frontend))
    assert [(n, delivered) for _, n, _, delivered in logged[-1:]] == [(2, 5)]


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "sse"])
async def test_the_default_limit_lets_two_failed_attempts_succeed(
    law_mesh: InProcessMesh, stream: bool
) -> None:
    reference = content("sglang", LIMITED, await call(law_mesh, "sglang", LIMITED, stream))
    async with worker_faults(law_mesh) as control:
        for worker_id in control.worker_ids:
            await control.inject(worker_id, EVERY_ATTEMPT)
        before = await control.received()
        try:
            result = await call(law_mesh, "sglang", LIMITED, stream)
            after = await control.received()
            pending = [await control.pending(w) for w in control.worker_ids]
        finally:
            await control.clear()
    assert pending == [0, 0, 0]
    assert sum(after.values()) - sum(before.values()) == 3
    assert content("sglang", LIMITED, result) == reference
    logged = attempts_logged(frontend_of(law_mesh))
    assert [(n, delivered) for _, n, _, delivered in logged[-2:]] == [(2, 5), (3, 10)]


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "sse"])
async def test_a_hung_engine_migrates_after_the_idle_timeout(
    law_mesh: InProcessMesh, limited_frontend: InProcessMesh, stream: bool
) -> None:
    """`hang`, the fault the law leaves out: the worker still answers pings, so only the
    idle timeout (1 s on this frontend) moves the request; the hung attempt is cancelled."""
    body = {
        "input_ids": [1, 4, 1, 4, 2],
        "rid": "hang",
        "sampling_params": {"max_new_tokens": 12, "ignore_eos": True},
        "return_logprob": True,
    }
    async with worker_faults(law_mesh) as control:
        served, reference = await landing(
            control, lambda: call(limited_frontend, "sglang", body, stream)
        )
        victim = successor(control, served)
        await control.inject(victim, {"kind": "hang", "after_tokens": 4})
        pings: list[Msg] = []

        async def on_ping(msg: Msg) -> None:
            pings.append(msg)

        observer = await nats.connect(law_mesh.nats_url)
        await observer.subscribe(Subjects(law_mesh.namespace).worker_ping(victim), cb=on_ping)
        await flush_in_order(observer)
        try:
            started = time.monotonic()
            result = await call(limited_frontend, "sglang", body, stream)
            elapsed = time.monotonic() - started
            assert await control.pending(victim) == 0
            deadline = time.monotonic() + 5
            while await control.running(victim):  # the hung attempt is cancelled there
                assert time.monotonic() < deadline, "the hung attempt still runs"
                await asyncio.sleep(0.02)
        finally:
            await observer.close()
            await control.clear()
    assert content("sglang", body, result) == content("sglang", body, reference)
    assert 1.0 <= elapsed < 5.0
    # Pinged once per pause (--ping-after 0.5 s), not in a loop: answered "alive", the
    # next ping waits for another pause, and the idle timeout comes first.
    assert 1 <= len(pings) <= 2, len(pings)
    (move,) = attempts_logged(frontend_of(limited_frontend))[-1:]
    assert move[1:] == (2, "no worker sent a frame within 1s", 4)


# ---------------------------------------------------------------- NATS level


async def test_mig_frames_mark_each_new_attempt(law_mesh: InProcessMesh) -> None:
    prompt = [5, 4, 3, 2, 1]
    async with await MeshClient.connect(law_mesh.nats_url, law_mesh.namespace) as client:
        plain = [f async for f in client.generate(request(prompt, max_tokens=12, ignore_eos=True))]
        async with worker_faults(law_mesh) as control:
            for worker_id in control.worker_ids:
                await control.inject(worker_id, EVERY_ATTEMPT)
            try:
                migrated = [
                    f
                    async for f in client.generate(request(prompt, max_tokens=12, ignore_eos=True))
                ]
            finally:
                await control.clear()
    assert [f["t"] for f in plain if f["t"] not in (frames.OUT, frames.KA)] == ["ack", "end"]
    kinds = [f["t"] for f in migrated if f["t"] not in (frames.OUT, frames.KA)]
    assert kinds == ["ack", MIG, "ack", MIG, "ack", "end"]
    migs = [f for f in migrated if f["t"] == MIG]
    acks = [f for f in migrated if f["t"] == frames.ACK]
    for n, (mig, ack) in enumerate(zip(migs, acks, strict=False)):
        assert mig["attempt"] == n + 2
        assert mig["delivered"] == 5 * (n + 1)
        assert mig["from_worker"] == ack["worker"]
        assert mig["reason"] == MigrationReason.RETRYABLE_ERROR
        assert "connection dropped" in mig["message"]
        assert mig["id"] == migrated[0]["id"]
    assert len({a["worker"] for a in acks}) == 3  # each attempt excludes the failed ones
    # Every attempt has its own ID, so a cancel of a failed one cannot hit its successor.
    assert [a["id"] for a in acks] == [acks[0]["id"], acks[0]["id"] + "~2", acks[0]["id"] + "~3"]

    def tokens(fs: list[frames.Frame]) -> list[int]:
        return [t for f in fs if f["t"] in (frames.OUT, frames.END) for t in f.get("tokens") or []]

    assert tokens(migrated) == tokens(plain)
    assert len(tokens(plain)) == 12


async def test_pinned_requests_never_migrate(law_mesh: InProcessMesh) -> None:
    async with (
        await MeshClient.connect(law_mesh.nats_url, law_mesh.namespace) as client,
        worker_faults(law_mesh) as control,
    ):
        pinned = control.worker_ids[0]
        await control.inject(pinned, {"kind": "drop", "after_tokens": 3})
        before = await control.received()
        try:
            env = request([1, 2, 3], max_tokens=10, ignore_eos=True, worker=pinned)
            got = [f async for f in client.generate(env)]
            after = await control.received()
        finally:
            await control.clear()
    assert sum(after.values()) - sum(before.values()) == 1
    assert [f["t"] for f in got if f["t"] != frames.OUT] == ["ack", "err"]
    assert got[-1]["code"] == "unavailable"
    assert "connection dropped" in got[-1]["message"]
    assert sum(len(f.get("tokens") or []) for f in got) == 3


# ---------------------------------------------------------------- SIGKILL


KILL_PROMPT = [9, 19, 29, 39, 49, 59, 3]
# ~0.4 s of tokens: the request still runs when the test looks for its worker, even on a
# busy machine (a replacement worker starting takes a core for a while).
KILL_BUDGET = 120


def kill_case(fmt: str, stream: bool, logprobs: bool) -> dict[str, Any]:
    rid = f"kill-{fmt}-{stream}-{logprobs}"
    if fmt == "sglang":
        body: dict[str, Any] = {
            "input_ids": KILL_PROMPT,
            "rid": rid,
            "sampling_params": {"max_new_tokens": KILL_BUDGET, "ignore_eos": True},
        }
        if logprobs:
            body |= {
                "return_logprob": True,
                "top_logprobs_num": 2,
                "logprob_start_len": 2,
                "return_routed_experts": True,
                "routed_experts_start_len": 1,
            }
        return body
    sp: dict[str, Any] = {"max_tokens": KILL_BUDGET, "ignore_eos": True}
    if logprobs:
        sp |= {"logprobs": 2, "prompt_logprobs": 1}
    body = {"token_ids": KILL_PROMPT, "request_id": rid, "sampling_params": sp}
    if stream:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return body


async def serving_worker(control: WorkerFaults, timeout: float = 5.0) -> str:
    """The live worker that is running a request right now."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [s.name for s in control.mesh.workers if s.name in control.worker_ids]
        running = await asyncio.gather(*(control.running(w) for w in alive))
        busy = [w for w, ids in zip(alive, running, strict=True) if ids]
        if busy:
            (worker_id,) = busy
            return worker_id
        await asyncio.sleep(0.002)
    raise TimeoutError("no worker is running the request")


@pytest.mark.chaos
@pytest.mark.parametrize("logprobs", [False, True], ids=["plain", "logprobs"])
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "sse"])
@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
async def test_the_law_with_sigkill(
    kill_mesh: Mesh, fmt: str, stream: bool, logprobs: bool
) -> None:
    body = kill_case(fmt, stream, logprobs)
    frontend = frontend_of(kill_mesh)
    logged = len(attempts_logged(frontend))
    expected = content(fmt, body, await call(kill_mesh, fmt, body, stream))
    killed: list[str] = []
    replacement: list[Service] = []

    async with worker_faults(kill_mesh) as control:

        async def kill() -> None:
            victim = await serving_worker(control)
            service = next(s for s in kill_mesh.services if s.name == victim)
            service.kill()
            killed.append(victim)
            replacement.append(kill_mesh.add_worker(wait=False, **WORKER_OPTS))

        async def after_chunks(n: int, event: Any) -> None:
            if n == 3 and not killed:
                await kill()

        if stream:
            result = await call(kill_mesh, fmt, body, stream, on_event=after_chunks)
        else:
            task = asyncio.create_task(call(kill_mesh, fmt, body, stream))
            await serving_worker(control)
            await asyncio.sleep(0.03)  # a few tokens in
            await kill()
            result = await task
    assert killed, "the request ended before the kill"
    assert content(fmt, body, result) == expected
    attempts = attempts_logged(frontend)[logged:]
    assert [(n, delivered > 0) for _, n, _, delivered in attempts] == [(2, True)], attempts
    # The mesh keeps 3 workers, and forgets the dead one (the frontend and the router,
    # each on its own clock), before the next case.
    new = replacement[0].name
    await asyncio.to_thread(
        kill_mesh.wait_for_workers,
        lambda ids: new in ids and killed[0] not in ids,
        15.0,
        f"{new} to join and {killed[0]} to leave",
    )
    router = next(s for s in kill_mesh.services if s.role == "router")
    dropped = f"worker {killed[0]} missed its heartbeats"
    await asyncio.to_thread(
        wait_until, lambda: dropped in router.log(), 15.0, 0.05, "the router to drop it"
    )


# ---------------------------------------------------------------- engine adapters


@pytest.fixture(scope="module", params=["sglang", "vllm"])
def adapter_mesh(
    request: pytest.FixtureRequest, nats_url: str
) -> Iterator[tuple[InProcessMesh, dict[str, str]]]:
    """1 router, 2 workers each in front of its own mock engine server, a frontend; in
    process (the engine servers too: faults are injected through their admin routes)."""
    engine: str = request.param
    mesh = InProcessMesh(nats_url, unique_namespace(engine))
    servers: dict[str, str] = {}
    try:
        mesh.add_router(wait=False)
        for _ in range(2):
            _, url = mesh.spawn_engine_server(
                engine,
                "--vocab-size", str(VOCAB),
                "--eos-token-id", str(EOS),
                "--token-delay-ms", str(TOKEN_DELAY_MS),
            )  # fmt: skip
            worker = mesh.add_worker(engine=engine, engine_url=url, wait=False)
            servers[worker.name] = url
        mesh.add_frontend()
        mesh.wait_for_workers(lambda ids: set(servers) <= ids, what="the adapter workers")
        mesh.wait_for_routers()
    except BaseException:
        print(mesh.logs())
        mesh.stop()
        raise
    yield mesh, servers
    mesh.stop()


@contextlib.asynccontextmanager
async def server_faults(servers: dict[str, str]) -> AsyncIterator[ServerFaults]:
    async with aiohttp.ClientSession() as session:
        yield ServerFaults(session, servers)


def test_the_law_through_the_engine_adapters(
    adapter_mesh: tuple[InProcessMesh, dict[str, str]], capsys: pytest.CaptureFixture[str]
) -> None:
    mesh, servers = adapter_mesh
    engine = next(s.name for s in mesh.services if s.role == "engine").split("-")[0]
    run_law(
        mesh,
        lambda: server_faults(servers),
        ADAPTER_EXAMPLES,
        # Routed experts only through SGLang: the vLLM adapter refuses them.
        st.tuples(cases(VOCAB, routed_experts=engine == "sglang"), faults(SERVER_FAULTS[engine])),
        f"migration law, engine faults, {engine} adapter",
        capsys,
    )


# ---------------------------------------------------------------- gaps found and closed


async def fault_where_it_lands(
    mesh: AnyMesh, control: FaultControl, fmt: str, body: dict[str, Any], fault: dict[str, Any]
) -> tuple[Result, Result]:
    """The uninterrupted run, then the same request with `fault` where it will land."""
    served, reference = await landing(control, lambda: call(mesh, fmt, body, False))
    await control.inject(successor(control, served), fault)
    try:
        return reference, await call(mesh, fmt, body, False)
    finally:
        await control.clear()


@pytest.mark.parametrize("adapter_mesh", ["sglang"], indirect=True)
async def test_routed_experts_survive_a_migration_through_the_sglang_adapter(
    adapter_mesh: tuple[InProcessMesh, dict[str, str]],
) -> None:
    mesh, servers = adapter_mesh
    body = {
        "input_ids": [4, 5, 6],
        "rid": "experts",
        "sampling_params": {"max_new_tokens": 12, "ignore_eos": True},
        "return_routed_experts": True,
        "routed_experts_start_len": 1,
    }
    async with server_faults(servers) as control:
        reference, result = await fault_where_it_lands(
            mesh, control, "sglang", body, {"kind": "drop", "after_tokens": 5}
        )
    assert result.status == 200, result.body
    got, expected = content("sglang", body, result), content("sglang", body, reference)
    assert differences(got, expected) == []


async def test_sglang_repetition_penalty_refuses_migration(law_mesh: InProcessMesh) -> None:
    body = {
        "input_ids": [4, 5, 6],
        "rid": "repetition",
        "sampling_params": {"max_new_tokens": 12, "repetition_penalty": 1.3},
    }
    async with worker_faults(law_mesh) as control:
        _, result = await fault_where_it_lands(
            law_mesh, control, "sglang", body, {"kind": "drop", "after_tokens": 4}
        )
    assert result.status == 503
    assert "not migrated: repetition_penalty" in result.body["message"]

"""Prefill/decode disaggregation under faults, with OS processes that really die.

- a prefill worker SIGKILLed during its stage: the request moves to another pair, and its
  answer is the one an undisturbed run gives;
- a decode worker SIGKILLed mid-stream: migration continues the request on a new pair
  (prefill of the prompt and the delivered tokens again), the answer unchanged;
- a client that goes away during the prefill: both halves stop, nothing stays behind;
- a KV handle that expires before the decode side takes it: a clear, retryable error after
  the request's attempts are spent, in the format's own error shape.

Each test counts the requests it lost (target 0) and prints them (`pytest -s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.answers import call, content
from tests.conftest import unique_namespace
from tests.mesh import Mesh, Service, wait_until

pytestmark = pytest.mark.chaos

VOCAB, EOS = 64, 7
ATTEMPT_LOG = re.compile(r"request (\S+): attempt (\d+) after: (.*) \((\d+) tokens delivered\)")


def worker_opts(speedup: float) -> dict[str, Any]:
    return {"vocab_size": VOCAB, "eos_token_id": EOS, "speedup": speedup, "heartbeat": 0.5}


def pd_mesh(
    nats_url: str, workdir: Path, prefill: list[tuple[str, ...]], decode: list[tuple[str, ...]]
) -> Mesh:
    """A frontend and P/D workers as processes; each worker is (its mock's speed-up, its
    extra options...)."""
    mesh = Mesh(nats_url, workdir, unique_namespace("pdf"))
    specs = [("prefill", w) for w in prefill] + [("decode", w) for w in decode]
    try:
        ids = [
            mesh.add_worker(
                wait=False, extra_args=("--role", role, *extra), **worker_opts(float(speedup))
            ).name
            for role, (speedup, *extra) in specs
        ]
        mesh.add_frontend()
        mesh.wait_for_workers(lambda known: set(ids) <= known, what=f"workers {ids}")
    except BaseException:
        print(mesh.logs())
        mesh.stop()
        raise
    return mesh


def cards(mesh: Mesh) -> dict[str, dict[str, Any]]:
    return {w["id"]: w for w in mesh.server_info()["genmesh"]["workers"]}


def stages(mesh: Mesh) -> int:
    """Prefill stages the prefill workers admitted."""
    return sum(c["stats"]["admitted"] for c in cards(mesh).values() if c["role"] == "prefill")


def service(mesh: Mesh, worker_id: str) -> Service:
    return next(s for s in mesh.services if s.name == worker_id)


async def busy_worker(mesh: Mesh, role: str, timeout: float = 10.0) -> str:
    """The worker of `role` that is running something now (from its load report)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        now = await asyncio.to_thread(cards, mesh)
        busy = [w for w, c in now.items() if c.get("role") == role and c["inflight"]]
        if busy:
            return busy[0]
        await asyncio.sleep(0.01)
    raise TimeoutError(f"no {role} worker is running the request")


def attempts(mesh: Mesh) -> list[tuple[str, int, str, int]]:
    frontend = next(s for s in mesh.services if s.role == "frontend")
    return [(m[1], int(m[2]), m[3], int(m[4])) for m in ATTEMPT_LOG.finditer(frontend.log())]


def sglang_body(prompt_len: int, max_new_tokens: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    return {
        "rid": f"pd-fault-{uuid.uuid4().hex}",  # answers echo it: the same in both runs
        "input_ids": [rng.randrange(VOCAB) for _ in range(prompt_len)],
        "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": 0,
        "return_routed_experts": True,
    }


def report(label: str, **figures: Any) -> None:
    print(f"\nP/D fault: {label}: " + ", ".join(f"{k}={v}" for k, v in figures.items()), end="")


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture
def prefill_death_mesh(nats_url: str, workdir: Path) -> Iterator[Mesh]:
    # Slow prefill workers (a 1,000-token prompt takes ~0.6 s), a fast decode worker.
    mesh = pd_mesh(nats_url, workdir, prefill=[("0.05",), ("0.05",)], decode=[("1",)])
    yield mesh
    mesh.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "sse"])
async def test_a_dead_prefill_worker_is_replaced(prefill_death_mesh: Mesh, stream: bool) -> None:
    mesh = prefill_death_mesh
    body = sglang_body(1000, 8, seed=1)
    expected = content("sglang", body, await call(mesh, "sglang", body, stream))
    logged = len(attempts(mesh))
    task = asyncio.create_task(call(mesh, "sglang", body, stream))
    victim = await busy_worker(mesh, "prefill")
    service(mesh, victim).kill()
    result = await task
    got = content("sglang", body, result)
    assert got == expected
    new = attempts(mesh)[logged:]
    assert [(n, delivered) for _, n, _, delivered in new] == [(2, 0)], new
    assert victim in new[0][2], new  # the error named the dead prefill worker
    report("prefill worker killed during its stage", lost=0 if got == expected else 1)


@pytest.fixture
def decode_death_mesh(nats_url: str, workdir: Path) -> Iterator[Mesh]:
    # One prefill worker, two decode workers at ~30 ms a token.
    mesh = pd_mesh(nats_url, workdir, prefill=[("1",)], decode=[("0.2",), ("0.2",)])
    yield mesh
    mesh.stop()


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
async def test_a_dead_decode_worker_migrates_to_a_new_pair(
    decode_death_mesh: Mesh, fmt: str
) -> None:
    mesh = decode_death_mesh
    if fmt == "sglang":
        body = sglang_body(200, 40, seed=2)
    else:
        rng = random.Random(3)
        body = {
            "request_id": f"pd-fault-{uuid.uuid4().hex}",
            "token_ids": [rng.randrange(VOCAB) for _ in range(200)],
            "sampling_params": {"max_tokens": 40, "ignore_eos": True, "logprobs": 1},
        }
    expected = content(fmt, body, await call(mesh, fmt, body, True))
    stages_before = sum(
        c["stats"]["admitted"] for c in cards(mesh).values() if c["role"] == "prefill"
    )
    killed: list[str] = []

    async def after(n: int, event: Any) -> None:
        if n == 3 and not killed:
            victim = await busy_worker(mesh, "decode")
            service(mesh, victim).kill()
            killed.append(victim)

    result = await call(mesh, fmt, body, True, on_event=after)
    assert killed, "the request ended before the kill"
    assert content(fmt, body, result) == expected
    # The continuation had its prefill (prompt + delivered tokens) done again.
    assert stages(mesh) - stages_before == 2
    report(f"decode worker killed mid-stream ({fmt})", lost=0)


@pytest.fixture
def cancel_mesh(nats_url: str, workdir: Path) -> Iterator[Mesh]:
    # A very slow prefill (a 1,000-token prompt takes ~1.6 s).
    mesh = pd_mesh(nats_url, workdir, prefill=[("0.02",)], decode=[("1",)])
    yield mesh
    mesh.stop()


async def test_a_client_cancel_reaches_both_halves(cancel_mesh: Mesh) -> None:
    mesh = cancel_mesh
    body = {**sglang_body(1000, 8, seed=4), "stream": True}
    async with aiohttp.ClientSession() as session:
        # The response's head comes with the first output, after the prefill: the client
        # goes away while it waits for it.
        waiting = asyncio.create_task(session.post(mesh.http_url + "/generate", json=body))
        prefill = await busy_worker(mesh, "prefill")
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting

    def stopped() -> bool:
        now = cards(mesh)
        return all(c["inflight"] == 0 for c in now.values()) and all(
            c["stats"]["cancelled"] == 1 for c in now.values()
        )

    await asyncio.to_thread(wait_until, stopped, 10.0, 0.05, "both halves to be cancelled")
    now = cards(mesh)
    assert now[prefill]["disagg"]["handles"] == 0
    assert {c["role"]: c["stats"]["completed"] for c in now.values()} == {
        "prefill": 0,
        "decode": 0,
    }
    report("client went away during the prefill", lost=0, leaked_handles=0)


@pytest.fixture
def expiring_mesh(nats_url: str, workdir: Path) -> Iterator[Mesh]:
    # The prefill worker forgets a handle at once: every decode finds it gone.
    mesh = pd_mesh(nats_url, workdir, prefill=[("0", "--mock-pd-handle-ttl", "0")], decode=[("0",)])
    yield mesh
    mesh.stop()


@pytest.mark.parametrize("fmt", ["sglang", "vllm"])
async def test_a_failed_transfer_is_a_clear_retryable_error(expiring_mesh: Mesh, fmt: str) -> None:
    mesh = expiring_mesh
    body: dict[str, Any] = (
        {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}
        if fmt == "sglang"
        else {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}}
    )
    result = await call(mesh, fmt, body, False)
    assert result.status == 503, result.body
    text = str(result.body)
    assert "KV transfer failed" in text, result.body
    if fmt == "sglang":
        assert result.body["object"] == "error", result.body
    else:
        assert result.body["error"]["code"] == 503, result.body

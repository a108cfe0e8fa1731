"""Prefill/decode disaggregation through the whole mesh, with the mock engine.

The differential law: for any request, the answer of a disaggregated mesh (prefill workers
and decode workers of the same deterministic mock) equals the answer of an aggregated mesh,
field by field: tokens, logprobs, prompt logprobs, routed experts, finish and usage, unary
and SSE, SGLang and vLLM formats, token budgets of 0 and 1 included. Every request of the
disaggregated mesh must really have run its prefill on a prefill worker (their stage
counters say so) and leave no KV handle behind.

GENMESH_PD_EXAMPLES (default 40) sets how many random requests the law runs; it prints the
count (`pytest -s`).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.answers import Case, call, cases, content, differences
from tests.conftest import unique_namespace
from tests.inproc import InProcessMesh, start_inproc_mesh
from tests.mesh import wait_until

pytestmark = pytest.mark.inproc

VOCAB, EOS = 64, 7
EXAMPLES = int(os.environ.get("GENMESH_PD_EXAMPLES", "40"))
WORKER_OPTS: dict[str, Any] = {"vocab_size": VOCAB, "eos_token_id": EOS}


def cards(mesh: InProcessMesh) -> dict[str, dict[str, Any]]:
    return {w["id"]: w for w in mesh.server_info()["genmesh"]["workers"]}


def by_role(mesh: InProcessMesh, role: str) -> list[dict[str, Any]]:
    return [c for c in cards(mesh).values() if c.get("role") == role]


def stages_run(mesh: InProcessMesh) -> int:
    return sum(int(c["stats"]["admitted"]) for c in by_role(mesh, "prefill"))


def handles_held(mesh: InProcessMesh) -> int:
    return sum(int(c["disagg"]["handles"]) for c in by_role(mesh, "prefill"))


@pytest.fixture(scope="module")
def aggregated(nats_url: str) -> Iterator[InProcessMesh]:
    mesh = start_inproc_mesh(
        nats_url, namespace=unique_namespace("agg"), workers=1, routers=0, worker_opts=WORKER_OPTS
    )
    yield mesh
    mesh.stop()


@pytest.fixture(scope="module")
def disaggregated(nats_url: str) -> Iterator[InProcessMesh]:
    """Two prefill and two decode workers; the frontend routes the pairs itself."""
    mesh = InProcessMesh(nats_url, unique_namespace("pd"))
    try:
        ids = [
            mesh.add_worker(wait=False, extra_args=("--role", role), **WORKER_OPTS).name
            for role in ("prefill", "prefill", "decode", "decode")
        ]
        mesh.add_frontend()
        mesh.wait_for_workers(lambda known: set(ids) <= known, what=f"workers {ids}")
        wait_until(lambda: mesh._http_ok("/health"), what="the frontend to be ready")
    except BaseException:
        print(mesh.logs())
        mesh.stop()
        raise
    yield mesh
    mesh.stop()


@st.composite
def pd_cases(draw: st.DrawFn) -> Case:
    """Migration's random requests, and SGLang's budget of 0 (prefill only) besides."""
    case = draw(cases(VOCAB))
    if case.fmt == "sglang" and draw(st.integers(0, 7)) == 0:
        case.body["sampling_params"]["max_new_tokens"] = 0
        case.body["sampling_params"]["min_new_tokens"] = 0
    return case


def test_the_disaggregated_answer_equals_the_aggregated_one(
    aggregated: InProcessMesh, disaggregated: InProcessMesh, capsys: pytest.CaptureFixture[str]
) -> None:
    ran = 0
    before = stages_run(disaggregated)

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,  # CI runs the same cases every time
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(pd_cases())
    def law(case: Case) -> None:
        nonlocal ran
        ran += 1

        async def example() -> None:
            expected = await call(aggregated, case.fmt, case.body, case.stream)
            got = await call(disaggregated, case.fmt, case.body, case.stream)
            want = content(case.fmt, case.body, expected)
            have = content(case.fmt, case.body, got)
            assert not differences(have, want), differences(have, want)

        asyncio.run(example())

    started = time.monotonic()
    law()
    with capsys.disabled():
        print(f"\nP/D differential law: {ran} examples in {time.monotonic() - started:.1f}s")
    assert ran == EXAMPLES
    # Every one of them ran its prefill on a prefill worker.
    wait_until(lambda: stages_run(disaggregated) - before == ran, what="the stage counts")
    wait_until(lambda: handles_held(disaggregated) == 0, what="no KV handle left behind")

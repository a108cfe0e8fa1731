"""The real routers in front of genmesh: sglang-router and vllm-router (PyPI, Rust
binaries) as subprocesses on loopback, a genmesh frontend as their one worker URL.

What goes through a router must be what genmesh itself answers (same tokens, same finish);
what each router adds to the body, and which genmesh routes it calls at startup, is read off
a wiretap between router and frontend (tests/upstream/kit.py) and pinned here, so that a
router upgrade that changes them shows up. Observed with sglang-router 0.3.2 and
vllm-router 0.1.17:

- sglang-router re-serialises each /generate body, adding its defaults for what the
  client left out (`model: null`, `return_bytes: false`, `stream`, `background`,
  `log_metrics`, `no_logs`, `return_entropy`, `return_hidden_states`,
  `return_text_in_logprobs`: SGLANG_ROUTER_DEFAULTS); it probes the worker over gRPC
  first (an HTTP/2 preface, which genmesh's HTTP/1 server refuses, so it falls back to
  HTTP), then calls GET /health, /server_info, /model_info; it tries to fetch a
  tokenizer for the model name from Hugging Face (a warning when it cannot).
- vllm-router re-serialises the body as well, adding only `stream: false`; at startup it
  calls GET /health only (it waits for its workers to be healthy before serving).
- Both answer with their own `x-request-id` (`gnt-...`), not genmesh's.

Tier inproc: the mesh is in process (real nats-server, real HTTP); the routers are the
only processes, and they start in well under a second.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.http_util import stream
from tests.inproc import InProcessMesh
from tests.upstream.kit import (
    RouterProcess,
    Wiretap,
    free_port,
    json_of,
    post_json,
    router_command,
)

pytestmark = pytest.mark.inproc

ROUTER_START_TIMEOUT_S = 30.0
# Fields that differ between any two answers (ids and timings), not between paths.
VOLATILE = frozenset(("id", "request_id", "e2e_latency"))


def _strip(value: Any) -> Any:
    """`value` without its volatile fields, recursively."""
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def _workers_registered(router: RouterProcess) -> bool:
    """Whether the router has our frontend as a healthy worker (its /workers list)."""
    with urllib.request.urlopen(router.url + "/workers", timeout=2) as resp:
        workers = json.load(resp).get("workers", [])
    return any(w.get("is_healthy") for w in workers)


@pytest.fixture(scope="module")
def sglang_tap(mesh: InProcessMesh) -> Iterator[Wiretap]:
    tap = Wiretap(mesh.http_url)
    tap.start()
    yield tap
    tap.stop()


@pytest.fixture(scope="module")
def vllm_tap(mesh: InProcessMesh) -> Iterator[Wiretap]:
    tap = Wiretap(mesh.http_url)
    tap.start()
    yield tap
    tap.stop()


def _router(name: str, log_level: str, tap: Wiretap, tmp: Path) -> Iterator[RouterProcess]:
    argv = [
        *router_command(name),
        "--worker-urls",
        tap.url,
        "--policy",
        "round_robin",
        "--log-level",
        log_level,
        # both default to a fixed metrics port (29000): a free one, on loopback
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
    ]
    router = RouterProcess(name, argv, tmp / f"{name}.log")
    try:
        router.start(lambda: _workers_registered(router), timeout=ROUTER_START_TIMEOUT_S)
        tap.mark_started()
        yield router
    finally:
        router.stop()


@pytest.fixture(scope="module")
def sglang_router(
    sglang_tap: Wiretap, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RouterProcess]:
    yield from _router("sglang-router", "warn", sglang_tap, tmp_path_factory.mktemp("sgl"))


@pytest.fixture(scope="module")
def vllm_router(
    vllm_tap: Wiretap, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RouterProcess]:
    yield from _router("vllm-router", "warning", vllm_tap, tmp_path_factory.mktemp("vllm"))


SGLANG_BODY: dict[str, Any] = {
    "input_ids": [11, 12, 13, 14],
    "sampling_params": {"max_new_tokens": 6, "temperature": 0},
}
SGLANG_EOS_BODY: dict[str, Any] = {
    # the mock (vocab 1000, EOS 7) reaches EOS after 89 tokens on this prompt: "stop"
    "input_ids": [2, 7, 1, 8, 2],
    "sampling_params": {"max_new_tokens": 400, "temperature": 0},
}
VLLM_BODY: dict[str, Any] = {
    "token_ids": [11, 12, 13, 14],
    "sampling_params": {"max_tokens": 6, "temperature": 0},
}


# ---------------------------------------------------------------------------- sglang-router

# sglang-router re-serialises the body through its own GenerateRequest struct: every field
# the client left out comes back with the struct's default (0.3.2).
SGLANG_ROUTER_DEFAULTS = {
    "background": False,
    "log_metrics": True,
    "model": None,
    "no_logs": False,
    "return_bytes": False,
    "return_entropy": False,
    "return_hidden_states": False,
    "return_text_in_logprobs": False,
    "stream": False,
}


@pytest.mark.parametrize(
    ("body", "finish"),
    [(SGLANG_BODY, "length"), (SGLANG_EOS_BODY, "stop")],
    ids=["length", "stop"],
)
async def test_sglang_router_unary_generate_is_genmesh_answer(
    mesh: InProcessMesh, sglang_router: RouterProcess, body: dict[str, Any], finish: str
) -> None:
    direct = await post_json(mesh.http_url + "/generate", body)
    routed = await post_json(sglang_router.url + "/generate", body)
    assert direct.status == 200, direct.body
    assert routed.status == 200, (routed.body, sglang_router.log()[-3000:])
    assert _strip(routed.body) == _strip(direct.body)
    assert routed.body["meta_info"]["finish_reason"]["type"] == finish


async def test_sglang_router_sse_generate_is_genmesh_answer(
    mesh: InProcessMesh, sglang_router: RouterProcess
) -> None:
    direct = await stream(mesh.http_url + "/generate", SGLANG_BODY)
    routed = await stream(sglang_router.url + "/generate", SGLANG_BODY)
    assert direct.status == 200, direct.raw
    assert routed.status == 200, routed.raw
    assert routed.headers["content-type"].startswith("text/event-stream")
    assert _strip(routed.events) == _strip(direct.events)
    assert routed.events[-1] == "[DONE]"
    tokens = [t for e in routed.events[:-1] for t in e["output_ids"]]
    assert len(tokens) == 6
    assert routed.events[-2]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}


async def test_sglang_router_adds_model_and_return_bytes(
    sglang_router: RouterProcess, sglang_tap: Wiretap
) -> None:
    """What sglang-router changes in the body it forwards: it adds its struct's defaults
    (issue 11: genmesh refused `model` and `return_bytes`, so every request through
    sglang-router failed)."""
    sglang_tap.seen.clear()
    await post_json(sglang_router.url + "/generate", SGLANG_BODY)
    forwarded = [s for s in sglang_tap.seen if s.path == "/generate"]
    assert len(forwarded) == 1, sglang_tap.paths()
    sent = json_of(forwarded[0])
    added = {k: v for k, v in sent.items() if k not in SGLANG_BODY}
    assert added == SGLANG_ROUTER_DEFAULTS
    assert {k: sent[k] for k in SGLANG_BODY} == SGLANG_BODY


def test_sglang_router_startup_probes_answered(
    sglang_router: RouterProcess, sglang_tap: Wiretap
) -> None:
    """The routes sglang-router calls when it registers a worker all answer 200."""
    startup = {f"{s.method} {s.path}": s.status for s in sglang_tap.startup}
    assert startup == {"GET /health": 200, "GET /server_info": 200, "GET /model_info": 200}


# ---------------------------------------------------------------------------- vllm-router


async def test_vllm_router_unary_generate_is_genmesh_answer(
    mesh: InProcessMesh, vllm_router: RouterProcess
) -> None:
    direct = await post_json(mesh.http_url + "/inference/v1/generate", VLLM_BODY)
    routed = await post_json(vllm_router.url + "/inference/v1/generate", VLLM_BODY)
    assert direct.status == 200, direct.body
    assert routed.status == 200, (routed.body, vllm_router.log()[-3000:])
    assert _strip(routed.body) == _strip(direct.body)
    assert routed.body["choices"][0]["finish_reason"] == "length"
    assert len(routed.body["choices"][0]["token_ids"]) == 6


async def test_vllm_router_sse_generate_is_genmesh_answer(
    mesh: InProcessMesh, vllm_router: RouterProcess
) -> None:
    direct = await stream(mesh.http_url + "/inference/v1/generate", VLLM_BODY)
    routed = await stream(vllm_router.url + "/inference/v1/generate", VLLM_BODY)
    assert direct.status == 200, direct.raw
    assert routed.status == 200, routed.raw
    assert routed.headers["content-type"].startswith("text/event-stream")
    assert _strip(routed.events) == _strip(direct.events)
    assert routed.events[-1] == "[DONE]"


async def test_vllm_router_also_routes_sglang_generate(
    mesh: InProcessMesh, vllm_router: RouterProcess
) -> None:
    """vllm-router proxies /generate too: SGLang clients work through it."""
    direct = await post_json(mesh.http_url + "/generate", SGLANG_BODY)
    routed = await post_json(vllm_router.url + "/generate", SGLANG_BODY)
    assert routed.status == 200, routed.body
    assert _strip(routed.body) == _strip(direct.body)


async def test_vllm_router_also_streams_sglang_generate(
    mesh: InProcessMesh, vllm_router: RouterProcess
) -> None:
    direct = await stream(mesh.http_url + "/generate", SGLANG_BODY)
    routed = await stream(vllm_router.url + "/generate", SGLANG_BODY)
    assert direct.status == 200, direct.raw
    assert routed.status == 200, routed.raw
    assert routed.headers["content-type"].startswith("text/event-stream")
    assert _strip(routed.events) == _strip(direct.events)
    assert routed.events[-1] == "[DONE]"


async def test_vllm_router_forwards_body_unchanged(
    vllm_router: RouterProcess, vllm_tap: Wiretap
) -> None:
    vllm_tap.seen.clear()
    await post_json(vllm_router.url + "/inference/v1/generate", VLLM_BODY)
    forwarded = [s for s in vllm_tap.seen if s.path == "/inference/v1/generate"]
    assert len(forwarded) == 1, vllm_tap.paths()
    # it re-serialises the body too, adding only `stream`'s default
    assert json_of(forwarded[0]) == {**VLLM_BODY, "stream": False}


def test_vllm_router_startup_probe_answered(vllm_router: RouterProcess, vllm_tap: Wiretap) -> None:
    """vllm-router calls only /health before it serves (its startup wait, then its first
    health check), and genmesh answers 200."""
    assert {(s.method, s.path, s.status) for s in vllm_tap.startup} == {("GET", "/health", 200)}

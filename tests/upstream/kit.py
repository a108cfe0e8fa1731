"""Helpers the ported upstream tests share: the upstream test kits' checks, adapted to
token IDs and the mock engine, and what the router tests need (free ports, a wiretap that
records what a router sends, router subprocesses that always stop).

Ported from sgl-project/sglang `python/sglang/test/kits/logprob_kit.py` @ 967d614c3f6f:
`run_logprob_check` (also in `python/sglang/test/test_utils.py`),
`generate_with_logprobs`, `run_logprob_cross_mode_check` and its `_compare_*` helpers,
`run_logprob_start_len_check`. Their assertions are upstream's; inputs are token IDs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.conftest import unique_namespace
from tests.http_util import Reply, post
from tests.inproc import InProcessMesh
from tests.mesh import wait_until

# ---------------------------------------------------------------------------- SGLang kits


async def run_logprob_check(
    base_url: str,
    input_len: int,
    output_len: int,
    temperature: float,
    logprob_start_len: int,
    return_logprob: bool,
    top_logprobs_num: int,
) -> None:
    """sglang `logprob_kit.run_logprob_check`: the logprob arrays have the shapes the
    request asks for, and at temperature 0 the output token is the top-1 candidate.

    Adapted: `input_ids` are `range(input_len)` as upstream; the shared mesh's mock has a
    vocabulary of 1000, so ids wrap modulo 1000 (upstream's model has 128k)."""
    input_ids = [i % 1000 for i in range(input_len)]
    reply = await post_json(
        base_url + "/generate",
        {
            "input_ids": input_ids,
            "sampling_params": {
                "temperature": temperature,
                "max_new_tokens": output_len,
                "ignore_eos": True,
            },
            "return_logprob": return_logprob,
            "logprob_start_len": logprob_start_len,
            "top_logprobs_num": top_logprobs_num,
        },
    )
    assert reply.status == 200, reply.body
    meta = reply.body["meta_info"]
    assert meta["prompt_tokens"] == input_len
    assert meta["completion_tokens"] == output_len
    if not return_logprob:
        return
    assert len(meta["input_token_logprobs"]) + logprob_start_len == meta["prompt_tokens"]
    assert len(meta["output_token_logprobs"]) == output_len
    if not top_logprobs_num:
        return
    assert len(meta["input_top_logprobs"]) + logprob_start_len == meta["prompt_tokens"]
    assert len(meta["output_top_logprobs"]) == output_len
    for i in range(output_len):
        tops = meta["output_top_logprobs"][i]
        assert len(tops) == top_logprobs_num
        if temperature == 0:
            # upstream allows the next rank on a tie of values
            rank = 0
            while meta["output_token_logprobs"][i] != tops[rank]:
                assert tops[rank][0] == tops[rank + 1][0], (i, meta["output_token_logprobs"][i])
                rank += 1


JSON = {"Content-Type": "application/json"}  # what `requests.post(json=...)` sends


async def post_json(
    url: str, body: Any, headers: dict[str, str] | None = None, method: str = "POST"
) -> Reply:
    """POST `body` as JSON, as the upstream tests' `requests.post(url, json=body)` does;
    `None`: no body at all, as `requests.post(url)`."""
    if body is None:
        return await post(url, b"", headers=headers, method=method)
    return await post(url, body, headers={**JSON, **(headers or {})}, method=method)


async def get(url: str, headers: dict[str, str] | None = None) -> Reply:
    return await post(url, b"", headers=headers, method="GET")


def start_mesh_with(
    nats_url: str, prefix: str, *worker_args: str, **worker_opts: Any
) -> InProcessMesh:
    """A module's own in-process mesh (1 router, 2 workers, a frontend) whose workers take
    `worker_args` (command-line options, e.g. "--mock-max-model-len", "1024")."""
    mesh = InProcessMesh(nats_url, unique_namespace(prefix))
    try:
        mesh.add_router()
        ids = [
            mesh.add_worker(wait=False, extra_args=worker_args, **worker_opts).name
            for _ in range(2)
        ]
        mesh.add_frontend()
        mesh.wait_for_workers(lambda known: set(ids) <= known, what=f"workers {ids}")
        wait_until(lambda: mesh._http_ok("/health"), what="the frontend to be ready")
    except BaseException:
        mesh.stop()
        raise
    return mesh


# The kit's defaults (logprob_kit.py), as token IDs: its three prompts, and its probe IDs
# with 1000 (outside the shared mock's 1000-token vocabulary) replaced by 999.
CROSS_MODE_PROMPTS = [
    [791, 686, 315, 982, 374],  # "The capital of France is"
    [849, 18975, 31228, 25213, 304, 4382, 3878, 25],  # "Explain quantum computing ..."
    [15724, 374, 264, 40798, 1938, 323, 358, 1093],  # "Today is a sunny day and I like"
]
CROSS_MODE_PROMPTS = [[t % 1000 for t in p] for p in CROSS_MODE_PROMPTS]
DEFAULT_PROBE_TOKEN_IDS = [1, 2, 10, 100, 999]
DEFAULT_TOP_LOGPROBS_NUM = 5
DEFAULT_DECIMAL_PLACES = 1


async def generate_with_logprobs(
    url: str,
    input_ids: list[int],
    max_new_tokens: int,
    top_logprobs_num: int,
    token_ids_logprob: list[int] | None = None,
    logprob_start_len: int = -1,
) -> dict[str, Any]:
    """logprob_kit `generate_with_logprobs`, token IDs in; a non-200 answer fails."""
    payload: dict[str, Any] = {
        "input_ids": input_ids,
        "sampling_params": {"temperature": 0, "ignore_eos": True, "max_new_tokens": max_new_tokens},
        "return_logprob": True,
        "top_logprobs_num": top_logprobs_num,
        "logprob_start_len": logprob_start_len,
        "return_text_in_logprobs": False,
    }
    if token_ids_logprob is not None:
        payload["token_ids_logprob"] = token_ids_logprob
    reply = await post_json(url + "/generate", payload)
    assert reply.status == 200, f"Server returned {reply.status}: {reply.body}"
    body: dict[str, Any] = reply.body
    return body


def _compare_token_logprobs(target: list[Any], baseline: list[Any], places: int, tag: str) -> None:
    assert len(target) == len(baseline), f"[{tag}] length mismatch"
    for i, (t, b) in enumerate(zip(target, baseline, strict=True)):
        if t[0] is None or b[0] is None:
            continue
        assert t[1] == b[1], f"[{tag}] token_id mismatch at pos {i}: {t[1]} vs {b[1]}"
        assert round(abs(t[0] - b[0]), places) == 0, f"[{tag}] pos {i}: {t[0]} vs {b[0]}"


def _compare_top_logprobs(target: list[Any], baseline: list[Any], places: int, tag: str) -> None:
    assert len(target) == len(baseline), f"[{tag}] length mismatch"
    for pos, (t_top, b_top) in enumerate(zip(target, baseline, strict=True)):
        if t_top is None or b_top is None:
            continue
        dec = {e[1]: e[0] for e in t_top if e[0] is not None}
        scr = {e[1]: e[0] for e in b_top if e[0] is not None}
        common = set(dec) & set(scr)
        assert common, f"[{tag}] pos {pos}: no common top-k IDs"
        for tid in common:
            assert round(abs(dec[tid] - scr[tid]), places) == 0, f"[{tag}] pos {pos} tid={tid}"


def _compare_ids_logprobs(target: list[Any], baseline: list[Any], places: int, tag: str) -> None:
    assert len(target) == len(baseline), f"[{tag}] length mismatch"
    for pos, (t_ids, b_ids) in enumerate(zip(target, baseline, strict=True)):
        if t_ids is None or b_ids is None:
            continue
        dec = {e[1]: e[0] for e in t_ids}
        scr = {e[1]: e[0] for e in b_ids}
        assert set(dec) == set(scr), f"[{tag}] pos {pos}: token IDs differ"
        for tid, value in dec.items():
            assert round(abs(value - scr[tid]), places) == 0, f"[{tag}] pos {pos} tid={tid}"


async def run_logprob_cross_mode_check(
    url: str,
    prompts: list[list[int]] | None = None,
    max_new_tokens: int = 32,
    top_logprobs_num: int = DEFAULT_TOP_LOGPROBS_NUM,
    token_ids_logprob: list[int] | None = None,
    decimal_places: int = DEFAULT_DECIMAL_PLACES,
) -> None:
    """logprob_kit `run_logprob_cross_mode_check`: generate (logprob_start_len 0), then
    score prompt + output by prefill (max_new_tokens 0); every logprob artifact of the
    decode equals the prefill's at the same positions."""
    probes = token_ids_logprob if token_ids_logprob is not None else DEFAULT_PROBE_TOKEN_IDS
    for round_idx, prompt in enumerate(prompts or CROSS_MODE_PROMPTS):
        tag = f"round {round_idx}"
        meta = (
            await generate_with_logprobs(
                url, prompt, max_new_tokens, top_logprobs_num, probes, logprob_start_len=0
            )
        )["meta_info"]
        p = meta["prompt_tokens"]
        full = [t[1] for t in meta["input_token_logprobs"]] + [
            t[1] for t in meta["output_token_logprobs"]
        ]
        score = (await generate_with_logprobs(url, full, 0, top_logprobs_num, probes, 0))[
            "meta_info"
        ]
        _compare_token_logprobs(
            meta["output_token_logprobs"],
            score["input_token_logprobs"][p:],
            decimal_places,
            f"{tag} output_token_logprobs",
        )
        _compare_token_logprobs(
            meta["input_token_logprobs"],
            score["input_token_logprobs"][:p],
            decimal_places,
            f"{tag} input_token_logprobs",
        )
        if top_logprobs_num > 0:
            _compare_top_logprobs(
                meta["output_top_logprobs"],
                score["input_top_logprobs"][p:],
                decimal_places,
                f"{tag} output_top_logprobs",
            )
            _compare_top_logprobs(
                meta["input_top_logprobs"],
                score["input_top_logprobs"][:p],
                decimal_places,
                f"{tag} input_top_logprobs",
            )
        if probes:
            _compare_ids_logprobs(
                meta["output_token_ids_logprobs"],
                score["input_token_ids_logprobs"][p:],
                decimal_places,
                f"{tag} output_token_ids_logprobs",
            )
            if meta.get("input_token_ids_logprobs") is not None:
                _compare_ids_logprobs(
                    meta["input_token_ids_logprobs"],
                    score["input_token_ids_logprobs"][:p],
                    decimal_places,
                    f"{tag} input_token_ids_logprobs",
                )
        assert len(meta["input_token_logprobs"]) == p, f"{tag}: input logprobs != prompt"


async def run_logprob_start_len_check(
    url: str, prompts: list[list[int]] | None = None, max_new_tokens: int = 8
) -> None:
    """logprob_kit `run_logprob_start_len_check`: for start lengths 0, 1, P/2, P-1, the
    input arrays hold P - start entries and the output arrays max_new_tokens."""
    for prompt in prompts or CROSS_MODE_PROMPTS:
        probe = await generate_with_logprobs(url, prompt, 1, 0, None, -1)
        p = probe["meta_info"]["prompt_tokens"]
        for start in [0, 1, p // 2, p - 1]:
            if start >= p:
                continue
            meta = (await generate_with_logprobs(url, prompt, max_new_tokens, 5, None, start))[
                "meta_info"
            ]
            assert len(meta["input_token_logprobs"]) == p - start, (prompt, start)
            assert len(meta["input_top_logprobs"]) == p - start, (prompt, start)
            assert len(meta["output_token_logprobs"]) == max_new_tokens
            assert meta["prompt_tokens"] == start + len(meta["input_token_logprobs"])


# ---------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def router_command(name: str) -> list[str]:
    """The command that runs router `name` from this venv; skips the test when it is not
    installed (both are in the test extras: `sglang-router`, `vllm-router`)."""
    bindir = Path(sys.executable).parent
    exe = bindir / name
    found = str(exe) if exe.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (pip install {name}; it is in the test extras)")
    if name == "sglang-router":
        return [found, "launch"]
    return [found]


@dataclass
class RouterProcess:
    """A router subprocess on a free loopback port; `stop` always ends it (and only it)."""

    name: str
    argv: list[str]
    log_path: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, ready: Callable[[], bool], timeout: float = 30.0) -> None:
        """Start it and wait (bounded) until `ready()`; on timeout, stop it and fail with
        its log."""
        # setsid: its own process group, so that stop() reaches any children it forks
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [*self.argv, "--host", "127.0.0.1", "--port", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                # no proxy: every address here is loopback
                env={**os.environ, "NO_PROXY": "*", "no_proxy": "*"},
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            with contextlib.suppress(Exception):
                if ready():
                    return
            time.sleep(0.1)
        self.stop()
        pytest.fail(f"{self.name} did not become ready in {timeout}s:\n{self.log()[-4000:]}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 15)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 9)
            self.proc.wait(5)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


# ---------------------------------------------------------------------------- wiretap


@dataclass
class Seen:
    """One request the wiretap forwarded."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    status: int = 0  # genmesh's answer


class Wiretap:
    """A transparent HTTP proxy in front of `target` that records every request it
    forwards: what a router sends genmesh (its startup probes, the bodies it rewrites).

    It runs on an event loop of its own, in a thread, so it outlives each test's loop (the
    routers in front of it are module-scoped). Responses are streamed through chunk by
    chunk, so SSE stays SSE."""

    HOP_HEADERS = frozenset(
        ("host", "content-length", "transfer-encoding", "connection", "keep-alive")
    )

    def __init__(self, target: str) -> None:
        self.target = target
        self.seen: list[Seen] = []
        self.startup: list[Seen] = []  # what it saw until mark_started (a router's probes)
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def paths(self) -> list[str]:
        return [f"{s.method} {s.path}" for s in self.seen]

    def mark_started(self) -> None:
        self.startup = list(self.seen)

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)

    def stop(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop.close()

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in self.HOP_HEADERS}
        seen = Seen(request.method, request.path_qs, dict(request.headers), body)
        self.seen.append(seen)
        async with self._session.request(
            request.method, self.target + request.path_qs, data=body, headers=headers
        ) as upstream:
            seen.status = upstream.status
            reply = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for key, value in upstream.headers.items():
                if key.lower() not in self.HOP_HEADERS:
                    reply.headers.add(key, value)
            await reply.prepare(request)
            async for chunk in upstream.content.iter_any():
                await reply.write(chunk)
            await reply.write_eof()
            return reply


def json_of(seen: Seen) -> Any:
    return json.loads(seen.body)

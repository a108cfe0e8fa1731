"""The real sglang-router (PyPI `sglang-router` 0.3.x, a Rust gateway) in front of a genmesh
frontend, as a user would put it in front of SGLang servers: unary and SSE `/generate`
through it. The router adds `model` and `return_bytes` to every body it forwards, which
genmesh must take as SGLang does."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from genmesh.formats.merge import fold
from genmesh.formats.sglang.response import JOINERS, MERGE_RULES
from genmesh.supervisor import free_port
from tests.http_util import post, stream
from tests.inproc import AnyMesh

pytestmark = pytest.mark.inproc

ROUTER = Path(sys.executable).parent / "sglang-router"
START_TIMEOUT_S = 30.0
# The router answers 415 to a body without it (genmesh, like SGLang, does not check it).
JSON = {"content-type": "application/json"}
PROBE = {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}


@contextlib.asynccontextmanager
async def sglang_router(worker_url: str) -> AsyncIterator[str]:
    """sglang-router on a free port, routing to `worker_url`; its URL once it serves."""
    if not ROUTER.exists():
        pytest.fail(f"sglang-router is a dependency of genmesh's tests, but {ROUTER} is missing")
    port = free_port()
    # Its log goes to a file, not a pipe nobody reads while it runs (a full pipe blocks it).
    with tempfile.TemporaryFile() as log:
        process = await asyncio.create_subprocess_exec(
            str(ROUTER),
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            worker_url,
            "--policy",
            "round_robin",
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                # Ready when a request goes through: the router has registered the worker.
                with contextlib.suppress(OSError):
                    probe = await post(url + "/generate", PROBE, headers=JSON)
                    if probe.status == 200:
                        break
                if process.returncode is not None or time.monotonic() > deadline:
                    log.seek(0)
                    pytest.fail(f"sglang-router did not start: {log.read().decode()[-3000:]}")
                await asyncio.sleep(0.2)
            yield url
        finally:
            if process.returncode is None:
                process.terminate()
                try:
                    await asyncio.wait_for(process.wait(), 10)
                except TimeoutError:
                    process.kill()
                    await process.wait()


BODY = {
    "input_ids": [51, 52, 53, 54],
    "sampling_params": {"max_new_tokens": 5, "ignore_eos": True},
    "return_logprob": True,
    "token_ids_logprob": [5, 9],
}


async def test_unary_and_sse_generate_through_sglang_router(mesh: AnyMesh) -> None:
    direct = await post(mesh.http_url + "/generate", BODY)
    assert direct.status == 200, direct.body
    async with sglang_router(mesh.http_url) as url:
        routed = await post(url + "/generate", {**BODY, "rid": "via-router"}, headers=JSON)
        sse = await stream(url + "/generate", BODY)
    assert routed.status == 200, routed.body
    assert routed.body["output_ids"] == direct.body["output_ids"]
    assert len(routed.body["output_ids"]) == 5
    assert routed.body["meta_info"]["id"] == "via-router"
    for key in ("output_token_logprobs", "output_token_ids_logprobs", "input_token_logprobs"):
        assert routed.body["meta_info"][key] == direct.body["meta_info"][key], key

    assert sse.status == 200
    assert sse.events[-1] == "[DONE]"
    records = [e for e in sse.events[:-1] if isinstance(e, dict)]
    assert len(records) >= 5
    folded = fold(records, MERGE_RULES, JOINERS)
    assert folded["output_ids"] == direct.body["output_ids"]
    assert folded["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert (
        folded["meta_info"]["output_token_ids_logprobs"]
        == direct.body["meta_info"]["output_token_ids_logprobs"]
    )

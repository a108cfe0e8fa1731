"""A client ID already running is refused (SGLang's "Duplicate request ID detected"), and
freed again however its request ends: answered, failed, aborted, or its client gone.

The rule is SGLang's `TokenizerManager._init_req_state`
(sgl-project/sglang `python/sglang/srt/managers/tokenizer_manager.py` @ 001067ff): every
rid of the normalised request is refused if it is already in `rid_to_state`, which holds
it until the request finishes or is aborted. The workers decode in real time (~6 ms a
token) so a request is still running when the next one arrives. vLLM takes duplicates (it
makes every request ID unique internally: `InputProcessor.assign_request_id`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest

from tests.conftest import unique_namespace
from tests.http_util import Reply, parse_sse, post
from tests.inproc import InProcessMesh, start_inproc_mesh

pytestmark = pytest.mark.inproc

PROMPT = [5, 6, 7]
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def slow_mesh(nats_url: str) -> Iterator[InProcessMesh]:
    mesh = start_inproc_mesh(
        nats_url,
        namespace=unique_namespace("dup"),
        worker_opts={"vocab_size": 1000, "eos_token_id": 7, "speedup": 1.0},
    )
    yield mesh
    mesh.stop()


def body(rid: Any, max_new_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "input_ids": PROMPT,
        "rid": rid,
        "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True},
        **extra,
    }


async def generate(mesh: InProcessMesh, payload: dict[str, Any], **kw: Any) -> Reply:
    async with asyncio.timeout(TIMEOUT_S):
        return await post(mesh.http_url + "/generate", payload, **kw)


class Running:
    """A streamed request known to be running: its first SSE event has arrived."""

    def __init__(self, response: aiohttp.ClientResponse, first: bytes) -> None:
        self.response = response
        self.first = first

    async def events(self) -> list[Any]:
        """Every event of the stream, the first included, once it has ended."""
        async with asyncio.timeout(TIMEOUT_S):
            rest = await self.response.read()
        return [e for e in parse_sse((self.first + rest).decode()) if e != "[DONE]"]


@contextlib.asynccontextmanager
async def running(
    url: str, payload: dict[str, Any], headers: dict[str, str] | None = None
) -> AsyncIterator[Running]:
    """Start `payload` as a stream and wait for its first event: from then on it is
    running, whatever the load on the machine (no sleep to guess it)."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            url,
            data=json.dumps({**payload, "stream": True}),
            headers={"Content-Type": "application/json", **(headers or {})},
        ) as response,
    ):
        assert response.status == 200, await response.text()
        async with asyncio.timeout(TIMEOUT_S):
            first = await response.content.readuntil(b"\n\n")
        yield Running(response, first)


def is_duplicate(reply: Reply, rid: str) -> bool:
    return reply.status == 400 and reply.body == {
        "error": {"message": f"Duplicate request ID detected: {rid}"}
    }


async def test_running_rid_refused_then_free_after_the_answer(slow_mesh: InProcessMesh) -> None:
    url = slow_mesh.http_url + "/generate"
    async with running(url, body("dup-a", 100)) as first:
        second = await generate(slow_mesh, body("dup-a", 2))
        third = await generate(slow_mesh, {**body("dup-a", 2), "stream": True})
        events = await first.events()
    assert is_duplicate(second, "dup-a"), second.body
    # In a stream too: the refusal comes before any SSE byte (docs/formats.md §2.8).
    assert is_duplicate(third, "dup-a"), third.body
    assert events[-1]["meta_info"]["id"] == "dup-a"
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    again = await generate(slow_mesh, body("dup-a", 2))
    assert again.status == 200, again.body


async def test_batch_item_ids_are_held(slow_mesh: InProcessMesh) -> None:
    """A scalar rid on a batch holds "{rid}_{i}" per item, as SGLang's rid_to_state."""
    url = slow_mesh.http_url + "/generate"
    async with running(url, {**body("dup-b", 100), "input_ids": [PROMPT, PROMPT]}) as first:
        by_item = await generate(slow_mesh, body("dup-b_1", 2))
        in_list = await generate(
            slow_mesh, {**body(["other", "dup-b_0"], 2), "input_ids": [PROMPT, PROMPT]}
        )
        bare = await generate(slow_mesh, body("dup-b", 2))
        events = await first.events()
    assert is_duplicate(by_item, "dup-b_1"), by_item.body
    assert is_duplicate(in_list, "dup-b_0"), in_list.body
    # "dup-b" itself names no running item.
    assert bare.status == 200, bare.body
    assert {e["meta_info"]["id"] for e in events} == {"dup-b_0", "dup-b_1"}


async def test_x_request_id_is_not_a_rid_to_sglang(slow_mesh: InProcessMesh) -> None:
    """genmesh echoes X-Request-Id as the rid when there is none, but SGLang never reads
    the header, so it never refuses two requests that share one: both run."""
    url = slow_mesh.http_url + "/generate"
    headers = {"X-Request-Id": "dup-h"}
    async with running(url, body(None, 100), headers) as first:
        second = await generate(slow_mesh, body(None, 2), headers=headers)
        by_rid = await generate(slow_mesh, body("dup-h", 2))
        events = await first.events()
    assert second.status == 200, second.body
    assert second.body["meta_info"]["id"] == "dup-h"
    assert by_rid.status == 200, by_rid.body
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


async def test_rid_freed_when_the_request_fails(slow_mesh: InProcessMesh) -> None:
    """The engine refuses the first (a token outside its vocabulary) after dispatch."""
    failed = await generate(slow_mesh, {**body("dup-c", 2), "input_ids": [1, 5000]})
    assert failed.status == 400, failed.body
    assert "outside the vocabulary" in failed.body["error"]["message"]
    ok = await generate(slow_mesh, body("dup-c", 2))
    assert ok.status == 200, ok.body


async def test_rid_freed_when_the_client_goes_away(slow_mesh: InProcessMesh) -> None:
    url = slow_mesh.http_url + "/generate"
    async with running(url, body("dup-d", 2000)) as first:
        held = await generate(slow_mesh, body("dup-d", 2))
        first.response.close()  # the client leaves mid-stream
    assert is_duplicate(held, "dup-d"), held.body
    # The frontend notices the disconnect and ends the handler: the rid is free again.
    async with asyncio.timeout(10.0):
        while (reply := await generate(slow_mesh, body("dup-d", 2))).status != 200:
            assert is_duplicate(reply, "dup-d"), reply.body
            await asyncio.sleep(0.05)


async def test_rid_freed_when_aborted(slow_mesh: InProcessMesh) -> None:
    url = slow_mesh.http_url + "/generate"
    async with running(url, body("dup-e", 2000)) as first:
        abort = await post(slow_mesh.http_url + "/abort_request", {"rid": "dup-e"})
        events = await first.events()
    assert abort.status == 200, abort.body
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    ok = await generate(slow_mesh, body("dup-e", 2))
    assert ok.status == 200, ok.body


async def test_n_samples_get_fresh_ids(slow_mesh: InProcessMesh) -> None:
    """With n > 1 SGLang regenerates every rid, so a running rid with n > 1 runs."""
    url = slow_mesh.http_url + "/generate"
    async with running(url, body("dup-f", 100)) as first:
        sampled = await generate(
            slow_mesh, {**body("dup-f", 2), "sampling_params": {"max_new_tokens": 2, "n": 2}}
        )
        await first.events()
    assert sampled.status == 200, sampled.body
    assert len(sampled.body) == 2


async def test_vllm_runs_duplicate_request_ids(slow_mesh: InProcessMesh) -> None:
    url = slow_mesh.http_url + "/inference/v1/generate"
    payload = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 100, "ignore_eos": True}}
    headers = {"X-Request-Id": "dup-vllm"}
    async with running(url, payload, headers) as first:
        second = await post(url, payload, headers={**headers, "Content-Type": "application/json"})
        events = await first.events()
    assert second.status == 200, second.body
    assert second.headers["x-request-id"] == "dup-vllm"
    assert events[-1]["choices"][0]["finish_reason"] == "length"

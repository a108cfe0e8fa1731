"""A prompt at a modern context length (262,144 tokens) goes through the mesh in both
formats: its envelope (4 bytes a token, over 1 MiB) fits the embedded NATS server's
max_payload (`shared/natsserver.py`, 8 MiB as in deploy/nats/mesh.conf), and the mock's
context is set to hold it (`--mock-max-model-len`)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import nats
import pytest

from genmesh.codecs.builtin import MsgpackCodec
from genmesh.shared.envelope import Envelope
from genmesh.shared.natsserver import DEFAULT_MAX_PAYLOAD, NatsServer
from tests.conftest import unique_namespace
from tests.http_util import post
from tests.inproc import InProcessMesh, start_inproc_mesh

pytestmark = pytest.mark.inproc

PROMPT_TOKENS = 262_144
NEW_TOKENS = 4
VOCAB = 150_000  # below the mock's default vocabulary: ids of 5-6 digits, as for a real model
_rng = random.Random(15)
PROMPT = [_rng.randrange(1, VOCAB) for _ in range(PROMPT_TOKENS)]


@pytest.fixture(scope="module")
def long_mesh(nats_url: str) -> Iterator[InProcessMesh]:
    worker = ("--mock-max-model-len", str(PROMPT_TOKENS + 1024))
    mesh = start_inproc_mesh(
        nats_url, namespace=unique_namespace("long"), workers=1, worker_args=[worker]
    )
    yield mesh
    mesh.stop()


@pytest.mark.parametrize("max_payload", [None, 2 * 1024 * 1024])
async def test_the_embedded_server_takes_its_max_payload(max_payload: int | None) -> None:
    """What a client learns on connecting (INFO): 8 MiB by default, else as configured."""
    server = NatsServer() if max_payload is None else NatsServer(max_payload=max_payload)
    url = await asyncio.to_thread(server.start)
    try:
        nc = await nats.connect(url)
        assert nc.max_payload == (max_payload or DEFAULT_MAX_PAYLOAD)
        await nc.close()
    finally:
        await asyncio.to_thread(server.stop)


def test_the_envelope_needs_more_than_nats_default_payload() -> None:
    """What the test is about: the envelope of this prompt is past nats-server's own 1 MiB
    default and within the embedded server's max_payload."""
    size = len(MsgpackCodec().encode(Envelope(id="x" * 32, token_ids=PROMPT).to_wire()))
    assert 1024 * 1024 < size < DEFAULT_MAX_PAYLOAD


async def test_sglang_long_prompt(long_mesh: InProcessMesh) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": NEW_TOKENS}}
    reply = await post(long_mesh.http_url + "/generate", body)
    assert reply.status == 200, reply.body
    assert reply.body["meta_info"]["prompt_tokens"] == PROMPT_TOKENS
    assert len(reply.body["output_ids"]) == NEW_TOKENS


async def test_vllm_long_prompt(long_mesh: InProcessMesh) -> None:
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": NEW_TOKENS}}
    reply = await post(
        long_mesh.http_url + "/inference/v1/generate",
        body,
        headers={"Content-Type": "application/json"},
    )
    assert reply.status == 200, reply.body
    assert reply.body["usage"]["prompt_tokens"] == PROMPT_TOKENS
    assert len(reply.body["choices"][0]["token_ids"]) == NEW_TOKENS

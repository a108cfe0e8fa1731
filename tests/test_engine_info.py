"""Engine info through a mesh: what workers advertise in their cards' `engine_info` is
what the frontend reports where SGLang and vLLM report it (`/get_server_info`,
`/get_model_info`, `/v1/models`), over real NATS and HTTP.

The mesh: model `alpha` on two mock workers with different limits (the frontend reports
the tightest, since the router may pick either), model `beta` on a third, and model
`gamma` on a worker in front of the testkit's mock SGLang server (its limits come from
that server's own info routes, through the SGLang adapter)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import nats
import pytest

from genmesh.codecs import get_codec
from genmesh.shared.bus import flush_in_order, publish
from genmesh.shared.subjects import Subjects
from genmesh.testkit.sglang.info import SGLANG_VERSION
from tests.conftest import unique_namespace
from tests.inproc import InProcessMesh

pytestmark = pytest.mark.inproc

DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 256}
GAMMA_PREFERRED = '{"temperature": 0.3, "top_k": 20}'


def mock_worker(model: str, context: int, kv_blocks: int | None = None) -> tuple[str, ...]:
    args = ["--mock-model", model, "--mock-max-model-len", str(context)]
    if kv_blocks is not None:
        args += ["--mock-kv-blocks", str(kv_blocks), "--mock-block-size", "32"]
        args += ["--mock-sampling-defaults", json.dumps(DEFAULTS)]
    return tuple(args)


@pytest.fixture(scope="module")
def info_mesh(nats_url: str) -> Iterator[InProcessMesh]:
    mesh = InProcessMesh(nats_url, unique_namespace("info"))
    try:
        mesh.add_router()
        _, sglang_url = mesh.spawn_engine_server(
            "sglang",
            *("--model", "gamma", "--max-model-len", "3000", "--max-total-num-tokens", "9000"),
            *("--block-size", "64", "--preferred-sampling-params", GAMMA_PREFERRED),
        )
        ids = [
            mesh.add_worker("wa", wait=False, extra_args=mock_worker("alpha", 4096, 3125)).name,
            mesh.add_worker("wb", wait=False, extra_args=mock_worker("alpha", 2048, 1500)).name,
            mesh.add_worker("wc", wait=False, extra_args=mock_worker("beta", 1024)).name,
            mesh.add_worker("wg", wait=False, engine="sglang", engine_url=sglang_url).name,
        ]
        mesh.add_frontend()
        mesh.wait_for_workers(lambda known: set(ids) <= known, what=f"workers {ids}")
    except BaseException:
        print(mesh.logs())
        mesh.stop()
        raise
    yield mesh
    mesh.stop()


async def get(mesh: InProcessMesh, path: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(mesh.http_url + path) as r:
        assert r.status == 200, await r.text()
        return await r.json()


@pytest.mark.parametrize("path", ["/get_server_info", "/server_info"])
async def test_server_info_reports_the_tightest_limits_of_the_first_model(
    info_mesh: InProcessMesh, path: str
) -> None:
    info = await get(info_mesh, path)
    assert info["model_path"] == "alpha"
    # wb's context and pool are the smaller: a request must fit whichever worker runs it.
    assert info["context_length"] == 2048
    assert info["max_total_num_tokens"] == 48_000  # 1500 blocks of 32
    # SGLang's scheduler: min(context - 1, pool - 1) - 5.
    assert info["max_req_input_len"] == 2047 - 5
    assert info["page_size"] == 32
    assert json.loads(info["preferred_sampling_params"]) == DEFAULTS
    assert info["status"] == "ready"
    assert isinstance(info["version"], str)
    assert info["internal_states"] == [{"num_workers": len(info["genmesh"]["workers"])}]


async def test_server_info_lists_every_models_engine_info(info_mesh: InProcessMesh) -> None:
    engines = (await get(info_mesh, "/get_server_info"))["genmesh"]["engines"]
    assert engines["beta"]["context_length"] == 1024
    assert engines["alpha"]["engine_version"].startswith("genmesh-mock-")
    # gamma's facts come from its SGLang server's /server_info and /v1/models.
    assert engines["gamma"] == {
        "model": "gamma",
        "context_length": 3000,
        "max_total_num_tokens": 9000,
        "block_size": 64,
        "sampling_defaults": {"temperature": 0.3, "top_k": 20},
        "engine_version": f"sglang-{SGLANG_VERSION}",
    }


@pytest.mark.parametrize("path", ["/get_model_info", "/model_info"])
async def test_model_info_has_sglangs_keys_and_the_preferred_params(
    info_mesh: InProcessMesh, path: str
) -> None:
    info = await get(info_mesh, path)
    # The newest SGLang's keys, exactly (its docs notebook asserts this set).
    assert info.keys() == {
        "model_path",
        "is_generation",
        "tokenizer_path",
        "preferred_sampling_params",
        "weight_version",
        "has_image_understanding",
        "has_audio_understanding",
        "model_type",
        "architectures",
    }
    assert info["model_path"] == "alpha"
    assert json.loads(info["preferred_sampling_params"]) == DEFAULTS


async def test_v1_models_gives_each_model_its_own_context_length(
    info_mesh: InProcessMesh,
) -> None:
    listing = await get(info_mesh, "/v1/models")
    lengths = {m["id"]: m["max_model_len"] for m in listing["data"]}
    assert lengths == {"alpha": 2048, "beta": 1024, "gamma": 3000}


async def test_a_card_with_malformed_engine_info_keeps_its_worker(
    info_mesh: InProcessMesh,
) -> None:
    """A worker from another version or language whose `engine_info` is unreadable is
    still a worker; its engine info is simply unknown, and the rest is untouched."""
    subjects = Subjects(info_mesh.namespace)
    card = {
        "v": 1,
        "id": "wodd",
        "subject": subjects.worker_generate("wodd"),
        "model": "alpha",
        "inflight": 0,
        "capacity": 1,
        "heartbeat_s": 60.0,
        "engine_info": {"model": "alpha", "context_length": "lots", "sampling_defaults": 3},
    }
    odd = {**card, "id": "wodd2", "engine_info": ["not", "a", "map"]}
    odd["subject"] = subjects.worker_generate("wodd2")
    nc = await nats.connect(info_mesh.nats_url)
    try:
        for announced in (card, odd):
            await publish(nc, subjects.announce, get_codec(None), announced)
        await flush_in_order(nc)
    finally:
        await nc.close()
    await wait_for(info_mesh, lambda ids: {"wodd", "wodd2"} <= ids)
    info = await get(info_mesh, "/get_server_info")
    # alpha's, as before: the odd cards neither add a limit nor take a stated one away.
    assert info["context_length"] == 2048
    assert info["max_total_num_tokens"] == 48_000  # 1500 blocks of 32
    assert info["page_size"] == 32
    assert json.loads(info["preferred_sampling_params"]) == DEFAULTS
    listing = await get(info_mesh, "/v1/models")
    assert {m["id"] for m in listing["data"]} == {"alpha", "beta", "gamma"}


async def wait_for(mesh: InProcessMesh, predicate: Any, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        workers = (await get(mesh, "/get_server_info"))["genmesh"]["workers"]
        if predicate({w["id"] for w in workers}):
            return
        assert asyncio.get_running_loop().time() < deadline, "the odd workers never joined"
        await asyncio.sleep(0.05)

"""The mock SGLang and vLLM servers in P/D mode (`--disaggregation-mode prefill|decode`).

Reference: `engine-apis.md` §C. Each pair is two apps on real sockets in this process: the
decode side takes its prefill's KV handle over HTTP (`genmesh.testkit.pd`), so a pair that
answers at all has really paired. After every pair, both servers hold no handle.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from genmesh.testkit.common import serving
from genmesh.testkit.config import MockServerConfig
from genmesh.testkit.sglang import build_app as sglang_app
from genmesh.testkit.vllm import build_app as vllm_app
from tests.mesh import free_port
from tests.testkit.test_sglang_server import eventually

pytestmark = pytest.mark.inproc

BASE = MockServerConfig(vocab_size=1000, eos_token_id=7, max_model_len=4096)
PROMPT = list(range(100, 140))  # 40 tokens: two full vLLM blocks of 16
VLLM_PATH = "/inference/v1/generate"


@dataclasses.dataclass
class Trio:
    """An aggregated server and a prefill/decode pair of the same engine."""

    agg: str
    prefill: str
    decode: str

    @property
    def prefill_port(self) -> int:
        return int(self.prefill.rsplit(":", 1)[1])


@contextlib.asynccontextmanager
async def trio(engine: str, timeout_s: float = 5.0) -> AsyncIterator[Trio]:
    build = sglang_app if engine == "sglang" else vllm_app

    def config(mode: str) -> MockServerConfig:
        return dataclasses.replace(
            BASE, disaggregation_mode=mode, disaggregation_timeout_s=timeout_s
        )

    async with (
        serving(build(BASE)) as agg,
        serving(build(config("prefill"))) as prefill,
        serving(build(config("decode"))) as decode,
    ):
        yield Trio(agg, prefill, decode)
        for url in (prefill, decode):  # nothing left behind
            assert (await get(f"{url}/testkit/pd"))["handles"] == []
            assert (await get(f"{url}/testkit/state"))["running"] == []


async def get(url: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url) as resp:
        assert resp.status == 200
        return await resp.json()


async def post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as resp:
        text = await resp.text()
        return resp.status, json.loads(text) if text else None


# ---------------------------------------------------------------- SGLang


def sglang_body(room: int | None, port: int, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0},
        **extra,
    }
    if room is not None:
        body |= {"bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": room}
    return body


async def test_sglang_pair_answers_the_aggregated_tokens() -> None:
    async with trio("sglang") as t:
        body = sglang_body(42, t.prefill_port, return_logprob=True)
        agg_status, agg = await post(f"{t.agg}/generate", body)
        (p_status, pre), (d_status, dec) = await asyncio.gather(
            post(f"{t.prefill}/generate", body), post(f"{t.decode}/generate", body)
        )
    assert (agg_status, p_status, d_status) == (200, 200, 200)
    assert len(agg["output_ids"]) == 6
    assert dec["output_ids"] == agg["output_ids"]
    assert dec["meta_info"]["finish_reason"] == agg["meta_info"]["finish_reason"]
    assert dec["meta_info"]["output_token_logprobs"] == agg["meta_info"]["output_token_logprobs"]
    # The prefill's reply: the first token only, finished length 0 (prefill.py FINISH_LENGTH).
    assert pre["output_ids"] == agg["output_ids"][:1]
    assert pre["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert pre["meta_info"]["completion_tokens"] == 1
    assert pre["meta_info"]["input_token_logprobs"] == agg["meta_info"]["input_token_logprobs"]
    # The decode ran no prompt logprobs: the prefill did.
    assert dec["meta_info"]["input_token_logprobs"] == []


async def test_sglang_decode_first_token_comes_from_the_prefill() -> None:
    """The prefill ran another prompt: the decode delivers the prefill's first token."""
    async with trio("sglang") as t:
        body = sglang_body(5, t.prefill_port)
        other = {**body, "input_ids": [*PROMPT[:-1], 999]}
        (_, pre), (_, dec) = await asyncio.gather(
            post(f"{t.prefill}/generate", other), post(f"{t.decode}/generate", body)
        )
        _, agg = await post(f"{t.agg}/generate", body)
    assert dec["output_ids"][0] == pre["output_ids"][0]
    assert pre["output_ids"][0] != agg["output_ids"][0]


@pytest.mark.parametrize("side", ["prefill", "decode"])
async def test_sglang_request_without_room_is_refused(side: str) -> None:
    async with trio("sglang") as t:
        url = t.prefill if side == "prefill" else t.decode
        status, body = await post(f"{url}/generate", sglang_body(None, 0, rid="r1"))
    assert status == 400
    assert body == {
        "error": {
            "message": "Invalid request: Disaggregated request received without bootstrap "
            "room id. rid='r1'"
        }
    }


async def test_sglang_decode_of_an_unknown_room_fails_500() -> None:
    async with trio("sglang", timeout_s=0.3) as t:
        status, body = await post(f"{t.decode}/generate", sglang_body(7, t.prefill_port, rid="d"))
    assert status == 500
    assert body["message"] == (
        "Decode transfer failed for request rank=0 decode_req.req.rid='d' "
        "decode_req.req.bootstrap_room=7 with exception "
        "KVTransferError(bootstrap_room=7): no KV handle for 7"
    )
    assert body["code"] == 500


async def test_sglang_prefill_whose_decode_never_comes_fails_500() -> None:
    async with trio("sglang", timeout_s=0.3) as t:
        status, body = await post(f"{t.prefill}/generate", sglang_body(8, t.prefill_port, rid="p"))
        # The handle is gone (expired): a decode that comes late finds nothing.
        late, _ = await post(f"{t.decode}/generate", sglang_body(8, t.prefill_port))
    assert status == 500
    assert body["message"] == (
        "Prefill transfer failed for request rank=0 req.rid='p' req.bootstrap_room=8 with "
        "exception KVTransferError(bootstrap_room=8): timed out after 0.3s waiting for the "
        "decode instance to take the KV"
    )
    assert late == 500


async def test_sglang_decode_of_an_aborted_prefill_fails_500() -> None:
    async with trio("sglang") as t:
        body = sglang_body(9, t.prefill_port, rid="p9")
        prefill = asyncio.create_task(post(f"{t.prefill}/generate", body))

        async def offered() -> bool:
            return bool((await get(f"{t.prefill}/testkit/pd"))["handles"])

        await eventually(offered)
        await post(f"{t.prefill}/abort_request", {"rid": "p9"})
        status, reply = await post(f"{t.decode}/generate", {**body, "rid": "d9"})
        await prefill
    assert status == 500
    assert reply["message"].endswith(
        "decode_req.req.bootstrap_room=9 with exception "
        "KVTransferError(bootstrap_room=9): Aborted by AbortReq."
    )


async def test_sglang_decode_with_a_dead_prefill_fails_500() -> None:
    async with trio("sglang") as t:
        status, body = await post(f"{t.decode}/generate", sglang_body(3, 1))  # nobody there
    assert status == 500
    assert "KVTransferError(bootstrap_room=3): prefill server unreachable" in body["message"]


async def test_sglang_server_info_reports_the_mode() -> None:
    async with trio("sglang") as t:
        assert (await get(f"{t.prefill}/server_info"))["disaggregation_mode"] == "prefill"
        assert (await get(f"{t.agg}/server_info"))["disaggregation_mode"] == "null"


# ---------------------------------------------------------------- vLLM


def vllm_body(**extra: Any) -> dict[str, Any]:
    return {"token_ids": PROMPT, "sampling_params": {"max_tokens": 6, "temperature": 0}, **extra}


def to_prefill(body: dict[str, Any]) -> dict[str, Any]:
    """Stage 1 of a vLLM P/D proxy (§C.3)."""
    params = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    sampling = {**body["sampling_params"], "max_tokens": 1}
    return {**body, "sampling_params": sampling, "kv_transfer_params": params}


async def test_vllm_pair_answers_the_aggregated_tokens() -> None:
    async with trio("vllm") as t:
        body = vllm_body(request_id="r1")
        _, agg = await post(f"{t.agg}{VLLM_PATH}", body)
        p_status, pre = await post(f"{t.prefill}{VLLM_PATH}", to_prefill(body))
        params = pre["kv_transfer_params"]
        assert (await get(f"{t.prefill}/testkit/pd"))["handles"] == ["generate-tokens-r1"]
        d_status, dec = await post(f"{t.decode}{VLLM_PATH}", {**body, "kv_transfer_params": params})
    assert (p_status, d_status) == (200, 200)
    assert dec["choices"][0]["token_ids"] == agg["choices"][0]["token_ids"]
    assert len(dec["choices"][0]["token_ids"]) == 6
    assert dec.get("kv_transfer_params") is None
    # The prefill's reply: length-capped after one token, the params naming its full blocks.
    assert pre["choices"][0]["finish_reason"] == "length"
    assert len(pre["choices"][0]["token_ids"]) == 1
    assert params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[0, 1]],
        "remote_engine_id": params["remote_engine_id"],
        "remote_request_id": "generate-tokens-r1",
        "remote_host": "127.0.0.1",
        "remote_port": t.prefill_port,
        "tp_size": 1,
    }


async def test_vllm_prefill_stopped_early_returns_no_params() -> None:
    """`request_finished`: kv_transfer_params only on a length-capped finish."""
    async with trio("vllm") as t:
        body = to_prefill(vllm_body())
        body["sampling_params"] |= {"max_tokens": 4, "stop_token_ids": [], "ignore_eos": False}
        _, agg = await post(f"{t.agg}{VLLM_PATH}", vllm_body())
        first = agg["choices"][0]["token_ids"][0]
        body["sampling_params"]["stop_token_ids"] = [first]
        status, pre = await post(f"{t.prefill}{VLLM_PATH}", body)
    assert status == 200
    assert pre["choices"][0]["finish_reason"] == "stop"
    assert pre.get("kv_transfer_params") is None


async def test_vllm_short_prompt_keeps_no_blocks() -> None:
    """Less than one full block: nothing to send, nothing kept, decode computes alone."""
    async with trio("vllm") as t:
        body = {**vllm_body(), "token_ids": PROMPT[:10]}
        _, pre = await post(f"{t.prefill}{VLLM_PATH}", to_prefill(body))
        assert pre["kv_transfer_params"]["remote_block_ids"] == [[]]
        assert (await get(f"{t.prefill}/testkit/pd"))["handles"] == []
        status, dec = await post(
            f"{t.decode}{VLLM_PATH}", {**body, "kv_transfer_params": pre["kv_transfer_params"]}
        )
        _, agg = await post(f"{t.agg}{VLLM_PATH}", body)
    assert status == 200
    assert dec["choices"][0]["token_ids"] == agg["choices"][0]["token_ids"]


LOAD_FAILED = {
    "error": {
        "message": "Internal server error",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}


@pytest.mark.parametrize("case", ["taken_twice", "wrong_engine", "expired", "dead"])
async def test_vllm_decode_whose_blocks_cannot_be_read_fails_500(case: str) -> None:
    async with trio("vllm", timeout_s=0.2) as t:
        body = vllm_body(request_id=f"r-{case}")
        _, pre = await post(f"{t.prefill}{VLLM_PATH}", to_prefill(body))
        params = pre["kv_transfer_params"]
        if case == "taken_twice":
            ok, _ = await post(f"{t.decode}{VLLM_PATH}", {**body, "kv_transfer_params": params})
            assert ok == 200
        elif case == "wrong_engine":
            params = {**params, "remote_engine_id": "another-engine"}
        elif case == "expired":
            await asyncio.sleep(0.3)
        else:
            params = {**params, "remote_port": 1}
        status, reply = await post(f"{t.decode}{VLLM_PATH}", {**body, "kv_transfer_params": params})
        if case in ("dead", "wrong_engine"):  # unread blocks stay until the abort timeout
            kept = (await get(f"{t.prefill}/testkit/pd"))["handles"]
            assert kept == [f"generate-tokens-r-{case}"]
            await asyncio.sleep(0.3)
    assert status == 500
    assert reply == LOAD_FAILED


async def test_vllm_streaming_decode_failure_is_in_band() -> None:
    async with trio("vllm", timeout_s=0.2) as t:
        params = {"do_remote_prefill": True, "remote_block_ids": [[0]], "remote_engine_id": "e",
                  "remote_request_id": "nobody", "remote_host": "127.0.0.1",
                  "remote_port": t.prefill_port}  # fmt: skip
        body = {**vllm_body(), "stream": True, "kv_transfer_params": params}
        async with aiohttp.ClientSession() as s, s.post(f"{t.decode}{VLLM_PATH}", json=body) as r:
            status, text = r.status, await r.text()
    assert status == 200
    assert text == f"data: {json.dumps(LOAD_FAILED, separators=(',', ':'))}\n\ndata: [DONE]\n\n"


async def test_default_servers_have_no_pd_routes() -> None:
    async with (
        serving(sglang_app(BASE)) as s,
        serving(vllm_app(BASE)) as v,
        aiohttp.ClientSession() as session,
    ):
        for url in (s, v):
            async with session.get(f"{url}/testkit/pd") as resp:
                assert resp.status == 404


# ---------------------------------------------------------------- the CLI


@contextlib.asynccontextmanager
async def cli_server(engine: str, mode: str) -> AsyncIterator[str]:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "genmesh", "testkit", engine, "--port", str(port),
        "--vocab-size", "1000", "--eos-token-id", "7", "--disaggregation-mode", mode,
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        await asyncio.wait_for(proc.stdout.readline(), 30)
        yield f"http://127.0.0.1:{port}"
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.process
async def test_two_cli_processes_pair() -> None:
    async with (
        cli_server("sglang", "prefill") as prefill,
        cli_server("sglang", "decode") as decode,
        serving(sglang_app(BASE)) as agg,
    ):
        body = sglang_body(11, int(prefill.rsplit(":", 1)[1]))
        (_, pre), (status, dec) = await asyncio.gather(
            post(f"{prefill}/generate", body), post(f"{decode}/generate", body)
        )
        _, expected = await post(f"{agg}/generate", body)
        assert (await get(f"{prefill}/testkit/pd"))["handles"] == []
    assert status == 200
    assert pre["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert dec["output_ids"] == expected["output_ids"]


async def stream_events(url: str, body: dict[str, Any]) -> list[Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json={**body, "stream": True}) as resp:
        assert resp.status == 200
        text = await resp.text()
    datas = [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in datas]


async def test_sglang_streaming_decode_streams_the_aggregated_tokens() -> None:
    async with trio("sglang") as t:
        body = sglang_body(21, t.prefill_port)
        _, agg = await post(f"{t.agg}/generate", body)
        (_, pre), events = await asyncio.gather(
            post(f"{t.prefill}/generate", body), stream_events(f"{t.decode}/generate", body)
        )
    assert events[-1] == "[DONE]"
    assert events[-2]["output_ids"] == agg["output_ids"]  # cumulative chunks
    assert events[0]["output_ids"] == pre["output_ids"]


async def test_sglang_streamed_request_without_room_aborts_before_any_token() -> None:
    async with trio("sglang") as t:
        events = await stream_events(f"{t.decode}/generate", sglang_body(None, 0, rid="s1"))
    chunk, done = events
    assert done == "[DONE]"
    assert chunk["output_ids"] == []
    assert chunk["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "Invalid request: Disaggregated request received without bootstrap room "
        "id. rid='s1'",
        "status_code": 400,
        "err_type": "BadRequestError",
    }


async def test_sglang_prefill_client_gone_fails_its_decode() -> None:
    async with trio("sglang") as t:
        body = sglang_body(31, t.prefill_port, rid="p31")
        async with aiohttp.ClientSession() as s:
            gone = asyncio.create_task(s.post(f"{t.prefill}/generate", json=body))

            async def offered() -> bool:
                return bool((await get(f"{t.prefill}/testkit/pd"))["handles"])

            await eventually(offered)
            gone.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gone
        status, reply = await post(f"{t.decode}/generate", {**body, "rid": "d31"})
    assert status == 500
    assert reply["message"].endswith("KVTransferError(bootstrap_room=31): Aborted by AbortReq.")


async def test_the_transfer_route_answers() -> None:
    async with trio("vllm") as t, aiohttp.ClientSession() as s:
        body = vllm_body(request_id="q")
        _, pre = await post(f"{t.prefill}{VLLM_PATH}", to_prefill(body))
        engine = pre["kv_transfer_params"]["remote_engine_id"]
        kv = f"{t.prefill}/testkit/pd/kv"
        cases = [
            (f"{kv}/none?wait_s=0", 404, {"error": "no KV handle for none"}),
            (f"{t.decode}/testkit/pd/kv/x", 404, {"error": "not a prefill server"}),
            (f"{kv}/generate-tokens-q?wait_s=x", 400, {"error": "wait_s must be a number"}),
            (
                f"{kv}/generate-tokens-q?engine_id=other",
                410,
                {"error": "the KV handle for generate-tokens-q belongs to another engine"},
            ),
            (
                f"{kv}/generate-tokens-q?engine_id={engine}",
                200,
                {"payload": {"engine_id": engine, "block_ids": [[0, 1]]}},
            ),
        ]
        for url, status, answer in cases:
            async with s.get(url) as resp:
                assert (resp.status, await resp.json()) == (status, answer), url

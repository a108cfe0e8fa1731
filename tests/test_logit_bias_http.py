"""`logit_bias` through the whole mesh: the frontend carries it in the native body, the
mock honours it (engines/logit_bias.py), and each format reports the logprobs its real
engine reports: SGLang's after the bias, vLLM's before it. A key outside the mock's
vocabulary comes back as the engine's 400 in the format's error shape."""

from __future__ import annotations

from typing import Any

import pytest

from tests.http_util import post, stream
from tests.inproc import InProcessMesh

pytestmark = pytest.mark.inproc

JSON = {"Content-Type": "application/json"}
PROMPT = [21, 22, 23]
TARGET = 977


def sglang_body(bias: dict[str, float] | None, **extra: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"max_new_tokens": 3, "ignore_eos": True}
    if bias is not None:
        params["logit_bias"] = bias
    return {
        "input_ids": PROMPT,
        "sampling_params": params,
        "return_logprob": True,
        "top_logprobs_num": 2,
        **extra,
    }


def vllm_body(bias: dict[str, float] | None) -> dict[str, Any]:
    params: dict[str, Any] = {"max_tokens": 3, "ignore_eos": True, "logprobs": 2}
    if bias is not None:
        params["logit_bias"] = bias
    return {"token_ids": PROMPT, "sampling_params": params}


async def test_sglang_forced_token_and_biased_logprobs(mesh: InProcessMesh) -> None:
    url = mesh.http_url + "/generate"
    free = await post(url, sglang_body(None))
    forced = await post(url, sglang_body({str(TARGET): 100.0}))
    assert free.status == forced.status == 200, (free.body, forced.body)
    assert TARGET not in free.body["output_ids"]
    assert forced.body["output_ids"] == [TARGET] * 3
    meta = forced.body["meta_info"]
    for (logprob, token, _), top in zip(
        meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True
    ):
        assert token == TARGET
        assert logprob == pytest.approx(0.0, abs=1e-3)  # the bias holds all the mass
        assert top[0][:2] == [logprob, TARGET]
        assert top[1][0] < -50.0
    # The prompt is not sampled, so its logprobs are the unbiased ones.
    assert meta["input_token_logprobs"] == free.body["meta_info"]["input_token_logprobs"]


async def test_sglang_stream_carries_the_same_tokens(mesh: InProcessMesh) -> None:
    reply = await stream(mesh.http_url + "/generate", sglang_body({str(TARGET): 100.0}))
    assert reply.status == 200
    chunks = [e for e in reply.events if e != "[DONE]"]
    assert [t for c in chunks for t in c["output_ids"]] == [TARGET] * 3


async def test_vllm_forced_token_with_raw_logprobs(mesh: InProcessMesh) -> None:
    url = mesh.http_url + "/inference/v1/generate"
    free = await post(url, vllm_body(None), headers=JSON)
    forced = await post(url, vllm_body({str(TARGET): 100.0}), headers=JSON)
    assert free.status == forced.status == 200, (free.body, forced.body)
    choice, free_choice = forced.body["choices"][0], free.body["choices"][0]
    assert choice["token_ids"] == [TARGET] * 3
    first, free_first = choice["logprobs"]["content"][0], free_choice["logprobs"]["content"][0]
    # Same first position, so the same raw candidates: the raw best keeps its logprob
    # and rank 1 beside the forced token, which shows its raw logprob and rank (vLLM's
    # raw_logprobs), not the ~0 a biased log-softmax would give.
    raw_best = free_first["top_logprobs"][0]
    assert raw_best["rank"] == 1
    assert raw_best in first["top_logprobs"]
    sampled = next(e for e in first["top_logprobs"] if e["token_id"] == TARGET)
    assert sampled["token_id"] == TARGET
    assert sampled["logprob"] == first["logprob"]
    assert sampled["rank"] > 2
    assert first["logprob"] < free_first["top_logprobs"][-1]["logprob"]


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        (
            "/generate",
            sglang_body({"5000": 1.0}),
            "logit_bias must has keys in [0, 999], got 5000.",
        ),
        (
            "/inference/v1/generate",
            vllm_body({"5000": 1.0}),
            "token_id(s) [5000] in logit_bias contain out-of-vocab token ids. "
            "Vocabulary size: 1000",
        ),
    ],
)
async def test_out_of_vocabulary_bias_is_a_400(
    mesh: InProcessMesh, path: str, body: dict[str, Any], message: str
) -> None:
    reply = await post(mesh.http_url + path, body, headers=JSON)
    assert reply.status == 400, reply.body
    error = reply.body["error"]
    assert error["message"] == message

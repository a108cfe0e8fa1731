"""Port of SGLang's skip-tokenizer-init HTTP tests (token IDs in, token IDs out).

Origin: sgl-project/sglang `test/registered/tokenizer/test_skip_tokenizer_init.py`
@ 05f70dc503324fcbc7cb999e78ab990f27a9597e, class `TestSkipTokenizerInit` (server flags
`--skip-tokenizer-init --incremental-streaming-output`, which is what genmesh's SGLang
format always is).

Adapted: the prompt's token IDs come from a tokenizer upstream ("The capital of France
is"); here they are fixed IDs inside the shared mock's vocabulary (1000). The model's
`eos_token_id` is the mock's (7). `stop_token_ids` stays upstream's `[119690]`, an ID
outside this vocabulary: SGLang does not check it against the vocabulary, neither may
genmesh. `TestSkipTokenizerInitVLM` needs images and a VLM processor: not ported.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.http_util import stream
from tests.inproc import InProcessMesh
from tests.upstream.kit import post_json

pytestmark = pytest.mark.inproc

INPUT_IDS = [128, 791, 686, 315, 982, 374]  # stands for "The capital of France is"
EOS_TOKEN_ID = 7  # the shared mesh's mock (tests/conftest.py SHARED_WORKERS)
STOP_TOKEN_IDS = [119690]  # upstream's cls.eos_token_id, passed as stop_token_ids


def request_json(
    max_new_tokens: int = 32,
    return_logprob: bool = False,
    top_logprobs_num: int = 0,
    stream: bool = False,
    n: int = 1,
) -> dict[str, Any]:
    """Upstream `get_request_json`."""
    return {
        "input_ids": INPUT_IDS,
        "sampling_params": {
            "temperature": 0 if n == 1 else 0.5,
            "max_new_tokens": max_new_tokens,
            "n": n,
            "stop_token_ids": STOP_TOKEN_IDS,
        },
        "stream": stream,
        "return_logprob": return_logprob,
        "top_logprobs_num": top_logprobs_num,
        "logprob_start_len": 0,
    }


async def run_decode(
    mesh: InProcessMesh,
    max_new_tokens: int = 32,
    return_logprob: bool = False,
    top_logprobs_num: int = 0,
    n: int = 1,
) -> None:
    """Upstream `run_decode`, its assertions unchanged."""
    request = request_json(max_new_tokens, return_logprob, top_logprobs_num, n=n)
    reply = await post_json(mesh.http_url + "/generate", request)
    assert reply.status == 200, reply.body
    ret = reply.body

    def assert_one_item(item: dict[str, Any]) -> None:
        finish = item["meta_info"]["finish_reason"]
        if finish["type"] == "stop":
            assert finish["matched"] == EOS_TOKEN_ID
        elif finish["type"] == "length":
            assert len(item["output_ids"]) == item["meta_info"]["completion_tokens"]
            assert len(item["output_ids"]) == max_new_tokens
            assert item["meta_info"]["prompt_tokens"] == len(INPUT_IDS)
            if return_logprob:
                num_input_logprobs = len(INPUT_IDS) - request["logprob_start_len"]
                if num_input_logprobs > len(INPUT_IDS):
                    num_input_logprobs -= len(INPUT_IDS)
                assert len(item["meta_info"]["input_token_logprobs"]) == num_input_logprobs
                assert len(item["meta_info"]["output_token_logprobs"]) == max_new_tokens
        else:  # upstream tolerates nothing else either (it would KeyError on "matched")
            raise AssertionError(f"unexpected finish_reason {finish}")

    if n == 1:
        assert_one_item(ret)
    else:
        assert len(ret) == n
        for i in range(n):
            assert_one_item(ret[i])


async def test_simple_decode(mesh: InProcessMesh) -> None:
    await run_decode(mesh)


async def test_parallel_sample(mesh: InProcessMesh) -> None:
    await run_decode(mesh, n=3)


@pytest.mark.parametrize("top_logprobs_num", [0, 3])
async def test_logprob(mesh: InProcessMesh, top_logprobs_num: int) -> None:
    await run_decode(mesh, return_logprob=True, top_logprobs_num=top_logprobs_num)


async def test_eos_behavior(mesh: InProcessMesh) -> None:
    await run_decode(mesh, max_new_tokens=256)


async def test_simple_decode_stream(mesh: InProcessMesh) -> None:
    """Upstream `run_decode_stream`: the streamed output_ids (incremental) add up to the
    unary ones. Upstream flushes the cache before each request and ignores the answer;
    so does this port."""
    await post_json(mesh.http_url + "/flush_cache", None)
    unary = await post_json(mesh.http_url + "/generate", request_json())
    assert unary.status == 200, unary.body
    output_ids = unary.body["output_ids"]

    await post_json(mesh.http_url + "/flush_cache", None)
    streamed = await stream(mesh.http_url + "/generate", request_json(stream=True))
    assert streamed.status == 200, streamed.raw
    out_stream_ids = [
        t for event in streamed.events if event != "[DONE]" for t in event["output_ids"]
    ]
    assert output_ids == out_stream_ids

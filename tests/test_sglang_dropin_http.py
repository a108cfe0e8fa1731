"""SGLang /generate over HTTP as a drop-in (issue 11): what a router adds to every body,
`token_ids_logprob` compared field by field with the testkit's mock SGLang server (an
implementation of SGLang's wire format written apart from genmesh's), and the context
checks SGLang makes, from the workers' advertised context length."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from genmesh.formats.merge import fold
from genmesh.formats.sglang.response import JOINERS, MERGE_RULES
from genmesh.testkit.common import serving
from genmesh.testkit.config import MockServerConfig
from genmesh.testkit.sglang import build_app
from tests.conftest import unique_namespace
from tests.http_util import post, stream
from tests.inproc import AnyMesh, InProcessMesh, start_inproc_mesh

pytestmark = pytest.mark.inproc

VOCAB, EOS = 1000, 7  # the shared mesh's mock settings (tests/conftest.py)
LOGPROB_KEYS = (
    "input_token_logprobs",
    "output_token_logprobs",
    "output_token_logprobs_length",
    "input_token_ids_logprobs",
    "output_token_ids_logprobs",
)


def _records(events: list[Any]) -> list[dict[str, Any]]:
    assert events[-1] == "[DONE]"
    return [e for e in events[:-1] if isinstance(e, dict)]


async def test_a_routers_model_and_return_bytes_are_ignored(mesh: AnyMesh) -> None:
    """sglang-router 0.3.x adds both to every /generate body it forwards."""
    body = {
        "input_ids": [21, 22, 23],
        "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
        "model": "whatever-the-router-says",
        "return_bytes": False,
    }
    plain = await post(mesh.http_url + "/generate", {"input_ids": [21, 22, 23],
                       "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})  # fmt: skip
    reply = await post(mesh.http_url + "/generate", body)
    assert reply.status == 200, reply.body
    assert reply.body["output_ids"] == plain.body["output_ids"]
    assert len(reply.body["output_ids"]) == 3
    sse = await stream(mesh.http_url + "/generate", body)
    assert sse.status == 200
    records = _records(sse.events)
    assert [t for r in records for t in r["output_ids"]] == plain.body["output_ids"]


@pytest.mark.parametrize("incremental", [False, True])
async def test_token_ids_logprob_matches_the_mock_sglang_server(
    mesh: AnyMesh, incremental: bool
) -> None:
    body = {
        "input_ids": [31, 32, 33, 34],
        "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": 1,
        "token_ids_logprob": [5, 900, 5],
    }
    config = MockServerConfig(vocab_size=VOCAB, eos_token_id=EOS, incremental=incremental)
    async with serving(build_app(config)) as url:
        native = await post(url + "/generate", body)
        native_sse = await stream(url + "/generate", body)
    ours = await post(mesh.http_url + "/generate", body)
    assert native.status == ours.status == 200, (native.body, ours.body)
    assert ours.body["output_ids"] == native.body["output_ids"]
    for key in LOGPROB_KEYS:
        assert ours.body["meta_info"][key] == native.body["meta_info"][key], key
    meta = ours.body["meta_info"]
    assert len(meta["output_token_ids_logprobs"]) == 4
    assert meta["input_token_ids_logprobs"][0] is None
    assert [[e[1] for e in row] for row in meta["input_token_ids_logprobs"][1:]] == [
        [5, 900, 5]
    ] * 2

    # Streamed: genmesh sends deltas (SGLang's --incremental-streaming-output); folding
    # either server's records by the format's merge rules gives the same lists.
    ours_sse = await stream(mesh.http_url + "/generate", body)
    folded = fold(_records(ours_sse.events), MERGE_RULES, JOINERS)["meta_info"]
    native_records = _records(native_sse.events)
    if incremental:
        native_folded = fold(native_records, MERGE_RULES, JOINERS)["meta_info"]
    else:  # cumulative chunks: the last one holds everything
        native_folded = native_records[-1]["meta_info"]
    for key in LOGPROB_KEYS:
        assert folded[key] == native_folded[key] == native.body["meta_info"][key], key
    for record in _records(ours_sse.events):
        # the prompt's lists come whole on every chunk, as in SGLang
        assert record["meta_info"]["input_token_ids_logprobs"] == meta["input_token_ids_logprobs"]


async def test_token_ids_logprob_out_of_the_vocabulary_is_the_engines_400(mesh: AnyMesh) -> None:
    body = {"input_ids": [1, 2], "return_logprob": True, "token_ids_logprob": [3, VOCAB]}
    reply = await post(mesh.http_url + "/generate", body)
    assert reply.status == 400
    assert reply.body == {
        "error": {
            "message": f"token_ids_logprob contains out-of-vocabulary token id {VOCAB}; "
            f"valid range is [0, {VOCAB})."
        }
    }


CONTEXT = 64


@pytest.fixture(scope="module")
def short_mesh(nats_url: str) -> Iterator[InProcessMesh]:
    """Workers whose engine has a 64-token context and a generation config asking for 3
    new tokens, which their cards advertise."""
    own = start_inproc_mesh(
        nats_url,
        namespace=unique_namespace("ctx"),
        workers=1,
        worker_opts={
            "vocab_size": VOCAB,
            "eos_token_id": EOS,
            "extra_args": (
                "--mock-max-model-len",
                str(CONTEXT),
                "--mock-sampling-defaults",
                '{"max_new_tokens": 3, "top_k": 1}',
            ),
        },
    )
    yield own
    own.stop()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"input_ids": [1] * CONTEXT},
            f"The input ({CONTEXT} tokens) is longer than the model's context length "
            f"({CONTEXT} tokens).",
        ),
        (
            {"input_ids": [1] * 60, "sampling_params": {"max_new_tokens": 5}},
            "Requested token count exceeds the model's maximum context length of 64 tokens. "
            "You requested a total of 65 tokens: 60 tokens from the input messages and 5 "
            "tokens for the completion. Please reduce the number of tokens in the input "
            "messages or the completion to fit within the limit.",
        ),
    ],
)
async def test_context_checks_use_the_advertised_context_length(
    short_mesh: InProcessMesh, body: dict[str, Any], message: str
) -> None:
    for streaming in (False, True):
        reply = await post(short_mesh.http_url + "/generate", {**body, "stream": streaming})
        assert reply.status == 400, reply.body
        assert reply.body == {"error": {"message": message}}


async def test_a_request_that_fits_the_context_is_served(short_mesh: InProcessMesh) -> None:
    body = {"input_ids": [1] * 60, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    reply = await post(short_mesh.http_url + "/generate", body)
    assert reply.status == 200, reply.body
    assert len(reply.body["output_ids"]) == 4


async def test_the_engines_sampling_defaults_apply_to_unset_params(
    short_mesh: InProcessMesh,
) -> None:
    """SGLang's `{**preferred_sampling_params, **sampling_params}`, from the card."""
    body: dict[str, Any] = {"input_ids": [1, 2], "sampling_params": {"ignore_eos": True}}
    reply = await post(short_mesh.http_url + "/generate", body)
    assert reply.status == 200, reply.body
    assert len(reply.body["output_ids"]) == 3
    assert reply.body["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    body["sampling_params"]["max_new_tokens"] = 5  # the request's own wins
    reply = await post(short_mesh.http_url + "/generate", body)
    assert len(reply.body["output_ids"]) == 5

"""Multimodal `features` at the engines: the vLLM adapter sends them to the server as the
client sent them; the mock engine (no vision model) serves them with the tokens a
text-only prompt gets and refuses a layout vLLM refuses, in vLLM's words."""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import pytest

from genmesh.engines.base import EngineOutput
from genmesh.engines.mock import MockConfig, MockEngine
from genmesh.engines.sglang import sglang_body
from genmesh.engines.vllm import vllm_request
from genmesh.formats.vllm import VllmFormat
from genmesh.shared.envelope import Envelope, Sampling, TokenIds
from genmesh.shared.errors import ErrorCode, MeshError

pytestmark = pytest.mark.unit

PROMPT = list(range(10, 50))


def images(*ranges: tuple[int, int]) -> dict[str, list[dict[str, int]]]:
    return {"image": [{"offset": offset, "length": length} for offset, length in ranges]}


FEATURES: dict[str, Any] = {
    "mm_hashes": {"image": ["a" * 64, "b" * 64]},
    "mm_placeholders": images((4, 8), (20, 8)),
    "kwargs_data": {"image": ["YQ==", None]},
    "mm_metadata": {"image": [None, None]},
}


def bound(features: dict[str, Any]) -> Envelope:
    fmt = VllmFormat()
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 6}, "features": features}
    env = fmt.bind(fmt.parse(json.dumps(body).encode()), {"content-type": "application/json"})
    return env.items[0]


def envelope(features: Any) -> Envelope:
    """An envelope as a NATS-level client may send it: no format checked its features."""
    return Envelope(
        "e" * 32,
        TokenIds(PROMPT),
        format="vllm",
        sampling=Sampling(max_tokens=6),
        engine={"features": features},
    )


def generate(env: Envelope) -> list[EngineOutput]:
    async def run() -> list[EngineOutput]:
        return [out async for out in MockEngine(MockConfig()).generate(env)]

    return asyncio.run(run())


def test_the_vllm_adapter_sends_the_features_unchanged() -> None:
    body, _ = vllm_request(bound(FEATURES), "d" * 32, "m")
    assert body["features"] == FEATURES
    assert body["token_ids"] == PROMPT


def test_the_mock_serves_features_with_the_tokens_of_the_prompt_alone() -> None:
    text_only = Envelope("t" * 32, TokenIds(PROMPT), sampling=Sampling(max_tokens=6))
    with_image = generate(bound(FEATURES))
    assert [t for o in with_image for t in o.tokens] == [
        t for o in generate(text_only) for t in o.tokens
    ]
    assert with_image[-1].finish is not None


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"mm_placeholders": images((4, 8), (8, 8))},
            "mm_placeholders must be globally non-overlapping and sorted",
        ),
        (
            {"mm_placeholders": images((4, 8))},
            "image mm_hashes and mm_placeholders must have the same length",
        ),
        (
            {"mm_placeholders": images((4, 8), (36, 8))},
            "mm_placeholders must remain within the token_ids sequence",
        ),
    ],
)  # fmt: skip
def test_the_mock_refuses_a_layout_vllm_refuses(changes: dict[str, Any], message: str) -> None:
    assert generate(envelope(FEATURES))  # the unchanged features are served
    features = {**copy.deepcopy(FEATURES), **changes}
    with pytest.raises(MeshError) as info:
        generate(envelope(features))
    assert info.value.code is ErrorCode.INVALID_ARGUMENT
    assert info.value.message == message


def test_an_sglang_engine_refuses_vllms_multimodal_items() -> None:
    """SGLang workers take every format; an image must not silently become its
    placeholder tokens."""
    with pytest.raises(MeshError) as info:
        sglang_body(bound(FEATURES), "r" * 32)
    assert info.value.code is ErrorCode.INVALID_ARGUMENT
    assert info.value.message == (
        "multimodal features (vLLM's rendered items) cannot be served by an SGLang engine"
    )
    no_items = {"mm_hashes": {}, "mm_placeholders": {}}
    assert sglang_body(bound(no_items), "r" * 32)["input_ids"] == PROMPT

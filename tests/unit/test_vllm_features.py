"""vLLM's multimodal `features` on /inference/v1/generate: accepted and checked exactly as
vLLM's token-in/token-out protocol checks them (vllm/entrypoints/scale_out/
token_in_token_out/protocol.py: `MultiModalFeatures._validate_parallel_fields`,
`GenerateRequest._require_ec_for_metadata_only`, `_validate_multimodal_feature_bounds`),
carried to the engine unchanged, and echoed with `return_token_ids` as vLLM does.

Every refused case is the valid request `VALID` with one thing changed (and
`test_the_base_request_is_valid` shows `VALID` passes), so each fails for its own reason
only: the seed's review found four cases that all failed on a missing `kwargs_data`."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from genmesh.codecs import get_codec
from genmesh.formats.base import Bound, RequestRejected
from genmesh.formats.vllm import VllmFormat
from genmesh.shared.envelope import Envelope
from genmesh.shared.multimodal import MmItem, envelope_items

pytestmark = pytest.mark.unit

JSON = {"content-type": "application/json"}
FORMAT = VllmFormat()
PROMPT = list(range(100, 140))  # 40 tokens
A, B = "a" * 64, "b" * 64  # vLLM's item hashes are hex digests


def images(*ranges: tuple[Any, Any]) -> dict[str, list[dict[str, Any]]]:
    """`mm_placeholders` of images at these `(offset, length)`."""
    return {"image": [{"offset": offset, "length": length} for offset, length in ranges]}


# Two images: tokens 8..15 and 20..31, each with its processed tensors (base64).
FEATURES: dict[str, Any] = {
    "mm_hashes": {"image": [A, B]},
    "mm_placeholders": images((8, 8), (20, 12)),
    "kwargs_data": {"image": ["YQ==", "Yg=="]},
}
VALID: dict[str, Any] = {
    "token_ids": PROMPT,
    "sampling_params": {"max_tokens": 4},
    "features": FEATURES,
}


def with_features(**changes: Any) -> dict[str, Any]:
    """`VALID` with the given `features` fields replaced (None: removed)."""
    body = copy.deepcopy(VALID)
    for key, value in changes.items():
        if value is None:
            del body["features"][key]
        else:
            body["features"][key] = value
    return body


def bind(body: dict[str, Any]) -> Bound:
    return FORMAT.bind(FORMAT.parse(json.dumps(body).encode()), JSON)


def refusal(body: dict[str, Any]) -> dict[str, Any]:
    with pytest.raises(RequestRejected) as info:
        bind(body)
    assert info.value.status == 400
    error: dict[str, Any] = info.value.body["error"]
    return error


def value_error(message: str, loc: str, summary: str) -> str:
    """vLLM's RequestValidationError message for one model validator's ValueError."""
    return (
        f"1 validation error:\n  {{'type': 'value_error', 'loc': '{loc}', 'msg': 'Value error, "
        f"{message}', 'input': '{summary}', 'ctx': {{'error': ValueError('{message}')}}}}"
    )


def test_the_base_request_is_valid() -> None:
    bound = bind(VALID)
    assert len(bound.items) == 1


def test_features_reach_the_engine_unchanged_and_their_items_are_read_in_prompt_order() -> None:
    env = bind(VALID).items[0]
    assert env.engine["features"] == FEATURES  # kwargs_data and all, as sent
    assert envelope_items(env) == [MmItem(A, 8, 8), MmItem(B, 20, 12)]


def test_fields_this_version_does_not_know_still_reach_the_engine() -> None:
    """Newest vLLM adds `is_embed` to a placeholder and `requires_kv` to the features;
    this server's vLLM version ignores them, as vLLM ignores unknown keys, and passes them
    on to the engine."""
    newer = copy.deepcopy(FEATURES)
    newer["mm_placeholders"]["image"][0]["is_embed"] = [True] * 8
    newer["requires_kv"] = False
    env = bind({**VALID, "features": newer}).items[0]
    assert env.engine["features"] == newer
    assert envelope_items(env) == [MmItem(A, 8, 8), MmItem(B, 20, 12)]


def test_features_survive_the_bus() -> None:
    env = bind(VALID).items[0]
    env.id = "p" * 32
    codec = get_codec("msgpack")
    back = Envelope.from_wire(codec.decode(codec.encode(env.to_wire())))
    assert back == env
    assert envelope_items(back) == envelope_items(env)


def test_each_sample_of_n_carries_the_features() -> None:
    body = copy.deepcopy(VALID)
    body["sampling_params"]["n"] = 2
    assert [envelope_items(env) for env in bind(body).items] == [
        [MmItem(A, 8, 8), MmItem(B, 20, 12)]
    ] * 2


@pytest.mark.parametrize(
    ("changes", "items"),
    [
        # vLLM sorts the flattened ranges before its overlap check, and its engine orders
        # the items by offset (argsort_mm_positions): placeholders out of order are fine.
        (
            {"mm_placeholders": images((20, 12), (8, 8))},
            [MmItem(B, 8, 8), MmItem(A, 20, 12)],
        ),
        # No kwargs_data: a metadata-only (cache-hit) request, the items resolved from the
        # engine's multimodal cache; the hashes still place them.
        ({"kwargs_data": None}, [MmItem(A, 8, 8), MmItem(B, 20, 12)]),
        ({"kwargs_data": {"image": [None, "Yg=="]}}, [MmItem(A, 8, 8), MmItem(B, 20, 12)]),
        # Adjacent, not overlapping.
        (
            {"mm_placeholders": images((8, 12), (20, 12))},
            [MmItem(A, 8, 12), MmItem(B, 20, 12)],
        ),
        # vLLM's protocol takes any modality name, and items of several modalities are
        # ordered together.
        (
            {
                "mm_hashes": {"audio": [A], "image": [B]},
                "mm_placeholders": {
                    "audio": [{"offset": 20, "length": 12}],
                    "image": [{"offset": 8, "length": 8}],
                },
                "kwargs_data": {"audio": ["YQ=="], "image": ["Yg=="]},
            },
            [MmItem(B, 8, 8), MmItem(A, 20, 12)],
        ),
        # Lax pydantic, as vLLM's: "8" is 8, and the engine is sent the 8.
        (
            {"mm_placeholders": images(("8", 8.0), (20, 12))},
            [MmItem(A, 8, 8), MmItem(B, 20, 12)],
        ),
        ({"mm_hashes": {}, "mm_placeholders": {}, "kwargs_data": {}}, []),
    ],
)  # fmt: skip
def test_layouts_vllm_accepts_are_accepted(changes: dict[str, Any], items: list[MmItem]) -> None:
    env = bind(with_features(**changes)).items[0]
    assert envelope_items(env) == items


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"mm_placeholders": images((8, 8), (12, 12))},
            "mm_placeholders must be globally non-overlapping and sorted",
        ),
        (
            {"mm_hashes": {"image": [A, B, A]}},
            "image mm_hashes and mm_placeholders must have the same length",
        ),
        (
            {"kwargs_data": {"image": ["YQ=="]}},
            "image kwargs_data and mm_hashes must have the same length",
        ),
        (
            {"mm_metadata": {"image": ["YQ=="]}},
            "image mm_metadata and mm_hashes must have the same length",
        ),
        (
            {"mm_hashes": {"video": [A, B]}, "kwargs_data": {"video": ["YQ==", "Yg=="]}},
            "mm_hashes and mm_placeholders must use the same modalities",
        ),
        (
            {"kwargs_data": {"video": ["YQ==", "Yg=="]}},
            "kwargs_data must use the same modalities as mm_hashes",
        ),
        (
            {"mm_metadata": {"video": [None, None]}},
            "mm_metadata must use the same modalities as mm_hashes",
        ),
    ],
)  # fmt: skip
def test_malformed_layouts_are_refused_in_vllms_words(
    changes: dict[str, Any], message: str
) -> None:
    error = refusal(with_features(**changes))
    summary = f"<dict of {len(with_features(**changes)['features'])} items>"
    assert error["message"] == value_error(message, "body.features", summary)
    assert error["param"] == "body.features"
    assert error["type"] == "Bad Request"


def test_a_placeholder_past_the_prompt_is_refused() -> None:
    body = with_features(mm_placeholders=images((8, 8), (30, 11)))
    error = refusal(body)
    message = "mm_placeholders must remain within the token_ids sequence"
    assert error["message"] == value_error(message, "body", "<dict of 3 items>")
    assert error["param"] == "body"
    # One token shorter fits exactly.
    body["features"]["mm_placeholders"]["image"][1]["length"] = 10
    bind(body)


def test_metadata_only_items_need_ec_transfer_params() -> None:
    """vLLM's `test_metadata_only_generate_requires_ec_transfer_params` and
    `test_kwargs_and_metadata_generate_does_not_require_ec` (its mm-features tests),
    without tensors: the check reads only which items have data. (With
    `ec_transfer_params` vLLM would accept; this server refuses those, §3.6.)"""
    body = with_features(
        kwargs_data={"image": [None, "Yg=="]}, mm_metadata={"image": ["bQ==", None]}
    )
    error = refusal(body)
    message = "metadata-only multimodal items require ec_transfer_params"
    assert error["message"] == value_error(message, "body", "<dict of 3 items>")
    # With a tensor for the item, its metadata is not metadata-only.
    body["features"]["kwargs_data"]["image"][0] = "YQ=="
    bind(body)


@pytest.mark.parametrize(
    ("placeholder", "msg", "loc"),
    [
        ({"offset": -1, "length": 8}, "Input should be greater than or equal to 0", "offset"),
        ({"offset": 8, "length": 0}, "Input should be greater than 0", "length"),
    ],
)
def test_placeholder_ranges_are_checked_field_by_field(
    placeholder: dict[str, int], msg: str, loc: str
) -> None:
    body = with_features(mm_placeholders={"image": [placeholder, *images((20, 12))["image"]]})
    error = refusal(body)
    assert error["param"] == f"body.features.mm_placeholders.image.0.{loc}"
    assert f"'msg': '{msg}'" in error["message"]
    assert error["message"].startswith("1 validation error:")


def test_content_parts_and_features_are_exclusive_and_content_parts_alone_is_refused() -> None:
    both = {**VALID, "content_parts": [{"type": "image_url", "url": "http://x/y.png"}]}
    message = "content_parts and features are mutually exclusive"
    assert refusal(both)["message"] == value_error(message, "body", "<dict of 4 items>")
    alone = {k: v for k, v in both.items() if k != "features"}
    error = refusal(alone)
    assert error["message"] == (
        "multimodal inputs as content_parts are not supported by this server; "
        "send them rendered, as features"
    )
    assert error["param"] == "content_parts"


def test_return_token_ids_echoes_the_placeholders_as_vllm_does() -> None:
    from genmesh.formats.vllm.request import VllmOptions

    options = bind({**VALID, "return_token_ids": True}).options
    assert isinstance(options, VllmOptions)
    assert options.mm_placeholders == FEATURES["mm_placeholders"]
    assert bind(VALID).options.mm_placeholders == FEATURES["mm_placeholders"]
    text_only = {k: v for k, v in VALID.items() if k != "features"}
    assert bind(text_only).options.mm_placeholders is None

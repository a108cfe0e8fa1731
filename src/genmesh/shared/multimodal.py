"""vLLM's multimodal `features`, as the mesh reads them: where each item sits in a prompt.

A token-in/token-out vLLM request carries an image (or a video, an audio clip) as
placeholder tokens in `token_ids` plus `features` from vLLM's `/render`: per modality, the
items' hashes (`mm_hashes`), their placeholder ranges (`mm_placeholders`, `{offset,
length}`), and optionally their processed tensors (`kwargs_data`, base64) and metadata
(`mm_metadata`). The mesh never looks inside the tensors; it needs the layout: which item
covers which prompt tokens, in prompt order, because vLLM keys each KV block over an item's
placeholders by the item's hash (`shared/kv_events.request_extra_keys`).

The rules are vLLM's own (newest token-in/token-out protocol,
vllm/entrypoints/scale_out/token_in_token_out/protocol.py: `MultiModalFeatures.
_validate_parallel_fields` and `GenerateRequest._validate_multimodal_feature_bounds`), with
its messages: the vLLM format refuses a body that breaks them as vLLM does, the mock engine
refuses such an envelope, and routing falls back to the text-only keys for it. Items are
put in prompt order as vLLM's engine puts them (`argsort_mm_positions`,
vllm/multimodal/utils.py, used by vllm/v1/engine/input_processor.py), so placeholders sent
out of order mean what the sorted ones mean. The modality's name is not checked: vLLM's
protocol takes any, and its block hashing keys every modality's items alike.

On the mesh, `features` travel as vLLM sent them in a `vllm` envelope's `engine` map
(docs/protocol.md, "Request envelope"), so a vLLM engine receives them unchanged.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, TypeGuard

from genmesh.shared.envelope import Envelope

# The envelope format whose `engine` map may hold `features` (vLLM's request body).
FEATURES_FORMAT = "vllm"


class FeaturesError(ValueError):
    """Features whose layout vLLM refuses, or that are not features at all; the message
    is vLLM's for what vLLM checks."""


class MmItem(NamedTuple):
    """One multimodal item: its hash (vLLM's `identifier`) and its placeholder tokens."""

    identifier: str
    offset: int
    length: int


def check_layout(
    hashes: Mapping[str, Sequence[str]],
    placeholders: Mapping[str, Sequence[tuple[int, int]]],
    kwargs_data: Mapping[str, Sequence[Any]] | None = None,
    mm_metadata: Mapping[str, Sequence[Any]] | None = None,
) -> list[MmItem]:
    """vLLM's `_validate_parallel_fields` (placeholders as `(offset, length)`), then the
    items in prompt order. vLLM walks the modalities as a set; this walks them in the
    order sent, which names the same modality whenever only one is wrong."""
    modalities = set(hashes)
    if set(placeholders) != modalities:
        raise FeaturesError("mm_hashes and mm_placeholders must use the same modalities")
    if kwargs_data is not None and set(kwargs_data) != modalities:
        raise FeaturesError("kwargs_data must use the same modalities as mm_hashes")
    if mm_metadata is not None and set(mm_metadata) != modalities:
        raise FeaturesError("mm_metadata must use the same modalities as mm_hashes")
    items: list[MmItem] = []
    for modality, item_hashes in hashes.items():
        ranges = placeholders[modality]
        if len(item_hashes) != len(ranges):
            raise FeaturesError(
                f"{modality} mm_hashes and mm_placeholders must have the same length"
            )
        if kwargs_data is not None and len(kwargs_data[modality]) != len(item_hashes):
            raise FeaturesError(f"{modality} kwargs_data and mm_hashes must have the same length")
        if mm_metadata is not None and len(mm_metadata[modality]) != len(item_hashes):
            raise FeaturesError(f"{modality} mm_metadata and mm_hashes must have the same length")
        items.extend(
            MmItem(h, offset, length)
            for h, (offset, length) in zip(item_hashes, ranges, strict=True)
        )
    # Stable, by offset: vLLM's argsort_mm_positions.
    items.sort(key=lambda item: item.offset)
    for before, after in itertools.pairwise(items):
        if after.offset < before.offset + before.length:
            raise FeaturesError("mm_placeholders must be globally non-overlapping and sorted")
    return items


def check_bounds(items: Sequence[MmItem], prompt_len: int) -> None:
    """vLLM's `_validate_multimodal_feature_bounds`."""
    if any(item.offset + item.length > prompt_len for item in items):
        raise FeaturesError("mm_placeholders must remain within the token_ids sequence")


def _string_lists(value: Any, where: str, *, nullable: bool) -> dict[str, list[Any]]:
    """A map of modality -> list of strings (or nulls, when `nullable`)."""
    if not isinstance(value, dict) or not all(
        isinstance(items, list)
        and all(isinstance(v, str) or (nullable and v is None) for v in items)
        for items in value.values()
    ):
        kind = "strings or nulls" if nullable else "strings"
        raise FeaturesError(f"features.{where}: expected a map of lists of {kind}")
    return value


def _ranges(value: Any) -> dict[str, list[tuple[int, int]]]:
    """`mm_placeholders` as `(offset, length)` per item, each checked as vLLM's
    `PlaceholderRangeInfo` (offset >= 0, length > 0)."""
    if not isinstance(value, dict):
        raise FeaturesError("features.mm_placeholders: expected a map of lists of ranges")
    ranges: dict[str, list[tuple[int, int]]] = {}
    for modality, items in value.items():
        if not isinstance(items, list):
            raise FeaturesError(f"features.mm_placeholders.{modality}: expected a list")
        ranges[modality] = []
        for i, item in enumerate(items):
            offset = item.get("offset") if isinstance(item, dict) else None
            length = item.get("length") if isinstance(item, dict) else None
            if not (_is_int(offset) and _is_int(length) and offset >= 0 and length > 0):
                raise FeaturesError(
                    f"features.mm_placeholders.{modality}[{i}]: expected "
                    "{offset: integer >= 0, length: integer > 0}"
                )
            ranges[modality].append((offset, length))
    return ranges


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def features_items(features: Any, prompt_len: int) -> list[MmItem]:
    """The items of `features` as a request carries them (JSON or msgpack maps), in
    prompt order; raises `FeaturesError` for anything vLLM would refuse."""
    if not isinstance(features, dict):
        raise FeaturesError("features: expected a map")
    kwargs_data, mm_metadata = features.get("kwargs_data"), features.get("mm_metadata")
    items = check_layout(
        _string_lists(features.get("mm_hashes"), "mm_hashes", nullable=False),
        _ranges(features.get("mm_placeholders")),
        None if kwargs_data is None else _string_lists(kwargs_data, "kwargs_data", nullable=True),
        None if mm_metadata is None else _string_lists(mm_metadata, "mm_metadata", nullable=True),
    )
    check_bounds(items, prompt_len)
    return items


def envelope_items(envelope: Envelope) -> list[MmItem]:
    """The multimodal items of an envelope's prompt (none unless it is a vLLM request
    with `features`); raises `FeaturesError` for features vLLM would refuse."""
    if envelope.format != FEATURES_FORMAT:
        return []
    features = envelope.engine.get("features")
    if features is None:
        return []
    return features_items(features, len(envelope.token_ids))

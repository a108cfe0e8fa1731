"""RunningIds: the per-format set of client IDs in flight (services/frontend/running.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from multidict import CIMultiDict

from genmesh.formats.sglang import SglangFormat
from genmesh.formats.vllm import VllmFormat
from genmesh.services.frontend.running import RunningIds

pytestmark = pytest.mark.unit


def test_held_ids_are_duplicates_until_the_block_ends() -> None:
    running = RunningIds()
    with running.hold(["a", "b"]):
        assert running.duplicate(["x", "b"]) == "b"
        assert running.duplicate(["x"]) is None
    assert running.duplicate(["a", "b"]) is None
    assert len(running) == 0


def test_ids_are_released_when_the_block_raises() -> None:
    running = RunningIds()
    with pytest.raises(RuntimeError), running.hold(["a"]):
        raise RuntimeError("the request failed")
    assert "a" not in running


def test_a_hold_releases_only_what_it_took() -> None:
    """A second holder of an ID already held must not free it for the first."""
    running = RunningIds()
    with running.hold(["a"]):
        with running.hold(["a", "b"]):
            pass
        assert "a" in running
        assert "b" not in running


def test_sglang_refuses_a_running_rid_with_its_message() -> None:
    rejected = SglangFormat().duplicate_id("r1")
    assert rejected.status == 400
    assert rejected.body == {"error": {"message": "Duplicate request ID detected: r1"}}


@pytest.mark.parametrize(
    ("body", "headers", "running"),
    [
        ({"input_ids": [1, 2], "rid": "a"}, {}, ["a"]),
        ({"input_ids": [[1, 2], [3]], "rid": "a"}, {}, ["a_0", "a_1"]),
        ({"input_ids": [[1, 2], [3]], "rid": ["x", "y"]}, {}, ["x", "y"]),
        # SGLang regenerates every rid with n > 1: nothing to collide.
        ({"input_ids": [1, 2], "rid": "a", "sampling_params": {"n": 2}}, {}, []),
        # An X-Request-Id stands in for rid in genmesh only: SGLang never refuses it.
        ({"input_ids": [1, 2]}, {"x-request-id": "h"}, []),
        ({"input_ids": [1, 2]}, {}, []),
    ],
)
def test_sglang_running_ids_are_the_rids_sglang_keeps(
    body: dict[str, Any], headers: dict[str, str], running: list[str]
) -> None:
    fmt = SglangFormat()
    bound = fmt.bind(fmt.parse(json.dumps(body).encode()), CIMultiDict(headers))
    assert bound.running_ids == running


def test_vllm_holds_no_running_ids() -> None:
    """Newest vLLM appends 8 random characters to every external request ID
    (`InputProcessor.assign_request_id`), so two running requests may share one."""
    fmt = VllmFormat()
    body = {"token_ids": [1, 2], "request_id": "a", "sampling_params": {"max_tokens": 2}}
    headers = CIMultiDict({"Content-Type": "application/json", "X-Request-Id": "a"})
    bound = fmt.bind(fmt.parse(json.dumps(body).encode()), headers)
    assert bound.client_id == "a"
    assert bound.running_ids == []

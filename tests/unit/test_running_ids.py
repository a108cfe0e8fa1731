"""RunningIds: the per-format set of client IDs in flight (services/frontend/running.py)."""

from __future__ import annotations

import pytest

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
    fmt = SglangFormat()
    assert fmt.unique_running_ids
    rejected = fmt.duplicate_id("r1")
    assert rejected.status == 400
    assert rejected.body == {"error": {"message": "Duplicate request ID detected: r1"}}


def test_vllm_takes_duplicate_running_ids() -> None:
    """Newest vLLM appends 8 random characters to every external request ID
    (`InputProcessor.assign_request_id`), so two running requests may share one."""
    assert not VllmFormat().unique_running_ids

"""The garbage collector as a started service sets it up (`lifecycle.tune_gc`)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from genmesh.shared.lifecycle import GC_YOUNG_THRESHOLD, tune_gc

pytestmark = pytest.mark.unit


@pytest.fixture
def restored_gc() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


@pytest.mark.usefixtures("restored_gc")
def test_startup_heap_is_frozen_and_the_young_generation_widened() -> None:
    _, older, oldest = gc.get_threshold()
    built_at_startup = [{"n": i} for i in range(100)]
    tune_gc()
    # What existed at start-up is out of every later collection's walk...
    assert gc.get_freeze_count() >= len(built_at_startup)
    # ...and only the young generation's threshold changed.
    assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, older, oldest)
    # Garbage cycles are still collected.
    cycle: list[object] = []
    cycle.append(cycle)
    del cycle
    assert gc.collect() >= 1

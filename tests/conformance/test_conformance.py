"""The conformance matrix: every scenario against every engine adapter.

python3 dev.py test tests/conformance -q -rA     # the matrix, one line per cell
"""

from __future__ import annotations

import pytest

from tests.conformance.harness import ENGINES, harness
from tests.conformance.scenarios import SCENARIOS, Scenario

pytestmark = pytest.mark.inproc


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    "scenario", [s for _, _, s in SCENARIOS], ids=[f"{f}/{n}" for f, n, _ in SCENARIOS]
)
async def test_conformance(engine: str, scenario: Scenario) -> None:
    async with harness(engine) as h:
        await scenario(h)

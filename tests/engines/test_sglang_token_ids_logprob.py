"""`token_ids_logprob` through the `sglang` engine adapter against the testkit's mock SGLang
server (cumulative and incremental streaming, real sockets): what comes back is what the
in-process mock engine computes for the same envelope."""

from __future__ import annotations

import pytest

from genmesh.engines.base import EngineOutput
from genmesh.engines.mock import MockConfig, MockEngine
from genmesh.shared.envelope import Envelope, OutputOptions, Sampling
from tests.conformance.harness import EOS, VOCAB, harness

pytestmark = pytest.mark.inproc

PROMPT = [11, 12, 13, 14, 15]
IDS = [5, 900, 5, 0]


def _envelope(start: int | None) -> Envelope:
    return Envelope(
        id="placeholder",
        token_ids=list(PROMPT),
        format="tokens",
        sampling=Sampling(max_tokens=4, ignore_eos=True),
        output=OutputOptions(
            logprobs=True, top_logprobs=0, prompt_logprobs_start=start, logprob_token_ids=IDS
        ),
    )


def _rows(outs: list[EngineOutput]) -> list[list[tuple[int, float]]]:
    return [list(map(tuple, row)) for o in outs for row in o.token_ids_logprobs or []]


def _prompt_rows(outs: list[EngineOutput]) -> list[list[tuple[int, float]] | None]:
    rows = next(o.prompt_token_ids_logprobs for o in outs if o.prompt_token_ids_logprobs)
    return [None if row is None else list(map(tuple, row)) for row in rows]


@pytest.mark.parametrize("name", ["sglang", "sglang-incremental"])
@pytest.mark.parametrize("start", [0, 3])
async def test_the_adapter_returns_what_the_engine_computes(name: str, start: int) -> None:
    env = _envelope(start)
    mock = MockEngine(MockConfig(vocab_size=VOCAB, eos_token_id=EOS))
    expected = [o async for o in mock.generate(_envelope(start))]
    async with harness(name) as h:
        outs = [o async for o in h.engine.generate(env)]
    assert [t for o in outs for t in o.tokens] == [t for o in expected for t in o.tokens]
    assert _rows(outs) == _rows(expected)
    assert len(_rows(outs)) == 4
    assert _prompt_rows(outs) == _prompt_rows(expected)
    assert len(_prompt_rows(outs)) == len(PROMPT) - start
    assert _prompt_rows(outs)[0] is None  # SGLang's shift: the first position has none

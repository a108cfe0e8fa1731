"""The join of a disaggregated request's halves (engines/pd_join.py)."""

from __future__ import annotations

import pytest

from genmesh.engines.base import EngineOutput, usage
from genmesh.engines.pd_join import PdJoin, PrefillResult
from genmesh.shared import frames
from genmesh.shared.envelope import Envelope, OutputOptions

pytestmark = pytest.mark.unit

ROW = [1, 2]


def envelope(prompt_len: int = 4, experts_from: int | None = 1) -> Envelope:
    return Envelope(
        id="r",
        token_ids=list(range(1, prompt_len + 1)),
        output=OutputOptions(prompt_logprobs_start=0, routed_experts_start=experts_from),
    )


def stage_end(rows: int, cached: int = 2, **extra: object) -> frames.EndFrame:
    frame: frames.EndFrame = {
        "t": frames.END,
        "id": "r~p",
        "seq": 1,
        "tokens": [],
        "finish": {"reason": "length"},
        "usage": usage(4, 0, cached),
        "prompt_logprobs": [None, -1.0, -2.0, -3.0],
        "routed_experts": [ROW] * rows,
        "cached_tokens": cached,
    }
    frame.update(extra)  # type: ignore[typeddict-item]
    return frame


def prefill(rows: int = 3, **extra: object) -> PrefillResult:
    result = PrefillResult()
    result.add(stage_end(rows, **extra))
    return result


def decode_outputs(tokens: int, rows: int | None = None) -> list[EngineOutput]:
    """`tokens` outputs of one token each; rows one per token but the last (or `rows`)."""
    outs = []
    for i in range(tokens):
        out = EngineOutput(tokens=[10 + i], logprobs=[-0.1], cached_tokens=0 if i == 0 else None)
        out.routed_experts = [ROW] if i else []
        outs.append(out)
    last = outs[-1]
    if rows is not None:  # the last output's rows make up the total asked for
        last.routed_experts = [ROW] * (rows - (tokens - 2 if tokens > 1 else 0))
    last.finish = {"reason": "length"}
    last.usage = usage(4, tokens, 0)
    return outs


def test_prefill_gives_the_prompt_fields_and_cached_tokens() -> None:
    join = PdJoin(envelope(), prefill())
    outs = [join.join(o) for o in decode_outputs(3)]
    assert outs[0].prompt_logprobs == [None, -1.0, -2.0, -3.0]
    assert outs[0].cached_tokens == 2
    assert outs[1].prompt_logprobs is None
    assert outs[-1].usage == usage(4, 3, 2)
    assert [o.tokens for o in outs] == [[10], [11], [12]]


def test_rows_are_prefills_then_decodes_on_the_last_output() -> None:
    join = PdJoin(envelope(), prefill(rows=3))
    outs = [join.join(o) for o in decode_outputs(3)]
    assert [o.routed_experts for o in outs[:-1]] == [None, None]
    assert outs[-1].routed_experts == [ROW] * (3 + 2)
    assert not join.experts_omitted


def test_prefills_rows_survive_when_it_made_the_only_token() -> None:
    join = PdJoin(envelope(), prefill(rows=3))
    (out,) = [join.join(o) for o in decode_outputs(1)]
    assert out.routed_experts == [ROW] * 3
    assert not join.experts_omitted


@pytest.mark.parametrize(("prefill_rows", "decode_rows"), [(2, 2), (3, 1), (0, 2), (3, 3)])
def test_an_incomplete_half_leaves_out_all_rows(prefill_rows: int, decode_rows: int) -> None:
    join = PdJoin(envelope(), prefill(rows=prefill_rows))
    outs = [join.join(o) for o in decode_outputs(3, rows=decode_rows)]
    assert all(o.routed_experts is None for o in outs)
    assert join.experts_omitted


def test_without_experts_asked_rows_are_left_alone() -> None:
    join = PdJoin(envelope(experts_from=None), prefill(rows=0))
    outs = [join.join(o) for o in decode_outputs(2)]
    assert outs[1].routed_experts == [ROW]  # decode's, untouched
    assert not join.experts_omitted


def test_a_budget_of_zero_answers_with_the_prefill() -> None:
    result = prefill(rows=3, handoff={"handle": "h"})
    out = result.as_output()
    assert out.tokens == []
    assert out.finish == {"reason": "length"}
    assert out.usage == usage(4, 0, 2)
    assert out.routed_experts == [ROW] * 3
    assert out.prompt_logprobs == [None, -1.0, -2.0, -3.0]
    assert result.handoff == {"handle": "h"}

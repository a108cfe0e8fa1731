"""Joining the two halves of a disaggregated request into the answer one engine gives.

A prefill stage reports what only prefill computed: the prompt's logprobs, the routed
experts of the prompt's positions and how much of the prompt its cache held. The decode
half reports the generation. `PdJoin` puts the prefill's part back into the decode's
outputs, so that the frames of a disaggregated request equal those of the same request run
on one engine (docs/disaggregation.md, "Joining the halves"):

- prompt logprob fields and `cached_tokens` come from prefill, on the first output;
- routed experts are prefill's rows (one per prompt position from
  `output.routed_experts_start`) followed by decode's (one per output token but the last),
  given with the last output once both counts are known to be right. A blob an engine left
  incomplete is omitted whole, never passed on half (the rule of the seed PR, Dynamo
  #16997: "invalid or incomplete P/D expert blobs are omitted"), and counted;
- everything else is decode's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from genmesh.engines.base import EngineOutput
from genmesh.shared import frames
from genmesh.shared.envelope import Envelope

# The fields of a frame that only prefill computes (besides the expert rows).
_PROMPT_FIELDS = (
    "prompt_logprobs",
    "prompt_ranks",
    "prompt_top_logprobs",
    "prompt_token_ids_logprobs",
)


@dataclass(slots=True)
class PrefillResult:
    """A prefill stage's frames, read: what the decode half and the join need."""

    prompt: dict[str, Any] = field(default_factory=dict)  # _PROMPT_FIELDS it reported
    rows: list[list[int]] = field(default_factory=list)
    cached_tokens: int | None = None
    finish: frames.Finish | None = None
    usage: frames.Usage | None = None
    handoff: dict[str, Any] | None = None

    def add(self, frame: frames.OutputFrame) -> None:
        """Read one `out` or `end` frame of the stage."""
        for name in _PROMPT_FIELDS:
            if name in frame:
                self.prompt[name] = frame[name]  # type: ignore[literal-required]
        rows = frame.get("routed_experts")
        if rows:
            self.rows.extend(rows)
        if "cached_tokens" in frame:
            self.cached_tokens = frame["cached_tokens"]
        if frame["t"] == frames.END:
            self.finish = frame["finish"]
            self.usage = frame["usage"]
            self.handoff = frame.get("handoff")

    def as_output(self) -> EngineOutput:
        """The whole answer of a request with nothing to decode (a token budget of 0)."""
        out = EngineOutput(tokens=[], cached_tokens=self.cached_tokens)
        for name, value in self.prompt.items():
            setattr(out, name, value)
        if self.rows:
            out.routed_experts = self.rows
        out.finish = self.finish or {"reason": "length"}
        out.usage = self.usage
        return out


class PdJoin:
    """Joins `prefill` into the decode half's outputs of `envelope`, one by one."""

    def __init__(self, envelope: Envelope, prefill: PrefillResult) -> None:
        self.prefill = prefill
        start = envelope.output.routed_experts_start
        # Rows prefill must have reported: one per prompt position from `start` on.
        self._prompt_rows = None if start is None else len(envelope.token_ids) - start
        self._decode_rows: list[list[int]] = []
        self._first = True
        self._tokens = 0
        # Set when the request's expert rows were found incomplete and left out.
        self.experts_omitted = False

    def join(self, out: EngineOutput) -> EngineOutput:
        prefill = self.prefill
        if self._first:
            self._first = False
            for name in _PROMPT_FIELDS:
                setattr(out, name, prefill.prompt.get(name))
            if prefill.cached_tokens is not None:
                out.cached_tokens = prefill.cached_tokens
        self._tokens += len(out.tokens)
        if self._prompt_rows is not None:
            if out.routed_experts:
                self._decode_rows.extend(out.routed_experts)
            out.routed_experts = None
            if out.finish is not None:
                out.routed_experts = self._rows()
        if out.finish is not None and out.usage is not None and prefill.cached_tokens is not None:
            out.usage = {**out.usage, "cached_tokens": prefill.cached_tokens}
        return out

    def _rows(self) -> list[list[int]] | None:
        """Prefill's rows and decode's, if both halves reported all of theirs."""
        decode_expected = max(self._tokens - 1, 0)
        if len(self.prefill.rows) != self._prompt_rows or len(self._decode_rows) != decode_expected:
            self.experts_omitted = True
            return None
        return self.prefill.rows + self._decode_rows

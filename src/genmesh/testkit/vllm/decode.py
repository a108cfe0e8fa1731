"""Decoding in the mock vLLM engine: the deterministic token model, one step per token.

Generation is genmesh's deterministic token model (`genmesh.engines.mock`): greedy over a
rolling hash of (seed or 0, every token so far), with vLLM's min-tokens processor masking
EOS and stop ids, so the mock returns exactly the tokens and logprobs the mock worker
engine does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from genmesh.engines.mock import MAX_TOP_LOGPROBS, TokenModel, advance, initial_state


@dataclass(slots=True)
class Step:
    token: int
    logprob: float
    rank: int
    # The k best candidates at this position, best first (k = requested logprobs).
    top: list[tuple[int, float]]
    finish_reason: str | None = None
    stop_reason: int | None = None


@dataclass(slots=True)
class Sample:
    """One sequence: the deterministic model continued greedily from the prompt."""

    model: TokenModel
    state: int
    budget: int
    min_tokens: int
    stops: frozenset[int]
    eos: int
    ignore_eos: bool
    top_k: int
    index: int = 0
    tokens: list[int] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | None = None

    def step(self) -> Step:
        n = len(self.tokens)
        model = self.model
        masked = n < self.min_tokens
        candidates = model.top(self.state, MAX_TOP_LOGPROBS if masked else 1)
        token, logprob = candidates[0]
        banned = self.stops if self.ignore_eos else self.stops | {self.eos}
        if masked and token in banned:
            # vLLM's min-tokens processor masks EOS and stop ids: the best allowed one wins.
            token, logprob = next(
                ((t, lp) for t, lp in candidates if t not in banned), candidates[0]
            )
        rank = model.score(self.state, token)[1]
        top = model.top(self.state, self.top_k) if self.top_k > 0 else []
        self.state = advance(self.state, token)
        self.tokens.append(token)
        out = Step(token, logprob, rank, top)
        if not masked and token == self.eos and not self.ignore_eos:
            out.finish_reason = "stop"
        elif not masked and token in self.stops:
            out.finish_reason, out.stop_reason = "stop", token
        elif n + 1 >= self.budget:
            out.finish_reason = "length"
        self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        self.steps.append(out)
        return out


def prompt_state(model: TokenModel, seed: int | None, prompt: list[int]) -> int:
    state = initial_state(seed or 0)
    for tid in prompt:
        state = advance(state, tid)
    return state

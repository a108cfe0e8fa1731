"""Continuing a request on another worker after its worker failed mid-stream.

The law: with a deterministic engine, a migrated request returns exactly what an
uninterrupted one returns. The continuation is the original request with the delivered
tokens appended to the prompt, budgets shrunk by as many, prompt logprobs not asked
again (the first attempt delivered them), and the failed workers excluded. Engines read
budgets and output options from these canonical fields, so no native payload changes.
"""

from __future__ import annotations

from dataclasses import replace

from genmesh.shared.envelope import Continuation, Envelope


def attempt_id(base_id: str, attempt: int) -> str:
    """Each attempt has its own ID: a cancel of a failed attempt (tombstoned on every
    worker) must not also cancel the attempt that replaces it."""
    return base_id if attempt == 1 else f"{base_id}~{attempt}"


def continuation(
    original: Envelope, delivered: list[int], attempt: int, excluded: list[str]
) -> Envelope:
    """The envelope of attempt `attempt` after `delivered` tokens reached the client."""
    env = replace(
        original,
        id=attempt_id(original.id, attempt),
        sampling=original.sampling.copy(),
        output=replace(original.output),
        routing=original.routing.copy(),
    )
    env.routing.exclude = sorted(set(env.routing.exclude) | set(excluded))
    if not delivered:
        # Nothing reached the client: a fresh start elsewhere, the same request.
        env.continuation = Continuation(
            attempt, 0, len(original.token_ids), original.sampling.max_tokens
        )
        return env
    env.token_ids = [*original.token_ids, *delivered]
    s = env.sampling
    if s.max_tokens is not None:
        s.max_tokens = max(s.max_tokens - len(delivered), 0)
    s.min_tokens = max(s.min_tokens - len(delivered), 0)
    # Routed experts keep their original start: an engine may report rows only with its
    # last chunk, so the failed attempt may have delivered none; the client drops the
    # rows it already has (see genmesh.client).
    env.output.prompt_logprobs_start = None
    env.continuation = Continuation(
        attempt=attempt,
        delivered=len(delivered),
        prompt_len=len(original.token_ids),
        max_tokens=original.sampling.max_tokens,
    )
    return env

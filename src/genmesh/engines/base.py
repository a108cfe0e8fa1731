"""The engine adapter contract: what a worker needs from the thing that generates tokens."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from genmesh.shared.envelope import Envelope
from genmesh.shared.frames import Finish, TopLogprobs, Usage
from genmesh.shared.kv_events import KvEventBatch

if TYPE_CHECKING:
    from nats.aio.client import Client

    from genmesh.shared.micro import MicroService
    from genmesh.shared.subjects import Subjects


@dataclass(slots=True)
class EngineOutput:
    """One step of a generation. The last output of a request carries `finish`."""

    tokens: list[int]
    logprobs: list[float] | None = None
    # 1-based rank of each token among the engine's candidates (with `logprobs`).
    ranks: list[int] | None = None
    top_logprobs: list[TopLogprobs] | None = None
    # Prompt logprobs, once, from `output.prompt_logprobs_start` on; the first entry is None.
    prompt_logprobs: list[float | None] | None = None
    prompt_ranks: list[int | None] | None = None
    prompt_top_logprobs: list[TopLogprobs | None] | None = None
    # With `output.logprob_token_ids`: per generated token, and per prompt position from
    # `output.prompt_logprobs_start` (first entry None), the logprob of each of those token
    # IDs at that position, as (token_id, logprob) in the order asked.
    token_ids_logprobs: list[TopLogprobs] | None = None
    prompt_token_ids_logprobs: list[TopLogprobs | None] | None = None
    # MoE routing rows (layers x top-k expert ids, flattened) of the positions this step
    # ran through the model: the prompt's from `output.routed_experts_start` on in the
    # first output, then one row per token for the token before it.
    routed_experts: list[list[int]] | None = None
    cached_tokens: int | None = None
    # Why the generation stopped; set on its last output only.
    finish: Finish | None = None
    # {"prompt_tokens", "completion_tokens", "cached_tokens"}, with `finish`.
    usage: Usage | None = None
    # Engine-native extras passed through to formats untouched.
    engine: dict[str, Any] | None = None
    # A prefill's result for its decode half, on its last output (`Disaggregating.prefill`).
    handoff: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class KvUsage:
    """An engine's KV cache, in blocks: how many it has, and how many its running
    requests hold (cached blocks that nothing running holds are free: they are evicted
    when needed, as vLLM's and SGLang's pools count them)."""

    used_blocks: int
    total_blocks: int


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
    """The `usage` of a last output."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "cached_tokens": cached_tokens,
    }


class Engine(Protocol):
    """An engine adapter. `generate` is cancelled (CancelledError at an await) to abort.

    Errors are raised as `MeshError`: `invalid_argument` for requests the engine refuses,
    `unavailable` for engine failures that another worker could survive.
    """

    name: str

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def describe(self) -> dict[str, Any]:
        """Facts for the worker card: at least `model`; `formats` it can serve."""
        ...

    async def healthy(self) -> bool:
        """Whether the engine can serve now; the worker leaves discovery while it cannot."""
        ...

    def generate(self, envelope: Envelope) -> AsyncGenerator[EngineOutput, None]: ...

    async def abort(self, request_id: str) -> bool:
        """Stop the generation of envelope `request_id` as the engine stops an aborted
        request: its stream then ends with an output whose finish reason is `abort`.
        False when the engine does not run it (any more) or cannot do that; the worker
        then cancels the generation and reports the abort itself."""
        ...

    async def flush_cache(self) -> None:
        """Empty the engine's prefix cache. Raises `MeshError` when the engine refuses
        (SGLang does while it has requests) or fails."""
        ...

    def kv_usage(self) -> KvUsage | None:
        """The KV cache's use now (read whenever the worker announces its load, so it
        must be cheap); None when the engine cannot say."""
        ...

    def kv_events(self) -> AsyncIterator[KvEventBatch] | None:
        """The engine's KV cache events, batch by batch in the engine's order, from start
        to close (the worker relays them onto NATS); None when it publishes none."""
        ...


class Disaggregating(Protocol):
    """An engine that can run one half of a disaggregated request (docs/disaggregation.md).

    The decode worker drives a request: it asks its engine for the `ticket` both halves
    share, sends the prefill stage (the envelope with `disagg`) to the paired prefill
    worker, whose engine runs `prefill`; it runs `decode` on its own engine, concurrently
    (`pd_concurrent`: SGLang, whose two servers pair by the ticket) or once the prefill's
    last output has handed over its `handoff` (vLLM's kv_transfer_params, the mock's KV
    handle). The decode worker joins the halves' outputs (prompt logprobs and the prompt's
    routed experts from prefill) into what `generate` would have produced.
    """

    # Which engines can pair: a prefill and a decode worker must announce the same.
    pd_kind: str
    pd_concurrent: bool

    async def pd_attach(
        self, nc: Client, subjects: Subjects, worker_id: str, micro: MicroService | None = None
    ) -> None:
        """Called once by a prefill or decode worker as it starts, before any request:
        an engine whose KV moves over the mesh (the mock) subscribes here, and lists what
        it serves in the worker's `micro` (`$SRV`); the engine's subscriptions end with
        its `close`."""
        ...

    def pd_card(self) -> dict[str, Any]:
        """What a decode worker must know of this (prefill) engine to pair with it, for the
        worker card's `disagg` (SGLang: its bootstrap host and port)."""
        ...

    def pd_ticket(self, envelope: Envelope, prefill: dict[str, Any]) -> dict[str, Any]:
        """The ticket for a request paired with the prefill worker whose card's `disagg` is
        `prefill` (SGLang: bootstrap host, port and a fresh room; others: empty)."""
        ...

    def prefill(
        self, envelope: Envelope, ticket: dict[str, Any]
    ) -> AsyncGenerator[EngineOutput, None]:
        """The prefill half: its prompt logprobs and the prompt's routed experts, the first
        token if the engine samples it, a finish, and `handoff` on the last output. An
        engine's failure (an abort, a failed transfer) raises `MeshError`."""
        ...

    def decode(
        self, envelope: Envelope, ticket: dict[str, Any], handoff: dict[str, Any] | None
    ) -> AsyncGenerator[EngineOutput, None]:
        """The decode half: the generation's outputs, as `generate` would give them but for
        what prefill computed (prompt logprobs, the prompt's routed experts). `handoff` is
        None when `pd_concurrent`. A transfer that fails raises `MeshError`."""
        ...


def disaggregating(engine: Engine) -> Disaggregating | None:
    """`engine` as a P/D engine, or None if it cannot take part in P/D."""
    return engine if hasattr(engine, "pd_kind") else None  # type: ignore[return-value]

"""The decode worker's side of a disaggregated request: it has the prefill stage run by the
prefill worker the router paired it with, runs the decode half on its own engine, and joins
the two (docs/disaggregation.md, "How a request runs").

The stage goes out through a `MeshClient` pinned to the prefill worker: acknowledgements,
pings of a silent worker, the deadline, cancels and trace context all work as for any
request. A stage that fails ends the request with an error that names the prefill worker
(`detail.prefill_worker`), retryable when the prefill worker, not the request, was at
fault: the requester then moves the request to another pair.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace
from typing import Any

from nats.aio.client import Client

from genmesh.client.mesh_client import MeshClient
from genmesh.engines.base import Disaggregating, EngineOutput
from genmesh.engines.pd_join import PdJoin, PrefillResult
from genmesh.shared import frames
from genmesh.shared.discovery import WorkerDirectory
from genmesh.shared.envelope import Disagg, Envelope, prefill_stage_id
from genmesh.shared.errors import ErrorCode, MeshError
from genmesh.shared.metrics import HistogramChild
from genmesh.shared.subjects import Subjects

TRANSFER_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class PdDecoder:
    """Runs requests disaggregated on a decode worker whose engine is `engine`."""

    def __init__(self, nc: Client, subjects: Subjects, engine: Disaggregating) -> None:
        self.engine = engine
        self.subjects = subjects
        # The prefill workers' cards (what `pd_ticket` needs), and departures that fail
        # a stage at once rather than at its next ping.
        self.directory = WorkerDirectory(nc, subjects)
        self.client = MeshClient(nc, subjects.namespace, directory=self.directory)
        # For metrics (services/worker/metrics.py): from the stage's result to decode's
        # first output (the KV transfer, for engines that pull it after the prefill).
        self.transfer_seconds = HistogramChild(TRANSFER_BUCKETS_S)
        self.experts_omitted = 0

    async def start(self) -> None:
        await self.directory.start()
        await self.client.start()

    async def close(self) -> None:
        await self.client.close()
        await self.directory.close()

    async def generate(
        self, envelope: Envelope, prefill_worker: str
    ) -> AsyncGenerator[EngineOutput, None]:
        """`envelope`'s outputs, its prefill done by `prefill_worker`."""
        info = self.directory.workers.get(prefill_worker)
        if info is None or info.disagg is None:
            raise _prefill_failed(prefill_worker, f"prefill worker {prefill_worker} is not known")
        engine = self.engine
        ticket = engine.pd_ticket(envelope, info.disagg)
        stage = replace(
            envelope,
            id=prefill_stage_id(envelope.id),
            disagg=Disagg(parent=envelope.id, ticket=ticket),
        )
        # A task of its own: for an engine whose halves run at once, the stage runs while
        # decode waits for its KV. Cancelling it cancels the stage on the prefill worker.
        prefill = asyncio.ensure_future(self._prefill(stage, info.subject, prefill_worker))
        try:
            if envelope.sampling.max_tokens == 0:  # nothing to decode
                result, _ = await prefill
                yield result.as_output()
                return
            if engine.pd_concurrent:
                decode = engine.decode(envelope, ticket, None)
            else:
                result, _ = await prefill
                decode = engine.decode(envelope, ticket, result.handoff)
            async with contextlib.aclosing(decode) as outputs:
                out = await _first_output(prefill, outputs)
                result, ended = prefill.result()
                self.transfer_seconds.observe(max(time.monotonic() - ended, 0.0))
                join = PdJoin(envelope, result)
                yield self._joined(join, out)
                async for out in outputs:
                    yield self._joined(join, out)
        finally:
            if not prefill.done():
                prefill.cancel()
            await asyncio.gather(prefill, return_exceptions=True)

    def _joined(self, join: PdJoin, out: EngineOutput) -> EngineOutput:
        out = join.join(out)
        if join.experts_omitted and out.finish is not None:
            self.experts_omitted += 1
        return out

    async def _prefill(
        self, stage: Envelope, subject: str, worker: str
    ) -> tuple[PrefillResult, float]:
        """The stage's result and when it came (monotonic), or the MeshError that ends
        the request."""
        result = PrefillResult()
        async with contextlib.aclosing(self.client.generate(stage, subject=subject)) as stream:
            async for frame in stream:
                kind = frame["t"]
                if kind == frames.OUT or kind == frames.END:
                    result.add(frame)  # type: ignore[arg-type]
                    if kind == frames.END:
                        return result, time.monotonic()
                elif kind == frames.ERR:
                    raise _stage_error(frame, worker)  # type: ignore[arg-type]
        raise _prefill_failed(worker, "the prefill stage ended without a result")


async def _first_output(
    prefill: asyncio.Future[tuple[PrefillResult, float]], outputs: AsyncIterator[EngineOutput]
) -> EngineOutput:
    """Decode's first output, once the prefill's result is in too (the join needs it). A
    prefill that fails first ends the request: a decode waiting for KV that will never
    come is not waited for."""
    first: asyncio.Future[EngineOutput] = asyncio.ensure_future(anext(outputs))
    try:
        either: set[asyncio.Future[Any]] = {prefill, first}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        await prefill  # raises the stage's error
        return await first
    except StopAsyncIteration:
        raise MeshError(ErrorCode.INTERNAL, "the decode half ended without output") from None
    finally:
        if not first.done():
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)


def _prefill_failed(worker: str, message: str) -> MeshError:
    """The prefill worker failed the stage: another pair may serve the request."""
    return MeshError(ErrorCode.UNAVAILABLE, message, detail={"prefill_worker": worker})


def _stage_error(frame: frames.ErrFrame, worker: str) -> MeshError:
    """The error that ends a request whose prefill stage ended in `frame`: the stage's own
    (the prefill engine refused the request: so would any), naming the prefill worker."""
    error = frames.error_of(frame)
    if "origin" in frame and error.retryable:  # the client's own finding: the worker
        # went silent or away (not a stage it refused to send, too large for the server)
        return _prefill_failed(worker, f"prefill worker {worker} failed: {error.message}")
    return MeshError(
        error.code,
        error.message,
        retryable=error.retryable,
        detail={**error.detail, "prefill_worker": worker},
    )

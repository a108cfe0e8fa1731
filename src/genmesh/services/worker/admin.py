"""The worker's side of the admin subjects: abort by client ID, and cache flushes
(`docs/protocol.md` §8.1, §8.2).

An abort asks the engine to stop the request the way it stops an aborted one (its stream
then ends with an `abort` finish, an `end` frame: the request is over, not failed, so it
is never migrated). When the engine cannot (it does not run the request yet, or has no
such call), or has not finished it after `ABORT_GRACE_S`, the worker cancels the
generation and sends that `end` frame itself.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from nats.aio.msg import Msg

from genmesh.codecs import CodecError, UnknownCodecError, get_codec
from genmesh.shared import frames
from genmesh.shared.abort import AbortOrder
from genmesh.shared.bus import message_codec, publish
from genmesh.shared.envelope import Envelope
from genmesh.shared.errors import ErrorCode, MeshError

if TYPE_CHECKING:
    from genmesh.services.worker.service import Worker, _Active

log = logging.getLogger(__name__)

# How long an engine told to abort may take to end the request itself.
ABORT_GRACE_S = 5.0
# The stop reason of a generation the worker ends as aborted (identity-compared).
ABORTED = MeshError(ErrorCode.CANCELLED, "request was aborted")
# SGLang's messages: a running request, and one still waiting for the scheduler.
ABORT_MESSAGE = "Aborted"
ABORT_WAITING_MESSAGE = "Abort in waiting queue"


def abort_end_frame(envelope: Envelope, tokens: int, started: bool) -> frames.EndFrame:
    """The `end` frame of a request the worker aborted itself."""
    return {
        "t": frames.END,
        "id": envelope.id,
        "seq": 0,
        "tokens": [],
        "finish": {
            "reason": "abort",
            "message": ABORT_MESSAGE if started else ABORT_WAITING_MESSAGE,
        },
        "usage": {
            "prompt_tokens": len(envelope.token_ids),
            "completion_tokens": tokens,
            "cached_tokens": 0,
        },
    }


class AdminHandlers:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    async def on_abort(self, msg: Msg) -> None:
        """Abort the admitted requests the order names; with a reply subject, answer
        `{"worker", "aborted": [client IDs]}`."""
        worker = self.worker
        try:
            order = AbortOrder.from_wire(message_codec(msg).decode(msg.data))
        except (UnknownCodecError, CodecError, ValueError) as exc:
            log.info("ignored unreadable abort order: %s", exc)
            return
        hits = [a for a in worker.active_requests() if order.hits(a.envelope)]
        for active in hits:
            self.abort(active)
        if msg.reply:
            answer: dict[str, Any] = {
                "worker": worker.worker_id,
                "aborted": [a.envelope.client_id for a in hits],
            }
            await publish(worker.nc, msg.reply, message_codec(msg), answer)

    def abort(self, active: _Active) -> None:
        if active.abort_requested or active.task is None or active.task.done():
            return
        active.abort_requested = True
        log.info(
            "request %s (client id %s): aborted by client id",
            active.envelope.id,
            active.envelope.client_id,
        )
        self.worker.spawn(self._abort(active), name=f"abort {active.envelope.id}")

    async def _abort(self, active: _Active) -> None:
        try:
            told = await self.worker.engine.abort(active.envelope.id)
        except Exception as exc:
            log.warning("engine abort of %s failed: %s", active.envelope.id, exc)
            told = False
        task = active.task
        if told and task is not None:
            await asyncio.wait({task}, timeout=ABORT_GRACE_S)
        self.worker.stop_request(active, ABORTED)  # no-op once it has ended

    async def on_flush(self, msg: Msg) -> None:
        """Flush the engine's cache, answering `{"worker", "ok", "message"?}`: in a task,
        so a slow engine holds up nothing else."""
        if msg.reply:
            self.worker.spawn(self._flush(msg), name="flush cache")

    async def _flush(self, msg: Msg) -> None:
        worker = self.worker
        answer: dict[str, Any] = {"worker": worker.worker_id, "ok": True}
        try:
            await worker.engine.flush_cache()
        except MeshError as exc:
            answer |= {"ok": False, "message": exc.message}
        except Exception as exc:
            log.exception("flushing the engine's cache failed")
            answer |= {"ok": False, "message": f"internal error: {exc!r}"}
        try:
            codec = message_codec(msg)
        except UnknownCodecError:
            codec = get_codec(None)
        await publish(worker.nc, msg.reply, codec, answer)

"""Fault control of a worker started with `--testkit-faults` (tests only).

Its engine is wrapped in a `FaultyEngine` (`genmesh.engines.faults`); tests steer the faults
over NATS on `genmesh.<ns>.testkit.<worker id>` (`Subjects.testkit`).
"""

from __future__ import annotations

import json
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from genmesh.engines.faults import Fault, FaultyEngine
from genmesh.shared.subjects import Subjects


async def serve_fault_control(
    nc: Client, namespace: str, worker_id: str, engine: FaultyEngine
) -> Subscription:
    """Answer fault-control requests: a JSON Fault queues it, `{"clear": true}` drops the
    queued faults, `{}` reads the state.

    Test-only: a worker exposes this only when started with --testkit-faults.
    """

    async def on_request(msg: Msg) -> None:
        try:
            body = json.loads(msg.data or b"{}")
            if isinstance(body, dict) and body.get("clear") is True:
                engine.state.faults.clear()
            elif body:
                engine.state.faults.append(Fault.from_json(body))
            answer: dict[str, Any] = engine.state.snapshot()
        except ValueError as exc:
            answer = {"error": str(exc)}
        if msg.reply:
            await nc.publish(msg.reply, json.dumps(answer).encode())

    return await nc.subscribe(Subjects(namespace).testkit(worker_id), cb=on_request)

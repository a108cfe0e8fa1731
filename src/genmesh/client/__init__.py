"""The NATS-level client of the mesh. The HTTP frontend dispatches through it too.

    from genmesh.client import MeshClient, request

    async with await MeshClient.connect("nats://127.0.0.1:4222") as client:
        async for frame in client.generate(request([1, 2, 3], max_tokens=8)):
            print(frame)

`generate` yields every reply frame (`ack`, `out`, `ka`, `end`, `err`) and always ends with
exactly one terminal frame, `end` or `err`: failures the client detects itself (no
responders, a worker that never acknowledges or goes silent, lost frames) arrive as `err`
frames with `"origin": "client"`. Leaving the loop early, or cancelling the task, publishes
a cancel so the engine stops.

When a worker fails with a retryable error (it died, its engine broke, it was drained,
it went silent and no longer answers pings or answers that it no longer runs the request,
or discovery dropped it), the client
*migrates* the request: it re-dispatches a continuation elsewhere and yields a `mig` frame
(`MigFrame`: `{"t": "mig", "attempt", "reason", "message", "from_worker", "delivered"}`,
`reason` a `MigrationReason`; made by the client, never on the wire) before the new
attempt's frames. Counters in the new attempt's frames (usage) count from that attempt;
`genmesh.formats.merge.Rebaser` turns them back into what an uninterrupted run reports.

Modules: `mesh_client` (MeshClient, `request`), `attempt` (one dispatch), `migration`
(the Migrator and its vocabulary), `tracing` (the attempt spans).
"""

from genmesh.client.mesh_client import MeshClient, request
from genmesh.client.migration import MIG, ClientFrame, MigFrame, MigrationReason

__all__ = ["MIG", "ClientFrame", "MeshClient", "MigFrame", "MigrationReason", "request"]

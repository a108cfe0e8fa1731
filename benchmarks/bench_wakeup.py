"""What one wake-up of an idle process costs, by how long it was idle.

    .venv/bin/python benchmarks/bench_wakeup.py [--bursts 1000] [--gaps-ms 0,1,2,4,16] [--repeats 3]

A subscriber process (nats-py on uvloop, a callback subscription on a wildcard inbox, a
per-stream queue read by a task: the frontend's reply path, `MeshClient._on_reply`) receives
bursts of two messages, what a worker's `ack` and first `out` frame are, published by this
process through a real nats-server, with a pause of GAP ms between bursts. The figure is the
subscriber's CPU (process_time) per burst, median of the repeats. The work per burst is the
same at every gap; what changes is how cold the process is when the burst wakes it. At c=1 a
request wakes each process of the mesh once per message it sends it (docs/performance.md,
"c=1: where the time goes"), so this is the price of each of those wake-ups.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import nats

from genmesh.shared.loop import run
from genmesh.shared.natsserver import NatsServer

INBOX = "_INBOX_wakeup"
READY = "wakeup.ready"


async def subscriber(url: str, bursts: int) -> None:
    """Receive `bursts` bursts of two messages; print CPU µs per burst."""
    nc = await nats.connect(url)
    queue: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_reply(msg: nats.aio.msg.Msg) -> None:
        queue.put_nowait(msg.data)

    await nc.subscribe(f"{INBOX}.*", cb=on_reply)
    await nc.flush()
    await nc.publish(READY, b"")
    await nc.flush()
    await queue.get()  # the first message starts the clock
    started = time.process_time()
    for _ in range(2 * bursts - 1):
        await queue.get()
    print(f"{1e6 * (time.process_time() - started) / bursts:.1f}", flush=True)
    await nc.close()


async def one_run(url: str, bursts: int, gap_s: float) -> float:
    nc = await nats.connect(url)
    ready = await nc.subscribe(READY, max_msgs=1)
    await nc.flush()
    sub = await asyncio.create_subprocess_exec(
        *[sys.executable, __file__, "--role", "sub", "--url", url, "--bursts", str(bursts)],
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        await ready.next_msg(timeout=30)
        for _ in range(bursts):
            await nc.publish(f"{INBOX}.1", b"a" * 160)  # an ack's size
            await nc.publish(f"{INBOX}.1", b"o" * 130)  # a first out frame's
            await nc.flush()  # one burst per gap, not coalesced with the next
            if gap_s:
                await asyncio.sleep(gap_s)
        out, _ = await asyncio.wait_for(sub.communicate(), timeout=60)
    finally:
        if sub.returncode is None:
            sub.kill()
            await sub.wait()
        await nc.close()
    return float(out.decode().strip())


async def bench(bursts: int, gaps_ms: list[float], repeats: int) -> None:
    server = NatsServer()
    url = server.start()
    try:
        print(f"subscriber CPU per burst of two messages, median of {repeats}")
        print(f"{'gap ms':>7} {'µs/burst':>9}  runs")
        for gap in gaps_ms:
            runs = [await one_run(url, bursts, gap / 1000.0) for _ in range(repeats)]
            shown = " ".join(f"{r:.0f}" for r in runs)
            print(f"{gap:>7g} {statistics.median(runs):>9.1f}  {shown}", flush=True)
    finally:
        server.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bursts", type=int, default=1000)
    p.add_argument("--gaps-ms", default="0,1,2,4,16", help="pauses between bursts, ms")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--role", default="bench", choices=("bench", "sub"), help=argparse.SUPPRESS)
    p.add_argument("--url", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.role == "sub":
        run(subscriber(a.url, a.bursts), "uvloop")
    else:
        run(bench(a.bursts, [float(g) for g in a.gaps_ms.split(",")], a.repeats), "uvloop")
    return 0


if __name__ == "__main__":
    sys.exit(main())

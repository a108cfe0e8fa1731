"""Migration stall after SIGKILL: how long a streaming client waits when its worker dies.

    .venv/bin/python benchmarks/bench_migration.py [--kills 200] [--workers 3]
        [--speedup 2] [--max-tokens 64] [--chunks 3] [--settle] [--json FILE]

Starts a nats-server and a mesh (1 round-robin router, N mock workers with a per-token
delay, 1 frontend), each its own OS process. Each trial sends one SGLang /generate SSE
request, reads a few chunks, SIGKILLs the worker serving it (found from the workers'
testkit state, which lists what each is running), starts a replacement worker in the
background, and reads the rest. The stall is the longest gap between two consecutive
SSE chunks from the last chunk before the kill on: what the client sees while the mesh
notices the death and continues the request elsewhere. Every response is checked against
an uninterrupted run of the same request (tokens, logprobs, finish reason, counts).

The frontend logs each move (`request <id>: attempt 2 after: <why>`); the reason tells
what detected the failure: `ping` (the silent worker's ping subject had no responders),
`discovery` (the worker dropped out of discovery after missed heartbeats), `ack timeout`
(the continuation went to a worker that was dead but still listed), `idle timeout`.
See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import aiohttp
import nats

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.mesh import Mesh, Service

from genmesh.shared.natsserver import NatsServer
from genmesh.shared.subjects import Subjects

NAMESPACE = "benchmig"
VOCAB, EOS = 1000, 7
ATTEMPT = "attempt "
DETECTIONS = (
    ("ping", "ping subject has no responders"),
    ("discovery", "left the mesh"),
    ("ack timeout", "acknowledged the request within"),
    ("idle timeout", "sent a frame within"),
)


def detection(reason: str) -> str:
    for name, needle in DETECTIONS:
        if needle in reason:
            return name
    return "other: " + reason[:60]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summary(values: list[float]) -> str:
    if not values:
        return "-"
    return (
        f"n={len(values):4d}  p50={percentile(values, 0.5):7.1f}  "
        f"p90={percentile(values, 0.9):7.1f}  p99={percentile(values, 0.99):7.1f}  "
        f"max={max(values):7.1f}"
    )


def request_body(prompt: list[int], max_tokens: int, rid: str) -> dict[str, Any]:
    return {
        "input_ids": prompt,
        "rid": rid,
        "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "stream": True,
    }


def fold(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """What an SGLang SSE stream adds up to; raises if its own invariants do not hold."""
    tokens: list[int] = []
    logprobs: list[Any] = []
    tops: list[Any] = []
    for i, chunk in enumerate(chunks):
        meta = chunk["meta_info"]
        tokens += chunk["output_ids"]
        if meta["completion_tokens"] != len(tokens):
            raise AssertionError(f"chunk {i}: completion_tokens {meta['completion_tokens']}")
        if (meta["finish_reason"] is None) != (i < len(chunks) - 1):
            raise AssertionError(f"chunk {i}: finish_reason {meta['finish_reason']}")
        logprobs += meta["output_token_logprobs"]
        tops += meta["output_top_logprobs"]
    last = dict(chunks[-1]["meta_info"])
    for key in ("e2e_latency", "output_token_logprobs", "output_top_logprobs"):
        last.pop(key, None)
    return {"output_ids": tokens, "logprobs": logprobs, "tops": tops, "meta": last}


class Bench:
    def __init__(self, args: argparse.Namespace, mesh: Mesh) -> None:
        self.args = args
        self.mesh = mesh
        self.frontend: Service | None = None  # set once it runs
        self.log_offset = 0
        self.worker_opts = {
            "speedup": args.speedup,
            "vocab_size": VOCAB,
            "eos_token_id": EOS,
            "testkit_faults": True,
            "heartbeat": args.heartbeat,
        }

    def new_attempts(self) -> list[tuple[int, str, int]]:
        """(attempt, reason, delivered) of the moves the frontend logged since last call."""
        assert self.frontend is not None
        text = self.frontend.log()
        fresh, self.log_offset = text[self.log_offset :], len(text)
        out = []
        for line in fresh.splitlines():
            marker = line.find(": " + ATTEMPT)
            if marker < 0 or " after: " not in line:
                continue
            rest = line[marker + 2 + len(ATTEMPT) :]
            number, _, tail = rest.partition(" after: ")
            reason, _, delivered = tail.rpartition(" (")
            out.append((int(number), reason, int(delivered.split()[0])))
        return out

    async def serving(self, nc: Any, timeout: float = 2.0) -> Service:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for service in self.mesh.workers:
                subject = Subjects(NAMESPACE).testkit(service.name)
                try:
                    msg = await nc.request(subject, b"{}", timeout=0.5)
                except Exception:  # a worker still starting, or one just killed
                    continue
                if json.loads(msg.data)["running"]:
                    return service
            await asyncio.sleep(0.001)
        raise TimeoutError("no worker is running the request")

    async def stream(
        self, session: aiohttp.ClientSession, body: dict[str, Any], on_chunk: Any = None
    ) -> tuple[int, list[dict[str, Any]], list[float], bool]:
        """(status, chunks, arrival times, ended with [DONE])."""
        chunks: list[dict[str, Any]] = []
        times: list[float] = []
        done = False
        async with session.post(self.mesh.http_url + "/generate", json=body) as resp:
            async for raw in resp.content:
                line = raw.rstrip(b"\r\n")
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:]
                if payload == b"[DONE]":
                    done = True
                    continue
                chunks.append(json.loads(payload))
                times.append(time.monotonic())
                if on_chunk is not None:
                    await on_chunk(len(chunks))
            return resp.status, chunks, times, done

    async def settle(self, gone: str | None, new: str | None) -> None:
        """Until the frontend knows `new` and neither it nor the router lists `gone`."""
        router = next(s for s in self.mesh.services if s.role == "router")

        def ready() -> bool:
            known = self.mesh.worker_ids()
            dropped = gone is None or f"worker {gone} missed its heartbeats" in router.log()
            return dropped and (gone is None or gone not in known) and (new is None or new in known)

        deadline = time.monotonic() + 30
        while not await asyncio.to_thread(ready):
            if time.monotonic() > deadline:
                raise TimeoutError("the mesh did not settle")
            await asyncio.sleep(0.05)

    async def enough_workers(self) -> None:
        """At least two live workers known to the frontend: somewhere to migrate to."""
        deadline = time.monotonic() + 30
        while True:
            alive = {s.name for s in self.mesh.workers}
            known = await asyncio.to_thread(self.mesh.worker_ids)
            if len(alive & known) >= 2:
                return
            if time.monotonic() > deadline:
                raise TimeoutError("fewer than two live workers")
            await asyncio.sleep(0.05)

    async def run(self) -> dict[str, Any]:
        args = self.args
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(VOCAB) for _ in range(args.prompt_tokens)] for _ in range(8)]
        timeout = aiohttp.ClientTimeout(total=120)
        nc = await nats.connect(self.mesh.nats_url)
        results: list[dict[str, Any]] = []
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                references = []
                for i, prompt in enumerate(prompts):
                    body = request_body(prompt, args.max_tokens, f"bench-{i}")
                    status, chunks, _, done = await self.stream(session, body)
                    if status != 200 or not done:
                        raise RuntimeError(f"the uninterrupted run failed: {status}")
                    references.append(fold(chunks))
                self.new_attempts()
                started = time.monotonic()
                for trial in range(args.kills):
                    await self.enough_workers()
                    which = trial % len(prompts)
                    body = request_body(prompts[which], args.max_tokens, f"bench-{which}")
                    kill_after = rng.randint(1, args.chunks) if args.random_chunks else args.chunks
                    state: dict[str, Any] = {}

                    async def on_chunk(
                        n: int, kill_after: int = kill_after, st: dict[str, Any] = state
                    ) -> None:
                        if n != kill_after or "victim" in st:
                            return
                        victim = await self.serving(nc)
                        st["victim"] = victim.name
                        st["kill_chunk"] = n
                        victim.kill()
                        st["killed_at"] = time.monotonic()
                        st["replacement"] = self.mesh.add_worker(wait=False, **self.worker_opts)

                    try:
                        status, chunks, times, done = await self.stream(session, body, on_chunk)
                        error = None
                    except Exception as exc:  # the response broke off
                        status, chunks, times, done, error = 0, [], [], False, repr(exc)
                    record: dict[str, Any] = {
                        "trial": trial,
                        "status": status,
                        "killed": "victim" in state,
                        "error": error,
                    }
                    if status == 200 and done and chunks and "error" not in chunks[-1]:
                        try:
                            record["correct"] = fold(chunks) == references[which]
                        except (AssertionError, KeyError) as exc:
                            record["correct"] = False
                            record["error"] = repr(exc)
                    else:
                        record["correct"] = False
                        if chunks and "error" not in record:
                            record["error"] = str(chunks[-1])[:200]
                    if "killed_at" in state and len(times) > state["kill_chunk"]:
                        # From the last chunk read before the kill on, the longest gap.
                        first = state["kill_chunk"] - 1
                        j = max(range(first, len(times) - 1), key=lambda i: times[i + 1] - times[i])
                        record["stall_ms"] = (times[j + 1] - times[j]) * 1000
                        record["kill_to_resume_ms"] = (times[j + 1] - state["killed_at"]) * 1000
                    moves = self.new_attempts()
                    record["attempts"] = [
                        {"attempt": a, "reason": r, "delivered": d} for a, r, d in moves
                    ]
                    # Moves before the kill: the request was first sent to a worker that
                    # had died earlier but was still listed (it costs time to first token).
                    cut = state.get("kill_chunk", 1 << 30)
                    record["pre_kill_moves"] = sum(d < cut for _, _, d in moves)
                    after_kill = [detection(r) for _, r, d in moves if d >= cut]
                    record["detected_by"] = " + ".join(after_kill) if after_kill else None
                    results.append(record)
                    if args.settle and "victim" in state:
                        await self.settle(state["victim"], state["replacement"].name)
                    if (trial + 1) % 20 == 0:
                        done_stalls = [r["stall_ms"] for r in results if r.get("stall_ms")]
                        print(
                            f"  {trial + 1}/{args.kills} kills, {time.monotonic() - started:.0f}s, "
                            f"stall p50 {percentile(done_stalls, 0.5):.0f} ms",
                            file=sys.stderr,
                        )
        finally:
            await nc.close()
        return {"results": results, "wall_s": time.monotonic() - started}


def report(args: argparse.Namespace, outcome: dict[str, Any]) -> str:
    results = outcome["results"]
    killed = [r for r in results if r["killed"]]
    stalls = [r["stall_ms"] for r in killed if r.get("stall_ms") is not None]
    lost = [r for r in results if r["status"] != 200 or r.get("error")]
    wrong = [r for r in results if r not in lost and not r["correct"]]
    by: dict[str, list[float]] = defaultdict(list)
    for r in killed:
        if r.get("stall_ms") is not None:
            by[r["detected_by"] or "no move logged"].append(r["stall_ms"])
    hops: dict[int, int] = defaultdict(int)
    for r in killed:
        hops[len(r["attempts"]) - r["pre_kill_moves"]] += 1
    pre_kill = sum(r["pre_kill_moves"] for r in results)
    lines = [
        f"migration stall after SIGKILL: {len(results)} trials, {len(killed)} kills, "
        f"{args.workers} workers, speed-up {args.speedup} (~{5.74 / args.speedup:.1f} ms/token), "
        f"max_new_tokens {args.max_tokens}, kill after chunk {args.chunks}"
        f"{' (random 1..N)' if args.random_chunks else ''}, worker heartbeat {args.heartbeat}s, "
        f"{'settled' if args.settle else 'no settling'} between kills, "
        f"{outcome['wall_s']:.0f}s",
        "",
        f"stall (ms)          {summary(stalls)}",
    ]
    for name in sorted(by, key=lambda k: -len(by[k])):
        lines.append(f"  {name:<17} {summary(by[name])}")
    lines += [
        "",
        "moves after the kill, per request: "
        + ", ".join(f"{n} move{'s' if n != 1 else ''}: {c}" for n, c in sorted(hops.items())),
        f"moves before the kill (first sent to a dead worker still listed): {pre_kill}",
        f"lost responses: {len(lost)}   wrong responses: {len(wrong)}",
    ]
    for r in (lost + wrong)[:10]:
        lines.append(
            f"  trial {r['trial']}: status {r['status']} {r.get('error') or 'content differs'}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=200, help="trials (each kills one worker)")
    parser.add_argument("--workers", type=int, default=3, help="mock workers kept running")
    parser.add_argument("--speedup", type=float, default=2.0, help="mock speed-up (2: ~3 ms/token)")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_new_tokens per request")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="prompt length")
    parser.add_argument("--chunks", type=int, default=3, help="SSE chunks read before the kill")
    parser.add_argument("--random-chunks", action="store_true", help="kill after 1..--chunks")
    parser.add_argument(
        "--heartbeat", type=float, default=1.0, help="worker heartbeat (discovery drops after 3)"
    )
    parser.add_argument("--frontend-arg", action="append", default=[], help="extra frontend flag")
    parser.add_argument(
        "--settle",
        action="store_true",
        help="wait for discovery to drop the dead worker and add its replacement before the "
        "next kill (default: the replacement starts in the background)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="save every trial")
    parser.add_argument("--keep-logs", action="store_true", help="keep the services' logs")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="genmesh-bench-migration-"))
    server = NatsServer()
    url = server.start()
    mesh = Mesh(url, workdir, NAMESPACE)
    failed = True
    try:
        mesh.add_router()
        bench = Bench(args, mesh)
        ids = [mesh.add_worker(wait=False, **bench.worker_opts).name for _ in range(args.workers)]
        bench.frontend = mesh.add_frontend(*args.frontend_arg)
        mesh.wait_for_workers(lambda known: set(ids) <= known, what="the workers")
        outcome = asyncio.run(bench.run())
        print(report(args, outcome))
        if args.json:
            args.json.write_text(
                json.dumps({"config": vars(args) | {"json": str(args.json)}, **outcome}, indent=1)
            )
        failed = False
    finally:
        mesh.stop()
        server.stop()
        if failed or args.keep_logs:
            print(f"logs: {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

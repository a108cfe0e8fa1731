"""Sending the workload and timing each request, in one process on one event loop.

One request is one `POST` on a shared keep-alive aiohttp session. An SSE answer
(`text/event-stream`) is read event by event, any other as one JSON body: a server that
ignores `stream` (vLLM v0.11-v0.18 on this route) is measured as unary. Its clock starts just
before the request is written and reads `time.perf_counter()` once per chunk of bytes
received, so the events of one chunk share a time. TTFT is the first event that carries
an output token (for a unary request: the whole answer, so TTFT = end to end);
inter-token latency is the gap between two token-carrying events divided among the event's
tokens (an event of k tokens adds k gaps of gap/k, as SGLang's bench_serving counts them),
so a server that batches tokens into fewer events shows the same per-token figure.

Closed loop: `--concurrency` clients, each sending its next request when its last one
ends. Open loop: requests arrive at `--request-rate` with exponential gaps (Poisson) from
one scheduler, whatever is in flight, each in a task of the loop's TaskGroup; with
`--max-concurrency` an arrival waits for a free slot and its clock starts when it is sent
(the time it waited is the server's backlog showing, and it is reported as such: `sent`
lags `arrived`). Every task is the TaskGroup's, so a failure cancels them all.

The run ends at `-n` requests or at `--duration` seconds, whichever comes first; requests
in flight then are awaited and counted. Or it is stopped (the `stop` event: Ctrl-C or
SIGTERM): the loop is cancelled, and with it the TaskGroup's requests in flight, which are
not records but counted as cut off.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson

from genmesh.bench.apis import Api, Failed
from genmesh.bench.config import DEFAULT_REQUESTS, BenchConfig
from genmesh.bench.workload import Request, Workload

JSON_HEADERS = {"Content-Type": "application/json"}
SSE_DONE = b"[DONE]"


@dataclass(slots=True)
class Record:
    """One request's measurements; times in seconds, `arrived` and `sent` from the start
    of its phase."""

    index: int
    prompt_tokens: int
    asked_tokens: int
    arrived: float
    sent: float = 0.0
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    error: str | None = None  # its kind: "http 503", "timeout", "abort", ...

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(slots=True)
class Phase:
    records: list[Record]
    seconds: float  # from its start to its last answer (or to its stop)
    cpu_seconds: float  # this process's CPU over the phase: what the load generator cost
    stopped: bool = False  # by the `stop` event, before its end
    cut_off: int = 0  # requests sent (or arrived) but unanswered when it stopped


class Target:
    """Where and how requests go: the URL, the API's counting, the session."""

    def __init__(self, config: BenchConfig, api: Api, session: aiohttp.ClientSession) -> None:
        self.url = config.url if _has_path(config.url) else config.url.rstrip("/") + api.path
        self.api = api
        self.session = session

    async def send(self, request: Request, record: Record, start: float) -> Record:
        sent = time.perf_counter()
        record.sent = sent - start
        try:
            async with self.session.post(self.url, data=request.body, headers=JSON_HEADERS) as r:
                if r.status != 200:
                    await r.read()
                    record.error = f"http {r.status}"
                elif r.content_type == "text/event-stream":
                    await self._read_stream(r, record, sent)
                else:
                    body = await r.read()
                    record.e2e = record.ttft = time.perf_counter() - sent
                    record.output_tokens = self.api.count_body(orjson.loads(body))
        except Failed as exc:
            record.error = str(exc)
        except orjson.JSONDecodeError:
            record.error = "malformed"
        except TimeoutError:
            record.error = "timeout"
        except aiohttp.ClientError as exc:
            record.error = type(exc).__name__
        return record

    async def _read_stream(
        self, response: aiohttp.ClientResponse, record: Record, sent: float
    ) -> None:
        counter = self.api.counter()
        buffer = b""
        last = sent
        async for chunk in response.content.iter_any():
            now = time.perf_counter()
            buffer += chunk
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                for line in event.splitlines():
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == SSE_DONE:
                        record.e2e = now - sent
                        return
                    tokens = counter.count(orjson.loads(payload))
                    if not tokens:
                        continue
                    if record.ttft is None:
                        record.ttft = now - sent
                    else:
                        record.itl.extend(itertools.repeat((now - last) / tokens, tokens))
                    last = now
                    record.output_tokens += tokens
        record.error = "incomplete"  # the stream ended without its `data: [DONE]`


def _has_path(url: str) -> bool:
    return urlsplit(url).path not in ("", "/")


class Requests:
    """The phase's requests, until its count or its time is up."""

    def __init__(self, workload: Workload, count: int | None, seconds: float | None) -> None:
        self.requests: Iterator[Request] = iter(workload)
        self.count = count
        self.seconds = seconds
        self.sent = 0
        self.start = time.perf_counter()

    @property
    def all_sent(self) -> bool:
        return self.count is not None and self.sent >= self.count

    def next(self) -> Request | None:
        if self.all_sent:
            return None
        if self.seconds is not None and time.perf_counter() - self.start >= self.seconds:
            return None
        self.sent += 1
        return next(self.requests)


Done = Callable[[Record], None]


async def closed_loop(target: Target, requests: Requests, concurrency: int, done: Done) -> None:
    async def client() -> None:
        while (request := requests.next()) is not None:
            arrived = time.perf_counter() - requests.start
            record = Record(request.index, request.prompt_tokens, request.output_tokens, arrived)
            done(await target.send(request, record, requests.start))

    async with asyncio.TaskGroup() as group:
        for _ in range(concurrency):
            group.create_task(client())


async def open_loop(
    target: Target,
    requests: Requests,
    rate: float,
    cap: int | None,
    rng: random.Random,
    done: Done,
) -> None:
    slots = asyncio.Semaphore(cap) if cap is not None else None

    async def one(request: Request, arrived: float) -> None:
        record = Record(request.index, request.prompt_tokens, request.output_tokens, arrived)
        if slots is None:
            done(await target.send(request, record, requests.start))
            return
        async with slots:
            done(await target.send(request, record, requests.start))

    async with asyncio.TaskGroup() as group:
        due = 0.0
        while not requests.all_sent:
            due += rng.expovariate(rate)
            if requests.seconds is not None and due >= requests.seconds:
                break  # the next arrival is after the end: do not wait for it
            delay = due - (time.perf_counter() - requests.start)
            if delay > 0:
                await asyncio.sleep(delay)
            request = requests.next()
            if request is None:
                break
            group.create_task(one(request, time.perf_counter() - requests.start))


async def unless_stopped(sending: Coroutine[Any, Any, None], stop: asyncio.Event) -> bool:
    """Run `sending` to its end, or until `stop` is set: then cancel it, and with it every
    task of its TaskGroup. True if it was stopped."""
    async with asyncio.TaskGroup() as group:
        working = group.create_task(sending)
        stopping = group.create_task(stop.wait())
        await asyncio.wait((working, stopping), return_when=asyncio.FIRST_COMPLETED)
        stopped = not working.done()
        working.cancel()
        stopping.cancel()
    return stopped


async def run_phase(
    config: BenchConfig,
    session: aiohttp.ClientSession,
    workload: Workload,
    count: int | None,
    done: Done,
    stop: asyncio.Event,
    measured: bool = True,
) -> Phase:
    """One phase: the warm-up (closed loop, `count` requests) or the measured run, until
    its end or `stop`."""
    records: list[Record] = []

    def record_done(record: Record) -> None:
        records.append(record)
        done(record)

    target = Target(config, workload.api, session)
    seconds = config.duration_s if measured else None
    cpu = time.process_time()
    requests = Requests(workload, count, seconds)
    if measured and config.request_rate is not None:
        rng = random.Random(f"{config.seed}:arrivals")
        sending = open_loop(
            target, requests, config.request_rate, config.max_concurrency, rng, record_done
        )
    else:
        sending = closed_loop(target, requests, config.concurrency, record_done)
    stopped = await unless_stopped(sending, stop)
    elapsed = time.perf_counter() - requests.start
    records.sort(key=lambda r: r.index)
    cut_off = requests.sent - len(records)
    return Phase(records, elapsed, time.process_time() - cpu, stopped, cut_off)


def measured_count(config: BenchConfig) -> int | None:
    """-n, or its default when no --duration bounds the run either."""
    if config.requests is None and config.duration_s is None:
        return DEFAULT_REQUESTS
    return config.requests


def new_session(config: BenchConfig) -> aiohttp.ClientSession:
    """A keep-alive connection per request in flight: as many as the loop keeps in flight
    (an uncapped open loop: no limit, 0)."""
    if config.request_rate is None:
        connections = config.concurrency
    elif config.max_concurrency is None:
        connections = 0
    else:
        connections = max(config.concurrency, config.max_concurrency)  # the warm-up's too
    connector = aiohttp.TCPConnector(limit=connections, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=config.timeout_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout)

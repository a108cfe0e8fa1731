"""What each `genmesh` subcommand does, given its typed config (the commands are listed in
`genmesh.commandline`; each config is declared next to the code it configures). The
modules a command runs on are imported by its handler, so that parsing any command line
imports no NATS or HTTP library."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from genmesh.shared.connection import MeshConnection
from genmesh.shared.credentials import NatsAuth, NatsAuthError, nats_auth_group
from genmesh.shared.lifecycle import STOPPED_BY_SIGNAL
from genmesh.shared.natsserver import NatsServer, NatsServerConfig, NatsServerError
from genmesh.shared.settings import (
    group,
    non_negative_int,
    option,
    positive_float,
    render_token_ids,
    token_ids,
)

if TYPE_CHECKING:
    from genmesh.bench.config import BenchConfig
    from genmesh.client import MeshClient
    from genmesh.records.config import TraceCheckConfig, TraceReplayConfig
    from genmesh.services.frontend.config import FrontendConfig
    from genmesh.services.router.config import RouterConfig
    from genmesh.services.worker.config import WorkerProcessConfig
    from genmesh.shared.envelope import Envelope
    from genmesh.status.config import StatusConfig
    from genmesh.testkit.config import TestkitConfig
    from genmesh.up.config import UpConfig


def _fail(message: str) -> int:
    print(f"genmesh: {message}", file=sys.stderr)
    return 2


def _run_service(coro: Coroutine[Any, Any, None], event_loop: str) -> int:
    # Imported here, not at the top: parsing a command (and its --help) stays quick.
    from genmesh.formats.catalog import ConfigError
    from genmesh.shared.bus import NatsPermissionDenied, NatsUnreachable
    from genmesh.shared.loop import run

    try:
        run(coro, event_loop)
    except (NatsUnreachable, NatsPermissionDenied, ConfigError, NatsServerError, ValueError) as exc:
        return _fail(str(exc))
    except OSError as exc:  # e.g. the HTTP port is taken
        return _fail(f"{exc.strerror or exc}")
    return 0


def cmd_frontend(config: FrontendConfig) -> int:
    from genmesh.services.frontend.serve import serve_frontend
    from genmesh.shared.lifecycle import configure_logging

    # Frontends that share a port (`genmesh up --frontends`) log to the same terminal: the
    # pid tells their lines apart.
    label = f"frontend[{os.getpid()}]" if config.reuse_port else "frontend"
    configure_logging(config.mesh.log_level, label)
    return _run_service(serve_frontend(config), config.mesh.event_loop)


def cmd_trace_check(config: TraceCheckConfig) -> int:
    from genmesh.records.check import main_check

    return main_check(list(config.files), expect=config.expect, as_json=config.as_json)


def cmd_trace_replay(config: TraceReplayConfig) -> int:
    from genmesh.records.replay import main_replay

    return main_replay(
        list(config.files),
        url=config.url,
        concurrency=config.concurrency,
        timeout_s=config.timeout_s,
        as_json=config.as_json,
        progress=config.progress,
    )


def cmd_router(config: RouterConfig) -> int:
    from genmesh.services.router.serve import serve_router
    from genmesh.shared.lifecycle import configure_logging

    configure_logging(config.mesh.log_level, "router")
    return _run_service(serve_router(config), config.mesh.event_loop)


def cmd_worker(config: WorkerProcessConfig) -> int:
    from genmesh.services.worker.serve import serve_worker
    from genmesh.shared.lifecycle import configure_logging

    worker_id = config.service.worker_id
    configure_logging(config.mesh.log_level, f"worker[{worker_id}]")
    try:  # the settings are checked before connecting to anything
        engine = config.new_engine()
    except ValueError as exc:
        return _fail(str(exc))
    return _run_service(serve_worker(config, engine), config.mesh.event_loop)


def cmd_nats(config: NatsServerConfig) -> int:
    return asyncio.run(_nats(config))


async def _nats(config: NatsServerConfig) -> int:
    from genmesh.shared.lifecycle import stop_signals

    server = NatsServer(host=config.host, port=config.port, max_payload=config.max_payload)
    async with stop_signals() as stop:
        try:
            url = await asyncio.to_thread(server.start)
        except NatsServerError as exc:
            return _fail(str(exc))
        try:
            print(f"NATS server listening on {url} (log: {server.log_path}); Ctrl-C stops it")
            sys.stdout.flush()
            await stop.wait()
        finally:
            await asyncio.to_thread(server.stop)
    return 0


def cmd_testkit(config: TestkitConfig) -> int:
    from genmesh.shared.lifecycle import configure_logging

    configure_logging(config.log_level, f"testkit[{config.engine}]")
    return _run_service(_testkit(config), "asyncio")  # a test double, not a mesh service


async def _testkit(config: TestkitConfig) -> None:
    from genmesh.shared.lifecycle import stop_signals
    from genmesh.testkit.common import serving

    if config.engine == "sglang":
        from genmesh.testkit.sglang import build_app
    else:
        from genmesh.testkit.vllm import build_app
    app = build_app(config.server)
    async with stop_signals() as stop, serving(app, config.host, config.port) as url:
        print(f"mock {config.engine} server listening on {url}", flush=True)
        await stop.wait()


def cmd_bench(config: BenchConfig) -> int:
    from genmesh.bench.main import main_bench

    try:  # the rules between options, before anything is sent
        config.check()
    except ValueError as exc:
        print(f"genmesh bench: error: {exc} (see genmesh bench --help)", file=sys.stderr)
        return 2
    return main_bench(config)


def cmd_up(config: UpConfig) -> int:
    from genmesh.up.run import run_up

    return run_up(config)


def cmd_status(config: StatusConfig) -> int:
    from genmesh.shared.bus import NatsPermissionDenied, NatsUnreachable
    from genmesh.shared.lifecycle import configure_logging
    from genmesh.status.run import run_status

    # Its tables say what the directory's log lines would (a worker joined, expired).
    configure_logging("error", "status")
    try:
        return asyncio.run(run_status(config))
    except (NatsUnreachable, NatsAuthError, NatsPermissionDenied) as exc:
        return _fail(str(exc))


@dataclass(frozen=True, slots=True)
class RequestConfig:
    """`genmesh request`: one request over NATS, its reply frames printed."""

    mesh: MeshConnection = group(MeshConnection())
    auth: NatsAuth = nats_auth_group()
    input_ids: tuple[int, ...] | None = option(
        None, parse=token_ids, render=render_token_ids, help="prompt, e.g. 1,2,3"
    )
    envelope: str | None = option(None, help="a JSON envelope file ('-' = stdin) instead")
    max_tokens: int = option(
        16,
        parse=non_negative_int,
        help="generation budget; also an --envelope's when its sampling has no max_tokens "
        "(null there: the engine's default, up to the whole context)",
    )
    min_tokens: int = option(0, parse=non_negative_int, help="tokens before a stop may happen")
    seed: int | None = option(None, help="sampling seed")
    stop_token_ids: tuple[int, ...] | None = option(
        None, parse=token_ids, render=render_token_ids, help="e.g. 7,9"
    )
    ignore_eos: bool = option(False, help="do not stop at EOS")
    logprobs: bool = option(False, help="return output logprobs")
    top_logprobs: int = option(0, parse=non_negative_int, help="alternatives per position")
    worker: str | None = option(None, help="pin the request to this worker id")
    codec: str = option("msgpack", help="codec of the request (replies match it)")
    timeout_s: float = option(
        60.0, flag="--timeout", parse=positive_float, help="seconds of silence before giving up"
    )


def cmd_request(config: RequestConfig) -> int:
    from genmesh.client import request
    from genmesh.shared.envelope import Envelope, EnvelopeError
    from genmesh.shared.ids import new_request_id

    if config.envelope:
        try:
            if config.envelope == "-":
                text = sys.stdin.read()
            else:
                with open(config.envelope) as f:
                    text = f.read()
            obj = json.loads(text)
            if isinstance(obj, dict):
                obj.setdefault("v", 1)
                obj.setdefault("id", new_request_id())
                # Without a budget the mock writes its whole context: 32k lines.
                sampling = obj.get("sampling", {})
                if isinstance(sampling, dict):
                    obj["sampling"] = {"max_tokens": config.max_tokens, **sampling}
            envelope = Envelope.from_wire(obj)
        except (OSError, ValueError, EnvelopeError) as exc:
            return _fail(f"bad --envelope: {exc}")
        if config.worker:
            envelope.routing.worker = config.worker
    elif config.input_ids:
        envelope = request(
            list(config.input_ids),
            max_tokens=config.max_tokens,
            min_tokens=config.min_tokens,
            seed=config.seed,
            stop_token_ids=None if config.stop_token_ids is None else list(config.stop_token_ids),
            ignore_eos=config.ignore_eos,
            logprobs=config.logprobs,
            top_logprobs=config.top_logprobs,
            worker=config.worker,
        )
    else:
        return _fail("give --input-ids (e.g. --input-ids 1,2,3) or --envelope FILE")
    return asyncio.run(_request(config, envelope))


async def _request(config: RequestConfig, envelope: Envelope) -> int:
    from genmesh.client import MeshClient
    from genmesh.shared import tracing
    from genmesh.shared.bus import NatsPermissionDenied, NatsUnreachable
    from genmesh.shared.lifecycle import stop_signals

    try:  # OTEL_* variables: the request's attempts are a trace (console spans: stderr)
        tracing.configure("client", console=sys.stderr)
    except ValueError as exc:
        return _fail(str(exc))
    try:
        client = await MeshClient.connect(
            config.mesh.nats_url,
            config.mesh.namespace,
            codec=config.codec,
            idle_timeout_s=config.timeout_s,
            auth=config.auth,
        )
    except (NatsUnreachable, NatsAuthError, NatsPermissionDenied, LookupError) as exc:
        return _fail(str(exc))
    async with client, tracing.running("client"), stop_signals() as stop:
        printing = asyncio.ensure_future(_print_frames(client, envelope))
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({printing, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if printing.done():
            return printing.result()
        # Ctrl-C, SIGTERM: cancelling the generation publishes the request's cancel,
        # which the client's close flushes, so the worker stops too.
        printing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await printing
    return STOPPED_BY_SIGNAL


async def _print_frames(client: MeshClient, envelope: Envelope) -> int:
    """Print each frame as a JSON line; 0 if the request ended, 1 if it failed."""
    status = 1
    async for frame in client.generate(envelope):
        print(json.dumps(frame), flush=True)
        if frame["t"] == "end":
            status = 0
    return status

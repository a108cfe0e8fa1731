"""What each `genmesh` subcommand does (the parser lives in `genmesh.cli`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Coroutine
from typing import Any

from genmesh.formats.catalog import ConfigError
from genmesh.shared.bus import NatsAuth, NatsAuthError, NatsPermissionDenied, NatsUnreachable
from genmesh.shared.natsserver import NatsServer, NatsServerError


def _fail(message: str) -> int:
    print(f"genmesh: {message}", file=sys.stderr)
    return 2


def _run_service(coro: Coroutine[Any, Any, None]) -> int:
    try:
        asyncio.run(coro)
    except (NatsUnreachable, NatsPermissionDenied, ConfigError, NatsServerError, ValueError) as exc:
        return _fail(str(exc))
    except OSError as exc:  # e.g. the HTTP port is taken
        return _fail(f"{exc.strerror or exc}")
    return 0


def cmd_frontend(args: argparse.Namespace) -> int:
    from genmesh.services.frontend.serve import FrontendOptions, serve_frontend
    from genmesh.shared.lifecycle import configure_logging

    configure_logging(args.log_level, "frontend")
    return _run_service(
        serve_frontend(
            FrontendOptions(
                nats_url=args.nats_url,
                namespace=args.namespace,
                host=args.host,
                port=args.port,
                generate_format=args.generate_format,
                codec=args.codec,
                model=args.model,
                body_limit_mb=args.body_limit_mb,
                ack_timeout_s=args.ack_timeout,
                idle_timeout_s=args.idle_timeout,
                migration_limit=args.migration_limit,
                ping_after_s=args.ping_after,
                request_timeout_s=args.request_timeout or None,
                records=_records_config(args),
                auth=NatsAuth.from_args(args),
            )
        )
    )


def _records_config(args: argparse.Namespace) -> Any:
    from genmesh.services.frontend.records import RecordsConfig

    return RecordsConfig(
        path=args.request_trace or None,
        payload=args.request_trace_payload,
        nats=args.request_trace_nats,
        roll_mb=args.request_trace_roll_mb,
        roll_lines=args.request_trace_roll_lines,
        block_size=args.request_trace_block_size,
    )


def cmd_trace(args: argparse.Namespace) -> int:
    if args.trace_command == "check":
        from genmesh.records.check import main_check

        return main_check(args.files, expect=args.expect, as_json=args.json)
    from genmesh.records.replay import main_replay

    return main_replay(
        args.files,
        url=args.url,
        concurrency=args.concurrency,
        timeout_s=args.timeout,
        as_json=args.json,
        progress=not args.no_progress,
    )


def cmd_router(args: argparse.Namespace) -> int:
    from genmesh.services.router.serve import serve_router
    from genmesh.shared.lifecycle import configure_logging

    configure_logging(args.log_level, "router")
    return _run_service(
        serve_router(
            args.nats_url,
            args.namespace,
            args.router_policy,
            metrics_host=args.metrics_host,
            metrics_port=args.metrics_port,
            auth=NatsAuth.from_args(args),
        )
    )


def mock_config(args: argparse.Namespace) -> Any:
    from genmesh.engines.mock import MockConfig

    return MockConfig(
        model=args.mock_model,
        vocab_size=args.mock_vocab_size,
        eos_token_id=args.mock_eos_token_id,
        max_model_len=args.mock_max_model_len,
        speedup=args.mock_speedup,
    )


def cmd_worker(args: argparse.Namespace) -> int:
    from genmesh.services.worker.serve import serve_worker
    from genmesh.services.worker.service import WorkerConfig
    from genmesh.shared.ids import is_subject_token, new_worker_id
    from genmesh.shared.lifecycle import configure_logging

    worker_id = args.worker_id or new_worker_id()
    if not is_subject_token(worker_id):
        return _fail(f"--worker-id {worker_id!r} must be 1-64 characters of A-Z a-z 0-9 _ -")
    configure_logging(args.log_level, f"worker[{worker_id}]")
    from genmesh.engines import create_engine

    try:  # the settings are checked before connecting to anything
        engine = create_engine(args.engine, url=args.engine_url, mock=mock_config(args))
    except ValueError as exc:
        return _fail(str(exc))
    config = WorkerConfig(
        worker_id=worker_id,
        max_concurrency=args.max_concurrency,
        heartbeat_interval_s=args.heartbeat_interval,
        drain_timeout_s=args.drain_timeout,
    )
    return _run_service(
        serve_worker(
            args.nats_url,
            args.namespace,
            engine,
            config,
            testkit_faults=args.testkit_faults,
            metrics_host=args.metrics_host,
            metrics_port=args.metrics_port,
            auth=NatsAuth.from_args(args),
        )
    )


def cmd_nats(args: argparse.Namespace) -> int:
    return asyncio.run(_nats(args))


async def _nats(args: argparse.Namespace) -> int:
    from genmesh.shared.lifecycle import stop_signals

    server = NatsServer(host=args.host, port=args.nats_port)
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


def cmd_testkit(args: argparse.Namespace) -> int:
    from genmesh.shared.lifecycle import configure_logging
    from genmesh.testkit.common import MockServerConfig

    configure_logging(args.log_level, f"testkit[{args.engine}]")
    config = MockServerConfig(
        model=args.model,
        vocab_size=args.vocab_size,
        eos_token_id=args.eos_token_id,
        max_model_len=args.max_model_len,
        token_delay_ms=args.token_delay_ms,
        incremental=args.incremental,
        tokens_only=not args.no_tokens_only,
    )
    return _run_service(_testkit(args.engine, config, args.host, args.port))


async def _testkit(engine: str, config: Any, host: str, port: int) -> None:
    from genmesh.shared.lifecycle import stop_signals
    from genmesh.testkit import serving

    if engine == "sglang":
        from genmesh.testkit.sglang import build_app
    else:
        from genmesh.testkit.vllm import build_app
    async with stop_signals() as stop, serving(build_app(config), host, port) as url:
        print(f"mock {engine} server listening on {url}", flush=True)
        await stop.wait()


def cmd_up(args: argparse.Namespace) -> int:
    from genmesh.up import run_up

    return run_up(args)


def cmd_request(args: argparse.Namespace) -> int:
    from genmesh.client import request
    from genmesh.shared.envelope import Envelope, EnvelopeError
    from genmesh.shared.ids import new_request_id

    if args.envelope:
        try:
            if args.envelope == "-":
                text = sys.stdin.read()
            else:
                with open(args.envelope) as f:
                    text = f.read()
            obj = json.loads(text)
            if isinstance(obj, dict):
                obj.setdefault("v", 1)
                obj.setdefault("id", new_request_id())
            envelope = Envelope.from_wire(obj)
        except (OSError, ValueError, EnvelopeError) as exc:
            return _fail(f"bad --envelope: {exc}")
        if args.worker:
            envelope.routing.worker = args.worker
    elif args.input_ids:
        envelope = request(
            args.input_ids,
            max_tokens=args.max_tokens,
            min_tokens=args.min_tokens,
            seed=args.seed,
            stop_token_ids=args.stop_token_ids,
            ignore_eos=args.ignore_eos,
            logprobs=args.logprobs,
            top_logprobs=args.top_logprobs,
            worker=args.worker,
        )
    else:
        return _fail("give --input-ids (e.g. --input-ids 1,2,3) or --envelope FILE")
    return asyncio.run(_request(args, envelope))


async def _request(args: argparse.Namespace, envelope: Any) -> int:
    from genmesh.client import MeshClient
    from genmesh.shared import tracing

    try:  # OTEL_* variables: the request's attempts are a trace (console spans: stderr)
        tracing.configure("client", console=sys.stderr)
    except ValueError as exc:
        return _fail(str(exc))
    try:
        client = await MeshClient.connect(
            args.nats_url,
            args.namespace,
            codec=args.codec,
            idle_timeout_s=args.timeout,
            auth=NatsAuth.from_args(args),
        )
    except (NatsUnreachable, NatsAuthError, NatsPermissionDenied, LookupError) as exc:
        return _fail(str(exc))
    status = 1
    async with client, tracing.running("client"):
        async for frame in client.generate(envelope):
            print(json.dumps(frame), flush=True)
            if frame["t"] == "end":
                status = 0
    return status

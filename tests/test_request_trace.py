"""Request trace records: the observer, the sinks, `genmesh trace check|replay`, and a real
mesh with cancellations and migrations (docs/observability.md, "Request records")."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
import subprocess
import sys
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import nats
import orjson
import pytest
from aiohttp.test_utils import TestServer

from genmesh.cli import main as cli_main
from genmesh.client import MigrationReason
from genmesh.formats.catalog import load_generate_formats
from genmesh.records import SCHEMA
from genmesh.records.check import check, read_records
from genmesh.records.config import RecordsConfig, config_from_env
from genmesh.records.hashing import block_hashes, int32le, output_hash
from genmesh.records.replay import outputs, replay
from genmesh.records.sinks import FileSink, NatsSink, Record, Sink, dump, segment_paths
from genmesh.services.frontend.app import build_app
from genmesh.services.frontend.records import RequestRecords
from genmesh.services.frontend.state import FrontendState
from genmesh.shared.bus import flush_in_order
from genmesh.shared.engine_info import NO_ENGINES, EngineCatalog
from genmesh.shared.envelope import Envelope
from genmesh.shared.frames import Frame
from genmesh.shared.subjects import Subjects
from tests.conftest import unique_namespace
from tests.mesh import Mesh

pytestmark = pytest.mark.unit

# --------------------------------------------------------------------------- hashing


def test_hashes_are_blake2b_of_little_endian_int32() -> None:
    assert int32le([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    # Fixed values: a change here makes every recorded trace unreadable.
    assert output_hash([]) == hashlib.blake2b(b"", digest_size=8).hexdigest() == "e4a6a0577479b2b4"
    assert output_hash([1, 2, 3]) == "d69c56745f6a3d9e"
    first = hashlib.blake2b(int32le([0, 1, 2, 3]), digest_size=8)
    assert block_hashes(list(range(10)), 4) == [
        first.hexdigest(),
        hashlib.blake2b(first.digest() + int32le([4, 5, 6, 7]), digest_size=8).hexdigest(),
        "059dfa08b11ef9f5",
    ]


def test_block_hashes_chain_and_cover_a_short_last_block() -> None:
    prompt = list(range(10))
    hashes = block_hashes(prompt, 4)
    assert len(hashes) == 3  # 4 + 4 + 2
    # Each hash names its whole prefix: same prefix, same hashes; a change shows from there on.
    assert block_hashes(prompt[:8], 4) == hashes[:2]
    changed = block_hashes([0, 1, 2, 3, 4, 99, 6, 7, 8, 9], 4)
    assert changed[0] == hashes[0]
    assert changed[1] != hashes[1]
    assert changed[2] != hashes[2]
    # Chained: equal blocks at different positions hash differently.
    assert len(set(block_hashes([5] * 8, 4))) == 2
    assert block_hashes([], 4) == []


# --------------------------------------------------------------------------- observer


class MemorySink(Sink):
    name = "memory"

    def __init__(self) -> None:
        super().__init__(flush_interval_s=0.01)
        self.emitted: list[Record] = []
        self.written_records: list[Record] = []

    def emit(self, record: bytes) -> None:
        self.emitted.append(orjson.loads(record))
        super().emit(record)

    async def _write(self, batch: list[bytes]) -> int:
        self.written_records.extend(map(orjson.loads, batch))
        return len(batch)


def out(tokens: list[int], **extra: Any) -> Frame:
    return {"t": "out", "seq": 1, "tokens": tokens, **extra}


def end(tokens: list[int], prompt: int, completion: int, cached: int = 0) -> Frame:
    return {
        "t": "end",
        "seq": 9,
        "tokens": tokens,
        "finish": {"reason": "length"},
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "cached_tokens": cached,
        },
    }


def ack(worker: str) -> Frame:
    return {"t": "ack", "seq": 0, "worker": worker, "dispatch": "d" * 32}


HANG = {"t": "hang"}
# Scripts by the prompt's first token.
SCRIPTS: dict[int, list[Frame]] = {
    1: [ack("w1"), out([5, 6], cached_tokens=0), end([7], 3, 3)],
    2: [
        ack("w1"),
        out([5, 6], cached_tokens=0),
        {
            "t": "mig",
            "attempt": 2,
            "reason": MigrationReason.RETRYABLE_ERROR,
            "message": "the engine connection dropped",
            "from_worker": "w1",
            "delivered": 2,
        },
        ack("w2"),
        out([7], cached_tokens=5),
        end([8], 5, 2, cached=5),
    ],
    3: [
        ack("w1"),
        out([5]),
        {
            "t": "err",
            "seq": 2,
            "code": "internal",
            "message": "engine exploded",
            "retryable": False,
        },
    ],
    4: [ack("w1"), out([5]), HANG],
    5: [
        {"t": "err", "seq": 0, "code": "overloaded", "message": "full", "retryable": True},
    ],
}


class ScriptedBackend:
    def __init__(self) -> None:
        self.hanging = 0

    async def generate(
        self, envelope: Envelope, *, no_migration: str | None = None
    ) -> AsyncGenerator[Frame, None]:
        for step in SCRIPTS[envelope.token_ids[0]]:
            await asyncio.sleep(0)
            if step is HANG:
                self.hanging += 1
                await asyncio.Event().wait()
            yield {**step, "id": envelope.id}

    def not_ready_reason(self) -> str | None:
        return None

    async def ready(self, limit_s: float | None) -> str | None:
        return None

    def workers(self) -> list[dict[str, Any]]:
        return [{"id": "w1"}]

    def engines(self) -> EngineCatalog:
        return NO_ENGINES

    async def close(self) -> None:
        pass


@pytest.fixture
async def frontend() -> AsyncIterator[tuple[str, MemorySink, ScriptedBackend]]:
    sink = MemorySink()
    records = RequestRecords([sink], payload=True, block_size=2, namespace="unit")
    await records.start()
    backend = ScriptedBackend()
    state = FrontendState(backend, "unit", "m", 0.0, observers=[records])
    app = build_app(state, load_generate_formats("sglang"), body_limit_bytes=1 << 20)
    server = TestServer(app, handler_cancellation=True)
    await server.start_server()
    try:
        yield str(server.make_url("")), sink, backend
    finally:
        await server.close()
        await records.close()
        assert sink.written_records == sink.emitted  # close wrote everything


async def post_json(url: str, body: Any, headers: dict[str, str] | None = None) -> int:
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, json=body, headers=headers) as resp,
    ):
        await resp.read()
        return resp.status


async def test_a_successful_request_gives_one_full_record(
    frontend: tuple[str, MemorySink, ScriptedBackend],
) -> None:
    url, sink, _ = frontend
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3}, "rid": "mine"}
    assert await post_json(url + "/generate", body, {"X-Request-Timeout": "30"}) == 200
    [record] = sink.emitted
    assert record["schema"] == SCHEMA
    assert record["format"] == "sglang"
    assert (record["method"], record["endpoint"], record["stream"]) == ("POST", "/generate", False)
    assert (record["status"], record["error_type"]) == (200, None)
    assert record["client_id"] == record["public_id"] == "mine"
    assert record["namespace"] == "unit"
    assert record["hashing"] == {"algorithm": "blake2b-64/int32le", "block_size": 2}
    timings = record["timings"]
    assert 0 <= timings["first_token_ms"] <= timings["end_ms"]
    assert isinstance(timings["received_unix_ms"], int)
    [item] = record["items"]
    assert len(item["private_id"]) == 32
    assert item["private_id"] != "mine"
    assert item["client_id"] == "mine"
    assert item["prompt_tokens"] == 3
    assert item["prompt_block_hashes"] == block_hashes([1, 2, 3], 2)
    assert item["attempts"] == [
        {
            "attempt": 1,
            "private_id": item["private_id"],
            "worker": "w1",
            "dispatch": "d" * 32,
            "output_tokens": 3,
        }
    ]
    assert item["workers"] == ["w1"]
    assert (item["output_tokens"], item["output_hash"]) == (3, output_hash([5, 6, 7]))
    assert (item["finish_reason"], item["error_type"], item["cached_tokens"]) == ("length", None, 0)
    assert record["totals"] == {
        "items": 1,
        "input_tokens": 3,
        "output_tokens": 3,
        "cached_tokens": 0,
        "attempts": 1,
        "migrations": 0,
    }
    payload = record["payload"]
    assert json.loads(payload["body"]) == body
    assert payload["headers"] == {
        "content-type": "application/json",
        "x-request-timeout": "30",
    }
    assert payload["items"] == [{"prompt_token_ids": [1, 2, 3], "output_token_ids": [5, 6, 7]}]


async def test_a_migrated_request_records_both_attempts(
    frontend: tuple[str, MemorySink, ScriptedBackend],
) -> None:
    url, sink, _ = frontend
    body = {"input_ids": [2, 2, 2, 2, 2], "sampling_params": {"max_new_tokens": 4}, "stream": True}
    assert await post_json(url + "/generate", body) == 200
    [record] = sink.emitted
    [item] = record["items"]
    assert item["workers"] == ["w1", "w2"]
    first, second = item["attempts"]
    assert first["migration_reason"] == "the engine connection dropped"
    assert (first["worker"], first["output_tokens"]) == ("w1", 2)
    assert (second["attempt"], second["worker"], second["output_tokens"]) == (2, "w2", 2)
    assert second["private_id"] == item["private_id"] + "~2"
    assert "migration_reason" not in second
    assert item["output_hash"] == output_hash([5, 6, 7, 8])
    assert item["cached_tokens"] == 0  # the first attempt's, not the continuation's
    assert record["totals"]["migrations"] == 1
    assert record["stream"] is True


async def test_a_validation_error_is_recorded_without_items(
    frontend: tuple[str, MemorySink, ScriptedBackend],
) -> None:
    url, sink, _ = frontend
    assert await post_json(url + "/generate", {"input_ids": "nope"}) == 400
    [record] = sink.emitted
    assert (record["status"], record["error_type"], record["items"]) == (
        400,
        "invalid_argument",
        [],
    )
    assert record["public_id"] is None
    assert record["timings"]["first_token_ms"] is None
    assert record["payload"]["items"] == []
    assert json.loads(record["payload"]["body"]) == {"input_ids": "nope"}


async def test_errors_before_and_after_the_first_byte(
    frontend: tuple[str, MemorySink, ScriptedBackend],
) -> None:
    url, sink, _ = frontend
    # Unary: an error before any output answers with its status.
    assert await post_json(url + "/generate", {"input_ids": [5, 1]}) == 503
    # SSE: after a token the error is in-band, under a 200.
    assert await post_json(url + "/generate", {"input_ids": [3, 1], "stream": True}) == 200
    refused, in_band = sink.emitted
    assert (refused["status"], refused["error_type"]) == (503, "overloaded")
    assert refused["items"][0]["error_type"] == "overloaded"
    assert refused["items"][0]["workers"] == []
    assert (in_band["status"], in_band["error_type"]) == (200, "internal")
    [item] = in_band["items"]
    assert (item["finish_reason"], item["error_type"]) == (None, "internal")
    assert item["error_message"] == "engine exploded"
    assert item["output_tokens"] == 1


async def test_a_batch_with_one_failed_item_cancels_and_records_the_others(
    frontend: tuple[str, MemorySink, ScriptedBackend],
) -> None:
    url, sink, _ = frontend
    body = {"input_ids": [[1, 9], [3, 9], [4, 9]], "rid": ["a", "b", "c"]}
    assert await post_json(url + "/generate", body) == 500
    [record] = sink.emitted
    assert record["error_type"] == "internal"
    states = [(i["client_id"], i["finish_reason"], i["error_type"]) for i in record["items"]]
    # Item a may or may not have ended before b failed; c was hanging and is cancelled.
    assert states[1] == ("b", None, "internal")
    assert states[2] == ("c", None, "cancelled")
    assert states[0][0] == "a"
    assert len({i["private_id"] for i in record["items"]}) == 3
    assert record["totals"]["items"] == 3


async def test_a_client_that_goes_away_gets_one_cancelled_record(
    frontend: tuple[str, MemorySink, ScriptedBackend],
) -> None:
    url, sink, backend = frontend
    async with aiohttp.ClientSession() as session:
        resp = await session.post(url + "/generate", json={"input_ids": [4, 4], "stream": True})
        assert resp.status == 200
        await resp.content.readuntil(b"\n\n")  # the first token
        resp.close()  # the client disconnects
    for _ in range(200):
        if sink.emitted:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    [record] = sink.emitted
    assert (record["status"], record["error_type"]) == (499, "cancelled")
    [item] = record["items"]
    assert (item["finish_reason"], item["error_type"], item["output_tokens"]) == (
        None,
        "cancelled",
        1,
    )
    assert backend.hanging == 1


async def test_records_without_payload_hold_no_prompt() -> None:
    sink = MemorySink()
    records = RequestRecords([sink])
    await records.start()
    backend = ScriptedBackend()
    state = FrontendState(backend, "unit", "m", 0.0, observers=[records])
    app = build_app(state, load_generate_formats("sglang"), body_limit_bytes=1 << 20)
    async with TestServer(app) as server:
        assert await post_json(str(server.make_url("/generate")), {"input_ids": [1, 7777]}) == 200
    await records.close()
    [record] = sink.written_records
    assert "payload" not in record
    assert 7777 not in ints_in(record)
    assert 7 not in ints_in(record)  # an output token


def ints_in(value: Any) -> set[int]:
    if isinstance(value, dict):
        return set().union(*map(ints_in, value.values()))
    if isinstance(value, list):
        return set().union(*map(ints_in, value))
    return {value} if isinstance(value, int) and not isinstance(value, bool) else set()


def test_config_from_the_environment() -> None:
    config = config_from_env(
        {
            "GENMESH_REQUEST_TRACE": "/tmp/t.jsonl.gz",
            "GENMESH_REQUEST_TRACE_PAYLOAD": "1",
            "GENMESH_REQUEST_TRACE_NATS": "true",
            "GENMESH_REQUEST_TRACE_ROLL_MB": "1.5",
            "GENMESH_REQUEST_TRACE_ROLL_LINES": "100",
        }
    )
    assert config == RecordsConfig("/tmp/t.jsonl.gz", True, True, 1.5, 100, 64)
    assert not config_from_env({}).enabled


def test_the_frontend_options_read_the_same_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    from genmesh.cli import parse_command

    monkeypatch.setenv("GENMESH_REQUEST_TRACE", "x.jsonl")
    monkeypatch.setenv("GENMESH_REQUEST_TRACE_PAYLOAD", "1")
    monkeypatch.setenv("GENMESH_REQUEST_TRACE_ROLL_LINES", "7")
    _, config = parse_command(["frontend"])
    assert config.records == RecordsConfig("x.jsonl", True, False, 256.0, 7, 64)


# --------------------------------------------------------------------------- sinks


def record_n(n: int) -> bytes:
    return dump({"record_id": f"r{n}", "n": n, "pad": "x" * 50})


async def test_gz_sink_rolls_segments_and_numbers_on(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl.gz"
    sink = FileSink(path, roll_lines=3, flush_interval_s=0.01)
    await sink.start()
    for n in range(10):
        sink.emit(record_n(n))
        if n == 4:
            await asyncio.sleep(0.05)  # two batches
    await sink.close()
    segments = segment_paths(str(tmp_path / "trace"))
    assert [p.name for p in segments] == [f"trace.{i}.jsonl.gz" for i in range(4)]
    lines = [gzip.decompress(p.read_bytes()).count(b"\n") for p in segments]
    assert lines == [3, 3, 3, 1]
    assert not path.exists()
    # A restart continues after the last segment instead of overwriting it.
    again = FileSink(path, roll_bytes=200, flush_interval_s=0.01)
    await again.start()
    for n in range(10, 14):
        again.emit(record_n(n))
    await again.close()
    segments = segment_paths(str(tmp_path / "trace"))
    assert segments[4].name == "trace.4.jsonl.gz"
    assert len(segments) == 6  # 200 bytes hold two records of ~75
    got = [r["n"] for _, r in read_records([path])]  # the stem stands for its segments
    assert got == list(range(14))
    assert (sink.written, sink.dropped, again.written) == (10, 0, 4)


async def test_plain_sink_appends_and_close_flushes(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    for start in (0, 3):
        sink = FileSink(path, flush_interval_s=60)  # only close() can have written these
        await sink.start()
        for n in range(start, start + 3):
            sink.emit(record_n(n))
        await sink.close()
    assert [json.loads(line)["n"] for line in path.read_text().splitlines()] == list(range(6))
    sink.emit(record_n(99))  # after close: dropped, not lost silently
    assert sink.dropped == 1


async def test_a_gz_segment_is_readable_before_close(tmp_path: Path) -> None:
    sink = FileSink(tmp_path / "live.jsonl.gz", flush_interval_s=0.01)
    await sink.start()
    sink.emit(record_n(1))
    await asyncio.sleep(0.1)
    problems: list[str] = []
    got = [r for _, r in read_records([tmp_path / "live.0.jsonl.gz"], problems)]
    assert got == [orjson.loads(record_n(1))]
    assert len(problems) == 1
    assert "not closed cleanly" in problems[0]
    await sink.close()


async def test_a_bad_path_fails_at_start(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no directory"):
        await FileSink(tmp_path / "missing" / "t.jsonl.gz").start()
    with pytest.raises(FileNotFoundError, match="No such file"):
        await FileSink(tmp_path / "missing" / "t.jsonl").start()


@pytest.mark.inproc
async def test_nats_sink_publishes_every_record(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    got: list[Any] = []
    sub = await nc.subscribe("genmesh.unit.trace", cb=collector(got))
    sink = NatsSink(nc, "genmesh.unit.trace")
    await sink.start()
    for n in range(5):
        sink.emit(record_n(n))
    await sink.close()
    await flush_in_order(nc)
    for _ in range(100):
        if len(got) == 5:
            break
        await asyncio.sleep(0.01)
    await sub.unsubscribe()
    await nc.close()
    assert [json.loads(d)["n"] for d in got] == list(range(5))


def collector(into: list[Any]) -> Any:
    async def collect(msg: Any) -> None:
        into.append(msg.data)

    return collect


# --------------------------------------------------------------------------- check


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    return path


@pytest.fixture
async def recorded(frontend: tuple[str, MemorySink, ScriptedBackend]) -> list[Record]:
    url, sink, _ = frontend
    for body in (
        {"input_ids": [1, 2, 3, 4, 5]},
        {"input_ids": [2, 1], "stream": True},
        {"input_ids": [[1, 1], [1, 2]], "sampling_params": {"n": 2}},
        {"input_ids": "bad"},
        {"input_ids": [3, 1], "stream": True},
    ):
        await post_json(url + "/generate", body)
    return [orjson.loads(orjson.dumps(r)) for r in sink.emitted]


async def test_check_accepts_good_records(recorded: list[Record], tmp_path: Path) -> None:
    summary = check([write_jsonl(tmp_path / "t.jsonl", recorded)], expect=5)
    assert summary.problems == []
    assert summary.records == 5
    assert summary.items == 1 + 1 + 4 + 0 + 1
    assert summary.by_status == {"200": 4, "400": 1}
    assert summary.by_error_type == {"ok": 3, "invalid_argument": 1, "internal": 1}
    assert summary.migrations == 1
    assert summary.payload_records == 5


@pytest.mark.parametrize(
    ("tamper", "expected"),
    [
        (lambda rs: rs.append(rs[0]), "duplicate record_id"),
        (lambda rs: rs[1].update(record_id="other"), None),
        (lambda rs: rs[0]["items"][0].update(output_hash="0" * 16), "output hash does not match"),
        (
            lambda rs: rs[0]["payload"]["items"][0]["prompt_token_ids"].__setitem__(0, 9),
            "prompt block hashes do not match",
        ),
        (lambda rs: rs[0]["totals"].update(output_tokens=99), "do not add up"),
        (lambda rs: rs[0].pop("status"), "missing fields: status"),
        (lambda rs: rs[0].update(schema="x"), "invalid fields: schema"),
        (
            lambda rs: rs[2]["items"][1].update(private_id=rs[0]["items"][0]["private_id"]),
            "duplicate private_id",
        ),
        (lambda rs: rs[1]["items"][0]["attempts"][0].pop("migration_reason"), "without a reason"),
        (lambda rs: rs[0]["items"][0].update(finish_reason=None), "exactly one of"),
    ],
)
async def test_check_finds_what_is_wrong(
    recorded: list[Record], tmp_path: Path, tamper: Any, expected: str | None
) -> None:
    tamper(recorded)
    summary = check([write_jsonl(tmp_path / "t.jsonl", recorded)])
    if expected is None:
        assert summary.ok
    else:
        assert any(expected in p for p in summary.problems), summary.problems


async def test_check_cli_counts_and_exit_codes(
    recorded: list[Record], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", recorded)
    assert cli_main(["trace", "check", str(path), "--expect", "5"]) == 0
    out = capsys.readouterr().out
    assert "5 records" in out
    assert "by status:     200 4, 400 1" in out
    assert out.rstrip().endswith("OK")
    assert cli_main(["trace", "check", str(path), "--expect", "6"]) == 1
    assert "expected 6 records, found 5" in capsys.readouterr().out
    with path.open("ab") as f:
        f.write(b"{not json\n")
    assert cli_main(["trace", "check", str(path), "--json"]) == 1
    assert "not JSON" in json.loads(capsys.readouterr().out)["problems"][0]
    assert cli_main(["trace", "check", str(tmp_path / "none.jsonl.gz")]) == 1


async def test_replay_matches_and_reports_mismatches(
    frontend: tuple[str, MemorySink, ScriptedBackend],
    recorded: list[Record],
    tmp_path: Path,
) -> None:
    url, sink, _ = frontend
    path = write_jsonl(tmp_path / "t.jsonl", recorded)
    summary = await replay([path], url, concurrency=2, progress=False)
    assert summary.ok, (summary.mismatches, summary.errors)
    # Success, migration, batch: same outputs; 400: refused alike; in-band error: again.
    assert dict(summary.counts) == {"match": 3, "same_status": 1, "prefix": 1}
    assert len(sink.emitted) == 10  # replayed requests are recorded like any other
    recorded[0]["items"][0]["output_hash"] = "0" * 16
    del recorded[1]["payload"]
    summary = await replay([write_jsonl(path, recorded)], url, progress=False)
    assert not summary.ok
    assert summary.counts["skipped"] == 1
    [mismatch] = summary.mismatches
    assert mismatch.startswith(recorded[0]["record_id"])
    assert "output hash" in mismatch


def test_replay_reads_both_formats_outputs() -> None:
    assert outputs("sglang", False, b'{"output_ids": [1, 2]}') == {0: [1, 2]}
    assert outputs("sglang", False, b'[{"output_ids": [1]}, {"output_ids": [2]}]') == {
        0: [1],
        1: [2],
    }
    sse = b'data: {"output_ids": [1], "index": 1}\n\ndata: {"output_ids": [2], "index": 1}\n\n'
    assert outputs("sglang", True, sse + b"data: [DONE]\n\n") == {1: [1, 2]}
    vllm = b'{"choices": [{"index": 0, "token_ids": [3]}, {"index": 1, "token_ids": [4]}]}'
    assert outputs("vllm", False, vllm) == {0: [3], 1: [4]}
    chunks = (
        b'data: {"choices": [{"index": 0, "token_ids": [3]}]}\n\n'
        b'data: {"choices": [{"index": 0, "token_ids": [5]}]}\n\n'
        b'data: {"choices": [], "usage": {}}\n\ndata: [DONE]\n\n'
    )
    assert outputs("vllm", True, chunks) == {0: [3, 5]}
    pytest.importorskip("genmesh_b64zstd")
    assert outputs("sglang+b64zstd", False, b'{"output_ids": "KLUv/SAEIQAABA8BAA=="}') == {
        0: [69380]
    }


# --------------------------------------------------------------------------- a real mesh


@pytest.fixture
def trace_mesh(nats_url: str, tmp_path: Path) -> Iterator[Mesh]:
    """Three mock workers that take injected faults; the frontend is added by the test."""
    mesh = Mesh(nats_url, tmp_path, unique_namespace("trace"))
    try:
        mesh.add_router()
        for _ in range(3):
            mesh.add_worker(speedup=1.0, vocab_size=1000, eos_token_id=7, testkit_faults=True)
        yield mesh
    finally:
        mesh.stop()


async def genmesh_cli(args: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """`python -m genmesh ARGS` in a thread (the test's loop keeps running)."""
    return await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "genmesh", *args], **kwargs
    )


async def fault_control(nc: Any, namespace: str, worker: str, body: Any) -> Any:
    reply = await nc.request(Subjects(namespace).testkit(worker), json.dumps(body).encode(), 5)
    return json.loads(reply.data)


async def send(session: aiohttp.ClientSession, url: str, kind: str, n: int) -> str:
    """One request of `kind`; returns what happened."""
    prompt = [100 + n, 200 + n % 7, 300, 400 + n % 3, *range(1, 1 + n % 70)]
    params = {"max_new_tokens": 12 + n % 9, "ignore_eos": True}
    if kind == "cancel":
        async with session.post(
            url + "/generate",
            json={
                "input_ids": prompt,
                "sampling_params": {**params, "max_new_tokens": 64},
                "stream": True,
            },
        ) as resp:
            assert resp.status == 200
            for _ in range(4):  # past the 2 tokens a faulty worker delivers before dropping
                await resp.content.readuntil(b"\n\n")
        return "cancel"  # leaving the block closes the connection mid-stream
    if kind == "invalid":
        body: Any = {"input_ids": prompt, "sampling_params": {"max_new_tokens": -1}}
    elif kind == "batch":
        body = {"input_ids": [prompt, prompt[:3]], "sampling_params": {**params, "n": 2}}
    elif kind == "vllm":
        vllm_body = {
            "token_ids": prompt,
            "sampling_params": {"max_tokens": 10},
            "stream": n % 2 == 0,
        }
        async with session.post(url + "/inference/v1/generate", json=vllm_body) as resp:
            await resp.read()
            assert resp.status == 200
        return kind
    else:
        body = {"input_ids": prompt, "sampling_params": params, "stream": kind == "stream"}
    async with session.post(url + "/generate", json=body) as resp:
        await resp.read()
        assert resp.status == (400 if kind == "invalid" else 200), kind
    return kind


KINDS = ["unary"] * 6 + ["stream"] * 4 + ["cancel"] * 3 + ["batch", "invalid", "vllm"]


@pytest.mark.process
async def test_a_real_mesh_records_every_request_exactly_once(
    trace_mesh: Mesh, nats_url: str, tmp_path: Path
) -> None:
    mesh = trace_mesh
    path = tmp_path / "records" / "trace.jsonl.gz"
    path.parent.mkdir()
    frontend = mesh.add_frontend(
        env={
            "GENMESH_REQUEST_TRACE": str(path),
            "GENMESH_REQUEST_TRACE_PAYLOAD": "1",
            "GENMESH_REQUEST_TRACE_NATS": "1",
            "GENMESH_REQUEST_TRACE_ROLL_LINES": "25",
        }
    )
    workers = sorted(s.name for s in mesh.workers)
    mesh.wait_for_workers(lambda ids: set(workers) <= ids, what="the workers")
    faulty = workers[0]
    nc = await nats.connect(nats_url)
    published: list[Any] = []
    await nc.subscribe(f"genmesh.{mesh.namespace}.trace", cb=collector(published))
    drops = 12
    await fault_control(
        nc, mesh.namespace, faulty, {"kind": "drop", "after_tokens": 2, "count": drops}
    )
    total = 96
    kinds = [KINDS[n % len(KINDS)] for n in range(total)]
    semaphore = asyncio.Semaphore(8)

    async def one(session: aiohttp.ClientSession, n: int) -> str:
        async with semaphore:
            return await send(session, mesh.http_url, kinds[n], n)

    async with aiohttp.ClientSession() as session:
        done = await asyncio.gather(*(one(session, n) for n in range(total)))
    assert len(done) == total
    state = await fault_control(nc, mesh.namespace, faulty, {})
    left = state["faults_pending"][0]["count"] if state["faults_pending"] else 0
    consumed = drops - left
    assert consumed > 0

    assert frontend.terminate() == 0  # SIGTERM: the sinks flush and close
    await flush_in_order(nc)
    await asyncio.sleep(0.2)
    result = await genmesh_cli(
        [
            "trace",
            "check",
            str(path),
            "--expect",
            str(total),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    summary = json.loads(result.stdout)
    assert result.returncode == 0, summary["problems"][:5]
    assert len(segment_paths(str(tmp_path / "records" / "trace"))) == 4  # 25 a segment
    cancels = kinds.count("cancel")
    assert summary["by_error_type"] == {
        "ok": total - cancels - kinds.count("invalid"),
        "cancelled": cancels,
        "invalid_argument": kinds.count("invalid"),
    }
    assert summary["by_status"]["499"] == cancels
    records = [r for _, r in read_records([path])]
    # Each consumed fault moved one request from the faulty worker to another.
    moved = [
        a
        for r in records
        for item in r["items"]
        for a in item["attempts"]
        if a.get("migration_reason")
    ]
    assert len(moved) == consumed == summary["migrations"]
    assert all(a["worker"] == faulty and a["output_tokens"] == 2 for a in moved)
    # The NATS sink delivered the same records.
    assert sorted(orjson.loads(d)["record_id"] for d in published) == sorted(
        r["record_id"] for r in records
    )
    await nc.close()

    # Replay against a fresh frontend (no records): deterministic engine, same outputs.
    mesh.add_frontend()
    result = await genmesh_cli(
        [
            "trace",
            "replay",
            str(path),
            "--url",
            mesh.http_url,
            "--json",
            "--concurrency",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    replayed = json.loads(result.stdout)
    assert result.returncode == 0, (replayed["mismatches"][:5], replayed["errors"][:5])
    assert replayed["mismatch"] == replayed["error"] == 0
    assert replayed["prefix"] == cancels
    assert replayed["same_status"] == kinds.count("invalid")
    assert replayed["match"] == total - cancels - kinds.count("invalid")
    assert "replay [" in result.stderr  # the progress bar


@pytest.mark.process
async def test_a_bad_trace_path_stops_the_frontend(trace_mesh: Mesh, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="frontend died"):
        trace_mesh.add_frontend(env={"GENMESH_REQUEST_TRACE": str(tmp_path / "no" / "t.jsonl")})
    assert "No such file or directory" in trace_mesh.services[-1].log()

"""What a directory believes of discovery messages (`shared/cards.py`), and what it does
with the rest (`shared/discovery.py`): refused with a reason, one throttled log line,
never an exception. tests/test_discovery_forged.py publishes forged cards on real NATS."""

from __future__ import annotations

import logging
import math
from typing import Any, cast

import pytest

from genmesh.codecs import get_codec
from genmesh.services.worker.config import WorkerConfig
from genmesh.shared.cards import card_fault, presence_fault
from genmesh.shared.discovery import WorkerDirectory
from genmesh.shared.settings import parse
from genmesh.shared.subjects import Subjects
from genmesh.shared.throttled_log import ThrottledLog

pytestmark = pytest.mark.unit

GOOD: dict[str, Any] = {
    "v": 1,
    "id": "w1",
    "subject": "genmesh.ns.worker.w1.generate",
    "inflight": 3,
    "capacity": 8,
    "heartbeat_s": 0.5,
    "role": "both",
}
DECODE = {**GOOD, "role": "decode", "disagg": {"kind": "mock", "local_prefill": True}}

ID = "id is not a subject token (1-64 of A-Z a-z 0-9 _ -)"
HEARTBEAT = "heartbeat_s is not in (0, 3600]"
BAD_CARDS: list[tuple[dict[str, Any], str]] = [
    ({**GOOD, "id": ""}, ID),
    ({**GOOD, "id": "a b"}, ID),
    ({**GOOD, "id": "w.1"}, ID),
    ({**GOOD, "id": "w1\n"}, ID),  # a regex's `$` let it through
    ({**GOOD, "id": "wé"}, ID),
    ({**GOOD, "id": "w" * 65}, ID),
    ({**GOOD, "id": 7}, ID),
    ({**GOOD, "inflight": -1}, "inflight is not an int in [0, 2^53)"),
    ({**GOOD, "inflight": 2**53}, "inflight is not an int in [0, 2^53)"),
    ({**GOOD, "inflight": 1.0}, "inflight is not an int in [0, 2^53)"),
    ({**GOOD, "inflight": True}, "inflight is not an int in [0, 2^53)"),
    ({**GOOD, "capacity": 0}, "capacity is not an int in [1, 2^53)"),
    ({**GOOD, "capacity": 10**400}, "capacity is not an int in [1, 2^53)"),
    ({**GOOD, "capacity": "8"}, "capacity is not an int in [1, 2^53)"),
    ({**GOOD, "heartbeat_s": math.nan}, HEARTBEAT),
    ({**GOOD, "heartbeat_s": math.inf}, HEARTBEAT),
    ({**GOOD, "heartbeat_s": 0}, HEARTBEAT),
    ({**GOOD, "heartbeat_s": -1.0}, HEARTBEAT),
    ({**GOOD, "heartbeat_s": 3600.5}, HEARTBEAT),
    ({**GOOD, "heartbeat_s": 10**400}, HEARTBEAT),
    ({**GOOD, "heartbeat_s": False}, "heartbeat_s is not a number"),
    ({**GOOD, "heartbeat_s": None}, "heartbeat_s is not a number"),
    ({**GOOD, "role": "leader"}, "role is not one of both, prefill, decode"),
    ({**GOOD, "role": None}, "role is not one of both, prefill, decode"),
    ({**GOOD, "role": ["both"]}, "role is not one of both, prefill, decode"),
    ({**GOOD, "disagg": [1]}, "disagg is not a map"),
    ({**GOOD, "role": "prefill"}, "disagg is not a map"),
    ({**DECODE, "disagg": {"local_prefill": True}}, "disagg.kind is not a string"),
    ({**DECODE, "disagg": {"kind": ["mock"]}}, "disagg.kind is not a string"),
    (
        {**DECODE, "disagg": {"kind": "mock", "local_prefill": 1}},
        "disagg.local_prefill is not a bool",
    ),
]


@pytest.mark.parametrize(("card", "why"), BAD_CARDS)
def test_a_bad_card_is_refused_with_its_reason(card: dict[str, Any], why: str) -> None:
    assert card_fault(card) == why


@pytest.mark.parametrize(
    "card",
    [
        GOOD,
        DECODE,
        {"id": "w1"},  # every checked field has its default (§9.1)
        {**GOOD, "heartbeat_s": 3600, "capacity": 2**53 - 1, "inflight": 0},
        {**GOOD, "subject": "a b"},  # informational: never read
        {**GOOD, "disagg": {"kind": None}},  # a `both` worker's own business
        {**DECODE, "role": "prefill", "disagg": {"kind": "sglang", "bootstrap_port": 8998}},
    ],
)
def test_a_good_card_is_believed(card: dict[str, Any]) -> None:
    assert card_fault(card) is None


@pytest.mark.parametrize(
    ("presence", "why"),
    [
        ({"id": "a b"}, ID),
        ({"id": "r1\r\n"}, ID),
        ({"id": "", "leaving": True}, ID),
        ({"id": "r1", "heartbeat_s": math.nan}, HEARTBEAT),
        ({"id": "r1", "heartbeat_s": 1e300}, HEARTBEAT),
        ({"id": "r1", "heartbeat_s": "1"}, "heartbeat_s is not a number"),
        ({"id": "r1", "heartbeat_s": -1, "leaving": "yes"}, HEARTBEAT),
        ({"id": "r1"}, None),
        ({"id": "r1", "heartbeat_s": 1.0, "policy": "kv", "leaving": False}, None),
        ({"id": "r1", "heartbeat_s": "any", "leaving": True}, None),
    ],
)
def test_router_presence_needs_a_router_id_and_an_interval(
    presence: dict[str, Any], why: str | None
) -> None:
    assert presence_fault(presence) == why


def directory() -> WorkerDirectory:
    return WorkerDirectory(cast(Any, None), Subjects("ns"))  # never started: no NATS


def test_the_directory_derives_the_subject_and_keeps_the_last_good_card() -> None:
    found = directory()
    found._update({**GOOD, "subject": "genmesh.ns.router.generate"})
    worker = found.workers["w1"]
    assert worker.subject == "genmesh.ns.worker.w1.generate"
    assert (worker.inflight, worker.capacity, worker.expires_after) == (3, 8, 1.5)
    found._update({**GOOD, "inflight": 5, "heartbeat_s": math.nan})  # refused: no change
    assert (worker.inflight, worker.expires_after) == (3, 1.5)


def test_hostile_cards_never_raise_and_are_logged_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """What a JSON card can hold that msgpack cannot (integers beyond 64 bits: `float()`
    of one overflows) included; a flood of refusals is one line, then a count."""
    hostile = get_codec("json").decode(
        b'{"id": "w1", "capacity": 1, "heartbeat_s": 1' + b"0" * 400 + b"}"
    )
    found = directory()
    with caplog.at_level(logging.INFO, logger="genmesh.shared.discovery"):
        for card, _ in BAD_CARDS:
            found._update(card)
        found._update(hostile)
        found._update_router({"id": "r1", "heartbeat_s": math.inf})
    assert found.workers == {}
    assert found.routers == {}
    assert caplog.messages == [f"ignored worker card '': {ID}"]


def test_a_full_directory_keeps_the_workers_and_routers_it_knows(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("genmesh.shared.discovery.MAX_WORKERS", 2)
    monkeypatch.setattr("genmesh.shared.discovery.MAX_ROUTERS", 1)
    found = directory()
    with caplog.at_level(logging.INFO, logger="genmesh.shared.discovery"):
        for wid in ("w1", "w2", "w3"):
            found._update({**GOOD, "id": wid})
        found._update({**GOOD, "id": "w2", "inflight": 7})  # known: still heard
        found._update_router({"id": "r1"})
        found._update_router({"id": "r2"})
        found._update_router({"id": "r1", "leaving": True})
        found._update_router({"id": "r2"})  # room again
    assert sorted(found.workers) == ["w1", "w2"]
    assert found.workers["w2"].inflight == 7
    assert list(found.routers) == ["r2"]
    refusals = [m for m in caplog.messages if m.startswith("ignored")]
    assert refusals == ["ignored worker card 'w3': 2 workers are known, the most a directory keeps"]


def test_the_throttled_log_counts_what_it_held_back(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [100.0]
    monkeypatch.setattr("genmesh.shared.throttled_log.time.monotonic", lambda: now[0])
    throttled = ThrottledLog(logging.getLogger("genmesh.test"), interval_s=10.0)
    with caplog.at_level(logging.INFO, logger="genmesh.test"):
        for step in (0.0, 1.0, 9.9, 10.0, 10.5):
            now[0] = 100.0 + step
            throttled.info("bad %s", step)
    assert caplog.messages == ["bad 0.0", "bad 10.0 (and 2 more in the last 10s)"]


@pytest.mark.parametrize("interval", ["0", "-1", "nan", "inf", "3601"])
def test_a_worker_cannot_be_given_a_heartbeat_directories_would_refuse(
    interval: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse(WorkerConfig, ["--heartbeat-interval", interval], environ={})
    assert (
        f"argument --heartbeat-interval: '{interval}' must be a number above 0 and at most 3600"
        in capsys.readouterr().err
    )
    edge = parse(WorkerConfig, ["--heartbeat-interval", "3600"], environ={})
    assert edge.heartbeat_interval_s == 3600.0

"""A `$SRV` endpoint's counts (`shared/micro.py`): what a handler feeds them, what a
STATS answer makes of them (valid under the NATS CLI's schema)."""

from __future__ import annotations

from typing import Any, cast

import jsonschema
import pytest
from nats.aio.msg import Msg

from genmesh.shared.micro import MAX_LAST_ERROR, MicroEndpoint, MicroService
from tests.srv import schema

pytestmark = pytest.mark.unit


async def test_a_counted_callback_counts_each_message_and_each_raise() -> None:
    endpoint = MicroEndpoint("ping", "genmesh.t.worker.w1.ping")

    async def handler(msg: Msg) -> None:
        if msg is None:
            raise ValueError("no message")

    counted = endpoint.counted(handler)
    await counted(cast(Msg, object()))
    with pytest.raises(ValueError, match="no message"):
        await counted(cast(Msg, None))
    stats = endpoint.stats().to_dict()
    assert (stats["num_requests"], stats["num_errors"]) == (2, 1)
    assert stats["last_error"] == "ValueError('no message')"
    assert stats["processing_time"] > 0
    assert stats["average_processing_time"] == stats["processing_time"] // 2
    assert stats["data"] is None


def test_last_error_keeps_its_first_characters_only() -> None:
    endpoint = MicroEndpoint("generate", "genmesh.t.router.generate", "router")
    endpoint.failed("bad_envelope: " + "x" * 10_000)
    assert endpoint.last_error == ("bad_envelope: " + "x" * 10_000)[:MAX_LAST_ERROR]


def test_a_stats_answer_before_any_request_is_valid() -> None:
    service = MicroService(cast(Any, None), role="router", namespace="t", description="d")
    service.add(MicroEndpoint("generate", "genmesh.t.router.generate", "router", dict))
    answer = service.stats()
    jsonschema.validate(answer, schema("stats"), format_checker=jsonschema.FormatChecker())
    (endpoint,) = answer["endpoints"]
    assert endpoint["average_processing_time"] == 0  # no division by zero
    assert endpoint["data"] == {}
    assert answer["metadata"] == {"namespace": "t", "role": "router"}

"""The event loop a service runs on: uvloop by default, asyncio's own on request."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from genmesh.shared.connection import MeshConnection
from genmesh.shared.loop import run
from genmesh.shared.settings import parse

pytestmark = pytest.mark.unit


async def _loop_type() -> type[asyncio.AbstractEventLoop]:
    return type(asyncio.get_running_loop())


def test_services_run_on_uvloop_unless_told_otherwise() -> None:
    assert MeshConnection().event_loop == "uvloop"
    assert run(_loop_type(), "uvloop") is uvloop.Loop
    loop_type = run(_loop_type(), "asyncio")
    assert loop_type is not uvloop.Loop
    assert issubclass(loop_type, asyncio.BaseEventLoop)


def test_event_loop_option_and_variable() -> None:
    assert parse(MeshConnection, ["--event-loop", "asyncio"], environ={}).event_loop == "asyncio"
    asked = parse(MeshConnection, [], environ={"GENMESH_EVENT_LOOP": "asyncio"})
    assert asked.event_loop == "asyncio"

"""`genmesh up --prefill-workers 1 --decode-workers 1`: a P/D mesh of processes whose
workers announce their roles in discovery, and whose frontend pairs them.

How `up` renders its workers' command lines is unit-tested in tests/test_settings.py.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.mesh import free_port
from tests.test_cli import GENMESH, clean_env, up_summary

pytestmark = pytest.mark.process


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as reply:
        body = reply.read().decode()
    return json.loads(body) if reply.headers.get_content_type() == "application/json" else body


def test_up_runs_a_prefill_and_a_decode_worker(tmp_path: Path) -> None:
    port = free_port()
    log = (tmp_path / "up.log").open("w+")
    argv = ["up", "--port", str(port), "--routers", "0"]
    proc = subprocess.Popen(
        [*GENMESH, *argv, "--prefill-workers", "1", "--decode-workers", "1"],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=clean_env(GENMESH_MOCK_SPEEDUP="0"),
    )
    try:
        text = up_summary(proc, log)
        roles = re.findall(r"worker\s+(w[0-9a-f]+)\s+pid \d+\s+\(role (\w+)\)", text)
        assert sorted(role for _, role in roles) == ["decode", "prefill"], text
        url = f"http://127.0.0.1:{port}"
        cards = {w["id"]: w for w in get(f"{url}/get_server_info")["genmesh"]["workers"]}
        assert {wid: cards[wid]["role"] for wid, _ in roles} == dict(roles)
        assert {cards[wid]["disagg"]["kind"] for wid, _ in roles} == {"mock"}
        assert len(cards) == 2  # no role-both workers beside them
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}
        request = urllib.request.Request(f"{url}/generate", data=json.dumps(body).encode())
        with urllib.request.urlopen(request, timeout=10) as reply:
            assert len(json.load(reply)["output_ids"]) == 4
        metrics = get(f"{url}/metrics")
        assert 'genmesh_pd_routed_total{path="disaggregated"} 1.0' in metrics
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        log.close()

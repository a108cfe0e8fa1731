"""`genmesh up` passes the admin API key to its frontend, in its environment only."""

from __future__ import annotations

import re
import signal
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.mesh import free_port
from tests.test_cli import GENMESH, clean_env, up_summary

pytestmark = pytest.mark.process


def status(url: str, key: str | None = None) -> int:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=b'{"rid": "nobody"}', headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_up_guards_the_admin_routes_with_its_admin_key(tmp_path: Path) -> None:
    port = free_port()
    log = (tmp_path / "up.log").open("w+")
    proc = subprocess.Popen(
        [*GENMESH, "up", "--port", str(port), "--workers", "1", "--admin-api-key", "up-key"],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=clean_env(GENMESH_MOCK_SPEEDUP="0"),
    )
    try:
        text = up_summary(proc, log)
        url = f"http://127.0.0.1:{port}/abort_request"
        assert status(url) == 401
        assert status(url, "wrong") == 401
        assert status(url, "up-key") == 200
        # A secret never goes on a command line, where `ps` shows it to everyone.
        for pid in re.findall(r"pid (\d+)", text):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert b"up-key" not in cmdline
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()

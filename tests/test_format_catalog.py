"""The format catalog: entry points, GENMESH_GENERATE_FORMAT, path overrides, clashes; and a
third-party format installed from a small package, served by a real frontend."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from genmesh.formats import catalog
from genmesh.formats.base import Route
from genmesh.formats.catalog import ConfigError, load_generate_formats
from genmesh.formats.sglang import SglangFormat
from tests.http_util import post, stream
from tests.inproc import AnyMesh
from tests.mesh import Mesh, free_port

pytestmark = pytest.mark.unit

PLUGIN = Path(__file__).parent / "plugins" / "echo_format"


class OtherFormat(SglangFormat):
    name = "other"

    @classmethod
    def default_routes(cls) -> tuple[Route, ...]:
        return (Route("POST", "/other/generate"),)


class SamePathFormat(SglangFormat):
    name = "twin"

    @classmethod
    def default_routes(cls) -> tuple[Route, ...]:
        return (Route("POST", "/other/generate"),)


@pytest.fixture
def fake_formats(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    formats: dict[str, Any] = {"sglang": SglangFormat, "other": OtherFormat}
    monkeypatch.setattr(catalog, "installed_formats", lambda: dict(formats))
    return formats


def routes_of(formats: list[Any]) -> dict[str, list[tuple[str, str]]]:
    return {f.name: [(r.method, r.path) for r in f.routes] for f in formats}


def test_default_serves_sglang_on_generate_and_others_on_their_paths(
    fake_formats: dict[str, Any],
) -> None:
    served = routes_of(load_generate_formats(env={}))
    assert served == {
        "sglang": [("POST", "/generate"), ("PUT", "/generate")],
        "other": [("POST", "/other/generate")],
    }


def test_another_generate_format_takes_generate_and_keeps_its_path(
    fake_formats: dict[str, Any],
) -> None:
    served = routes_of(load_generate_formats("other", env={}))
    # sglang's native path is /generate, now taken: it steps aside.
    assert served == {"other": [("POST", "/generate"), ("POST", "/other/generate")]}
    moved = routes_of(load_generate_formats("other", env={"GENMESH_SGLANG_PATH": "/sg"}))
    assert moved["sglang"] == [("POST", "/sg"), ("PUT", "/sg")]


def test_unknown_format_lists_the_installed_ones(fake_formats: dict[str, Any]) -> None:
    with pytest.raises(
        ConfigError, match="unknown generate format 'nope'; installed formats: other, sglang"
    ):
        load_generate_formats("nope", env={})


def test_two_formats_on_one_route_is_a_configuration_error(fake_formats: dict[str, Any]) -> None:
    fake_formats["twin"] = SamePathFormat
    with pytest.raises(ConfigError, match="both claim POST /other/generate"):
        load_generate_formats(env={})
    del fake_formats["twin"]
    with pytest.raises(ConfigError, match="both claim POST /generate"):
        load_generate_formats(env={"GENMESH_OTHER_PATH": "/generate"})


@pytest.mark.parametrize("path", ["generate", "/v1/:model/generate", "/x/*"])
def test_route_paths_must_be_plain(fake_formats: dict[str, Any], path: str) -> None:
    with pytest.raises(ConfigError, match="route path"):
        load_generate_formats(env={"GENMESH_OTHER_PATH": path})


def test_unknown_client_codec(fake_formats: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="unknown client codec 'klingon'"):
        load_generate_formats("sglang+klingon", env={})


# ---------------------------------------------------------------- a real third-party package


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Install the echo format package (pip, no network: it has no dependencies)."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
            "--no-build-isolation", "--disable-pip-version-check",
            "--target", str(target), str(PLUGIN),
        ],
        check=True,
        timeout=120,
    )  # fmt: skip
    return target


def plugin_env(plugin_path: Path, **extra: str) -> dict[str, str]:
    pythonpath = os.pathsep.join(p for p in (str(plugin_path), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": pythonpath, **extra}


@pytest.fixture
def echo_mesh(mesh: AnyMesh, plugin_path: Path, tmp_path: Path) -> Iterator[Mesh]:
    """A second frontend, with the plugin installed, in front of the shared mesh."""
    other = Mesh(mesh.nats_url, tmp_path, mesh.namespace)
    other.add_frontend(env=plugin_env(plugin_path))
    yield other
    other.stop()


@pytest.mark.process
async def test_an_installed_third_party_format_is_served(echo_mesh: Mesh) -> None:
    reply = await post(echo_mesh.http_url + "/echo/generate", {"tokens": [1, 2, 3], "max": 5})
    assert reply.status == 200, reply.body
    assert len(reply.body["tokens"]) == 5
    assert reply.body["done"] == "length"
    sse = await stream(echo_mesh.http_url + "/echo/generate", {"tokens": [1, 2, 3], "max": 5})
    # One event per frame: the instant mock's first token alone, then the rest in one frame
    # (workers coalesce what is ready at once); together, the unary answer's tokens.
    events = [e["tokens"] for e in sse.events[:-1]]
    assert events == [reply.body["tokens"][:1], reply.body["tokens"][1:]]
    bad = await post(echo_mesh.http_url + "/echo/generate", {"nope": 1})
    assert bad.status == 400
    assert bad.body == {"problem": "send {'tokens': [...], 'max': n}"}
    # The built-in format is still there beside it.
    assert (await post(echo_mesh.http_url + "/generate", {"input_ids": [1]})).status == 200


@pytest.mark.process
def test_a_clashing_third_party_route_stops_start_up(mesh: AnyMesh, plugin_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable, "-m", "genmesh", "frontend", "--nats-url", mesh.nats_url,
            "--port", str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **plugin_env(plugin_path, GENMESH_ECHO_PATH="/generate")},
    )  # fmt: skip
    assert out.returncode == 2
    assert "formats 'sglang' and 'echo' both claim POST /generate" in out.stderr
    assert "Traceback" not in out.stderr

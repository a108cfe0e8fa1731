"""The same end-to-end path on a NATS server in a Docker container (testcontainers).

Skipped cleanly where no Docker engine is reachable (as on the CI machines); the rest of
the suite runs the same mesh against a nats-server subprocess.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import unique_namespace
from tests.http_util import post
from tests.mesh import Mesh, start_mesh

pytestmark = [pytest.mark.process, pytest.mark.docker]


def docker_reachable() -> bool:
    try:
        import docker

        docker.from_env(timeout=3).ping()
    except Exception:
        return False
    return True


@pytest.fixture(scope="module")
def container_nats_url() -> Iterator[str]:
    if not docker_reachable():
        pytest.skip("no Docker engine is reachable")
    from testcontainers.community.nats import NatsContainer

    try:
        container = NatsContainer("nats:2.12-alpine").start()
    except Exception as exc:  # no registry access, image pull refused, ...
        pytest.skip(f"cannot start a NATS container: {exc}")
    try:
        yield container.nats_uri()
    finally:
        container.stop()


@pytest.fixture
def container_mesh(container_nats_url: str, tmp_path: Path) -> Iterator[Mesh]:
    mesh = start_mesh(container_nats_url, tmp_path, namespace=unique_namespace("docker"))
    yield mesh
    mesh.stop()


async def test_generate_through_a_containerised_nats(container_mesh: Mesh) -> None:
    reply = await post(
        container_mesh.http_url + "/generate",
        {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}},
    )
    assert reply.status == 200
    assert len(reply.body["output_ids"]) == 4

"""Fixtures for every e2e test: the one local/real cluster switch, per-test namespaces, clients."""
from __future__ import annotations

from typing import Any, Iterator

import pytest

from e2e.kubelet import process
from e2e.target import ClusterTarget, open_target


@pytest.fixture(scope="session")
def cluster() -> Iterator[ClusterTarget]:
    target = open_target()
    try:
        yield target
    finally:
        target.close()
        process.kill_all(grace_s=1.0)   # belt and braces: nothing we started outlives the session


@pytest.fixture
def namespace(cluster: ClusterTarget) -> Iterator[str]:
    name = cluster.new_namespace()
    try:
        yield name
    finally:
        cluster.delete_namespace(name)


@pytest.fixture
def api_client(cluster: ClusterTarget) -> Any:
    return cluster.api_client()


@pytest.fixture
def local_only(cluster: ClusterTarget) -> None:
    if not cluster.is_local:
        pytest.skip("inspects the emulator's internals; not applicable to a real cluster")

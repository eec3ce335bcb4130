"""Fixtures for every e2e test: the one local/real cluster switch, per-test namespaces, clients."""
from __future__ import annotations

from typing import Any, Iterator

import pytest

from e2e.kubelet import process
from e2e.target import ClusterTarget, open_target


@pytest.fixture(scope="session")
def cluster() -> Iterator[ClusterTarget]:
    """etcd, kube-apiserver, kube-controller-manager, kube-scheduler (built by ``python -m e2e.kube.build``;
    missing binaries fail the test with that command, never skip it) and our kubelet as the node."""
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
def local_node(cluster: ClusterTarget) -> None:
    """The test reaches pod IPs from this process, or its pods run this machine's interpreter."""
    if not cluster.is_local:
        pytest.skip("needs pods on this machine (a local cluster); not applicable to a remote cluster")

"""Fixtures for every e2e test: the one local/real cluster switch, per-test namespaces, clients."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Iterator

import pytest

from e2e.target import ClusterTarget, open_target


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that start a real node of their own go first: a machine holds one node, and the session's
    cluster, once started, stays up until the session ends."""
    items.sort(key=lambda item: item.get_closest_marker("own_node") is None)   # stable: order kept otherwise


@pytest.fixture(scope="session")
def cluster() -> Iterator[ClusterTarget]:
    """etcd, kube-apiserver, kube-controller-manager, kube-scheduler and the real node: the kubelet v1.37.2
    on containerd, kube-proxy, CoreDNS, pods of the chart's image from the local registry. One per session
    (one per machine). Missing parts (root, containerd, binaries, the image) fail the test with what to
    do, never skip it."""
    target = open_target()
    try:
        yield target
    finally:
        target.close()


# Where a failed test's pod logs are kept (the cluster's own directory goes with the cluster).
ARTIFACTS_ENV = "PAGEDMODEL_E2E_ARTIFACTS"
LOG_TAIL_LINES = 40
_CALL_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    report = yield
    if report.when == "call":
        item.stash[_CALL_FAILED] = report.failed   # read by the namespace fixture's teardown
    return report


@pytest.fixture
def namespace(cluster: ClusterTarget, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace for one test; a failed test's pod logs are kept before it is deleted."""
    name = cluster.new_namespace()
    try:
        yield name
    finally:
        if request.node.stash.get(_CALL_FAILED, False):
            keep_pod_logs(cluster, name, request.node.nodeid)
        cluster.delete_namespace(name)


def keep_pod_logs(cluster: ClusterTarget, namespace: str, test_id: str) -> None:
    """A failed test's pod logs (current and previous containers) go to a directory that outlives the
    cluster, and their tails to the test's captured output, so an intermittent failure can be read
    after the fact: without them, an engine's traceback behind a 500 is gone with the namespace."""
    root = Path(os.environ.get(ARTIFACTS_ENV, "/tmp/pagedmodel-e2e-failures"))
    out = root / re.sub(r"[^A-Za-z0-9_.-]+", "_", test_id)
    out.mkdir(parents=True, exist_ok=True)
    pods = cluster.kubectl("get", "pods", "-o", "name", namespace=namespace, check=False).stdout.split()
    for pod in pods:
        for previous in (False, True):
            args = ["logs", pod, "--all-containers", "--prefix"] + (["--previous"] if previous else [])
            text = cluster.kubectl(*args, namespace=namespace, check=False).stdout
            if not text:
                continue
            path = out / f"{pod.split('/')[-1]}{'.previous' if previous else ''}.log"
            path.write_text(text)
            tail = "\n".join(text.splitlines()[-LOG_TAIL_LINES:])
            print(f"---- {path} (last {LOG_TAIL_LINES} lines) ----\n{tail}")
    print(f"pod logs of the failed test kept in {out}")


@pytest.fixture
def api_client(cluster: ClusterTarget) -> Any:
    return cluster.api_client()


@pytest.fixture
def local_node(cluster: ClusterTarget) -> None:
    """The test reaches pod IPs from this process, or controls the cluster's processes and files."""
    if cluster.local is None:
        pytest.skip("needs pods on this machine (a local cluster); not applicable to a remote cluster")

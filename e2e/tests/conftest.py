"""The one switch between the local emulator and a real cluster, plus per-test namespaces."""
from __future__ import annotations

from typing import Any, Iterator

import copy

import pytest
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from e2e.kubelet import process
from e2e.target import ClusterTarget, open_target

from .helpers import WIDGET_CRD, wait_until


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


@pytest.fixture(scope="session")
def widget_crd(cluster: ClusterTarget) -> Iterator[dict[str, Any]]:
    """The Widget CRD (e2e/tests/helpers.py), registered and Established for the session."""
    api = cluster.api_client()
    ext = k8s.ApiextensionsV1Api(api)
    try:
        ext.create_custom_resource_definition(copy.deepcopy(WIDGET_CRD))
    except ApiException as exc:
        if exc.status != 409:
            raise

    def established():
        crd = ext.read_custom_resource_definition(WIDGET_CRD["metadata"]["name"])
        return any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or [])

    wait_until(established, what="CRD Established")
    yield WIDGET_CRD
    ext.delete_custom_resource_definition(WIDGET_CRD["metadata"]["name"])

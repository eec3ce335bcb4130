"""Fixtures specific to the harness's own tests."""
from __future__ import annotations

import copy
from typing import Any, Iterator

import pytest
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from e2e.target import ClusterTarget

from .helpers import WIDGET_CRD, wait_until


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

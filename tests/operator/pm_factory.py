"""Builds PagedModel bodies for the operator unit tests (a plain module: tests/operator is no package,
since a package named `operator` would shadow the stdlib one)."""
from __future__ import annotations

import copy
from typing import Any


def make_pm(spec: dict[str, Any] | None = None, name: str = "smollm2", namespace: str = "ml",
            uid: str = "uid-1", generation: int = 1, status: dict[str, Any] | None = None,
            annotations: dict[str, str] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "pagedmodel.io/v1alpha1", "kind": "PagedModel",
        "metadata": {"name": name, "namespace": namespace, "uid": uid, "generation": generation,
                     "annotations": dict(annotations or {})},
        "spec": copy.deepcopy(spec if spec is not None else {"model": {"source": "builtin://smollm2"}}),
    }
    if status is not None:
        body["status"] = status
    return body



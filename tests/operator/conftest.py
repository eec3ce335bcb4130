"""Fixtures for the operator's unit tests (pure code: no cluster, no network)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "pagedmodel.yaml"


@pytest.fixture(scope="session")
def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


@pytest.fixture(scope="session")
def crd_schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]

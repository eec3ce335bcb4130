"""The PagedModel CRD as the operator reads it: the schema's defaults, from the CRD itself.

`crds/pagedmodel.yaml` is the one hand-written CRD; `crds/generate.py` copies it byte for byte to the chart
(`charts/pagedmodel/crds/`) and here (`operator/crd.yaml`, package data, so an installed operator has it),
and the tests fail when a copy differs. The operator's defaults are read from this copy, so a default
changed in the CRD is the operator's default too, with nothing to keep in step by hand.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

CRD_FILE = Path(__file__).with_name("crd.yaml")


def load_crd(path: Path = CRD_FILE) -> dict[str, Any]:
    """The CRD document (the C loader when PyYAML has it: the file is ~700 lines, read at import)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load(path.read_text(encoding="utf-8"), Loader=loader)   # noqa: S506 - a safe loader


def spec_schema(crd: dict[str, Any]) -> dict[str, Any]:
    """The schema of `spec` in the CRD's one version."""
    [version] = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]


def spec_defaults(crd: dict[str, Any]) -> dict[str, Any]:
    """What the API server fills into a spec: each scalar field's default, and for each object section the
    defaults of its own fields, as a dict even when it has none (the operator reads every section without
    checking that it is there). Sections are one level deep, as the CRD's defaults are."""
    out: dict[str, Any] = {}
    for key, field in spec_schema(crd)["properties"].items():
        if field.get("type") == "object":
            out[key] = {name: sub["default"] for name, sub in (field.get("properties") or {}).items()
                        if "default" in sub}
        elif "default" in field:
            out[key] = field["default"]
    return out

"""The CRD's shape: names, subresources, printer columns, and a description on every field (kubectl explain)."""
from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parents[2]


def fields(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    for name, sub in (schema.get("properties") or {}).items():
        yield f"{path}.{name}", sub
        yield from fields(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from fields(schema["items"], f"{path}[]")


def test_names_and_scope(crd):
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "pagedmodels.pagedmodel.io" and spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "PagedModel" and spec["names"]["shortNames"] == ["pm"]
    assert spec["names"]["categories"] == ["pagedmodel"]
    assert [v["name"] for v in spec["versions"]] == ["v1alpha1"]


def test_status_and_scale_subresources(crd):
    sub = crd["spec"]["versions"][0]["subresources"]
    assert sub == {"status": {}, "scale": {"specReplicasPath": ".spec.replicas",
                                           "statusReplicasPath": ".status.replicas",
                                           "labelSelectorPath": ".status.selector"}}


def test_printer_columns(crd):
    cols = crd["spec"]["versions"][0]["additionalPrinterColumns"]
    assert [c["name"] for c in cols] == ["Model", "Ready", "KV%", "Waiting", "Adapters", "Phase", "Age", "URL"]
    assert [c["jsonPath"] for c in cols] == [".spec.model.source", ".status.ready", ".status.metrics.kvCachePercent",
                                             ".status.metrics.waiting", ".status.adaptersReady", ".status.phase",
                                             ".metadata.creationTimestamp", ".status.url"]
    assert [c.get("priority", 0) for c in cols] == [0, 0, 0, 0, 0, 0, 0, 1]      # URL only with -o wide


def test_every_field_is_described_and_typed(crd_schema):
    for path, sub in fields(crd_schema):
        assert sub.get("description"), f"{path} has no description"
        assert sub.get("type") or sub.get("x-kubernetes-int-or-string"), f"{path} has no type"


def test_ranges_and_enums_where_the_issue_asks(crd_schema):
    spec = crd_schema["properties"]["spec"]["properties"]
    engine = spec["engine"]["properties"]
    assert engine["blockSize"]["enum"] == [8, 16, 32, 64, 128]
    gmu = engine["gpuMemoryUtilization"]
    assert (gmu["minimum"], gmu["exclusiveMinimum"], gmu["maximum"]) == (0, True, 1)
    assert spec["replicas"]["minimum"] == 0
    assert spec["tuning"]["properties"]["mode"]["enum"] == ["Off", "Recommend", "Auto"]
    rules = [r["rule"] for r in spec["autoscaling"]["x-kubernetes-validations"]]
    assert any("minReplicas <= self.maxReplicas" in r for r in rules)
    assert spec["tuning"]["properties"]["maxNumSeqs"]["x-kubernetes-validations"][0]["rule"] == "self.min <= self.max"


def test_every_copy_of_the_crd_is_the_hand_written_one():
    """crds/pagedmodel.yaml is the one CRD written by hand; the chart's and the operator package's copies are
    made by crds/generate.py and must be byte for byte the same."""
    generator = runpy.run_path(str(REPO / "crds" / "generate.py"))
    assert [p.relative_to(REPO).as_posix() for p in generator["COPIES"]] == [
        "charts/pagedmodel/crds/pagedmodel.yaml", "operator/crd.yaml"]
    assert generator["stale_copies"]() == [], "run: python3 crds/generate.py"

"""spec.py: defaults agree with the CRD, model sources parse, cross-field rules name the field."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from pagedmodel.operator.spec import DEFAULTS, ModelSource, parse_source, validate, with_defaults


def test_the_defaults_are_the_source_crds(crd):
    """DEFAULTS is read from the operator's copy of the CRD; this reads crds/pagedmodel.yaml, the source, on
    its own: a default changed there and not copied (crds/generate.py) fails here."""
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    for key, field in spec.items():
        if field.get("type") == "object":
            nested = {k: v["default"] for k, v in (field.get("properties") or {}).items() if "default" in v}
            assert DEFAULTS[key] == nested, key
        else:
            assert DEFAULTS.get(key) == field.get("default"), key
    assert DEFAULTS["engine"]["maxNumSeqs"] == spec["engine"]["properties"]["maxNumSeqs"]["default"]
    assert with_defaults({})["autoscaling"]["maxReplicas"] == spec["autoscaling"]["properties"]["maxReplicas"]["default"]


def test_with_defaults_fills_only_absent_fields_and_copies():
    spec = {"model": {"source": "builtin://smollm2"}, "engine": {"maxNumSeqs": 8}, "replicas": 0}
    out = with_defaults(spec)
    assert out["engine"]["maxNumSeqs"] == 8 and "blockSize" not in out["engine"]   # the device decides
    assert out["replicas"] == 0 and out["router"]["strategy"] == "kv-aware"
    out["engine"]["maxNumSeqs"] = 99
    assert spec["engine"] == {"maxNumSeqs": 8}          # the input is never mutated


@pytest.mark.parametrize("source, expected", [
    ("builtin://smollm2", ModelSource("builtin", "smollm2")),
    ("pvc://weights/llama/3b", ModelSource("pvc", "weights", "llama/3b")),
    ("pvc://weights", ModelSource("pvc", "weights", "")),
    ("hf://HuggingFaceTB/SmolLM2-135M-Instruct", ModelSource("hf", "HuggingFaceTB/SmolLM2-135M-Instruct")),
])
def test_parse_source(source, expected):
    assert parse_source(source) == expected


@pytest.mark.parametrize("source, needle", [
    ("s3://bucket/model", "is not builtin://"),
    ("pvc://Bad_Name/x", "not a valid Kubernetes name"),
    ("pvc://weights/../etc", "must not contain '..'"),
    ("hf://just-a-name", "must be ORG/NAME"),
    ("", "is not builtin://"),
])
def test_parse_source_rejects(source, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.").replace("/", "/")):
        parse_source(source)


def test_valid_specs_have_no_errors():
    assert validate(with_defaults({"model": {"source": "builtin://smollm2"}})) == []
    full = {"model": {"source": "pvc://w/m", "servedName": "m"}, "engine": {"maxModelLen": 4096,
            "maxNumBatchedTokens": 8192, "extraArgs": ["--log-level=debug"], "device": "cuda"},
            "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 2},
            "tuning": {"mode": "Auto", "maxNumSeqs": {"min": 16, "max": 16}, "blockSizes": [8, 16]}}
    assert validate(with_defaults(full)) == []


@pytest.mark.parametrize("patch, field", [
    ({"model": {"source": "ftp://x"}}, "spec.model.source"),
    ({"model": {}}, "spec.model.source"),
    ({"engine": {"blockSize": 12}}, "spec.engine.blockSize"),
    ({"engine": {"maxNumSeqs": 0}}, "spec.engine.maxNumSeqs"),
    ({"engine": {"maxNumSeqs": "8"}}, "spec.engine.maxNumSeqs"),
    ({"engine": {"gpuMemoryUtilization": 0}}, "spec.engine.gpuMemoryUtilization"),
    ({"engine": {"gpuMemoryUtilization": 1.5}}, "spec.engine.gpuMemoryUtilization"),
    ({"engine": {"maxModelLen": 8}}, "spec.engine.maxModelLen"),
    ({"engine": {"tensorParallelSize": 2}}, "spec.engine.tensorParallelSize"),
    ({"engine": {"extraArgs": ["--max-num-seqs=4"]}}, "spec.engine.extraArgs[0]"),
    ({"engine": {"device": "cuda"}, "resources": {"gpus": 0}}, "spec.engine.device"),
    ({"replicas": -1}, "spec.replicas"),
    ({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}, "spec.autoscaling.minReplicas"),
    ({"autoscaling": {"targetKVCacheUsage": 0}}, "spec.autoscaling.targetKVCacheUsage"),
    ({"tuning": {"mode": False}}, "spec.tuning.mode"),
    ({"tuning": {"maxNumSeqs": {"min": 64, "max": 16}}}, "spec.tuning.maxNumSeqs.min"),
    ({"tuning": {"blockSizes": [24]}}, "spec.tuning.blockSizes"),
    ({"service": {"port": 70000}}, "spec.service.port"),
    ({"router": "yes"}, "spec.router"),
    ({"router": {"perClientRateLimit": {"requestsPerSecond": 0}}}, "spec.router.perClientRateLimit.requestsPerSecond"),
    ({"router": {"perClientRateLimit": {"requestsPerSecond": 1, "header": "X Tenant"}}},
     "spec.router.perClientRateLimit.header"),
    ({"autoscaling": {"stableWindowSeconds": 0}}, "spec.autoscaling.stableWindowSeconds"),
    ({"autoscaling": {"requestsPerSecondPerReplica": 0}}, "spec.autoscaling.requestsPerSecondPerReplica"),
    ({"router": {"tenantLimits": {}}}, "spec.router.tenantLimits"),
    ({"router": {"tenantLimits": {"tokensPerMinute": 0}}}, "spec.router.tenantLimits.tokensPerMinute"),
    ({"router": {"tenantLimits": {"requestsPerMinute": 5, "header": "X Tenant"}}}, "spec.router.tenantLimits.header"),
    ({"router": {"tenantLimits": {"requestsPerMinute": 5, "defaultMaxTokens": 0}}},
     "spec.router.tenantLimits.defaultMaxTokens"),
    ({"router": {"tenantLimits": {"overrides": "acme"}}}, "spec.router.tenantLimits.overrides"),
    ({"router": {"tenantLimits": {"overrides": [{"tokensPerMinute": 5}]}}},
     "spec.router.tenantLimits.overrides[0].tenant"),
    ({"router": {"tenantLimits": {"overrides": [{"tenant": "a"}]}}}, "spec.router.tenantLimits.overrides[0]"),
    ({"router": {"tenantLimits": {"overrides": [{"tenant": "a", "tokensPerMinute": 5},
                                                {"tenant": "a", "tokensPerMinute": 6}]}}},
     "spec.router.tenantLimits.overrides[1].tenant"),
    ({"router": {"tenantLimits": {"overrides": [{"tenant": "a", "requestsPerMinute": -1}]}}},
     "spec.router.tenantLimits.overrides[0].requestsPerMinute"),
])
def test_invalid_specs_name_the_field(patch, field):
    spec: dict[str, Any] = {"model": {"source": "builtin://smollm2"}}
    for key, value in patch.items():
        spec[key] = value
    errors = validate(with_defaults(spec))
    assert field in [e.field for e in errors], errors
    assert all(str(e).startswith(e.field + ": ") for e in errors)


@pytest.mark.parametrize("example", sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_examples_pass_the_operators_own_checks(example):
    doc = yaml.safe_load(example.read_text())
    assert doc["kind"] == "PagedModel" and doc["apiVersion"] == "pagedmodel.io/v1alpha1"
    assert validate(with_defaults(doc["spec"])) == []

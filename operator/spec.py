"""The PagedModel spec as the operator reads it: defaults filled in, cross-field rules checked.

The CRD schema rejects most bad input at apply time; this module re-checks what a schema cannot
(CEL rules on clusters that do not evaluate them, flags in extraArgs that would fight the
generated ones, malformed model sources), so a bad spec becomes phase Failed with an
InvalidSpec event instead of an exception in a handler. Defaults mirror the CRD's
(tests/operator/test_spec.py checks that they agree).
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

DEFAULTS: dict[str, Any] = {
    "image": "ghcr.io/pagedmodel/pagedmodel:0.1.0",
    "imagePullPolicy": "IfNotPresent",
    "engine": {"blockSize": 16, "maxNumSeqs": 256, "gpuMemoryUtilization": 0.9, "swapSpaceGiB": 4,
               "enablePrefixCaching": True, "tensorParallelSize": 1, "dtype": "auto", "device": "auto"},
    "resources": {"gpus": 1, "gpuResourceName": "nvidia.com/gpu"},
    "replicas": 1,
    "autoscaling": {"enabled": False, "minReplicas": 1, "maxReplicas": 4, "targetKVCacheUsage": 0.8,
                    "targetWaitingPerReplica": 5, "intervalSeconds": 15, "scaleUpStabilizationSeconds": 0,
                    "scaleDownStabilizationSeconds": 300},
    "tuning": {"mode": "Off", "cooldownSeconds": 1800},
    "router": {"replicas": 1, "strategy": "kv-aware", "maxQueueLength": 256, "queueTimeoutSeconds": 30},
    "service": {"type": "ClusterIP", "port": 80},
    "probes": {"startupTimeoutSeconds": 900},
    "scheduling": {},
}

BLOCK_SIZES = (8, 16, 32, 64, 128)
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
TUNING_MODES = ("Off", "Recommend", "Auto")

# Flags the operator generates itself; setting them again through extraArgs would silently win or clash.
MANAGED_FLAGS = frozenset({
    "--model", "--host", "--port", "--served-model-name", "--block-size", "--max-num-seqs", "--max-model-len",
    "--max-num-batched-tokens", "--gpu-memory-utilization", "--kv-cache-memory", "--swap-space",
    "--enable-prefix-caching", "--preemption-mode", "--dtype", "--device", "--max-queue-len",
})

_SOURCE = re.compile(r"^(?P<scheme>builtin|pvc|hf)://(?P<rest>.+)$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@dataclass(frozen=True)
class SpecError:
    """One rule a spec breaks, naming the field as kubectl would (spec.engine.maxNumSeqs)."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


@dataclass(frozen=True)
class ModelSource:
    scheme: str          # builtin | pvc | hf
    name: str            # builtin name, hub id, or PVC claim name
    path: str = ""       # directory inside the PVC


def with_defaults(spec: dict[str, Any] | None) -> dict[str, Any]:
    """A deep copy of spec with every CRD default filled in where the field is absent."""
    out = copy.deepcopy(spec or {})
    for key, default in DEFAULTS.items():
        if isinstance(default, dict):
            section = out.get(key)
            if section is None:
                section = out[key] = {}
            if isinstance(section, dict):
                for k, v in default.items():
                    section.setdefault(k, copy.deepcopy(v))
        else:
            out.setdefault(key, default)
    return out


def parse_source(source: str) -> ModelSource:
    """builtin://smollm2, pvc://claim/dir/inside, hf://org/name; ValueError with the reason otherwise."""
    m = _SOURCE.match(source or "")
    if not m:
        raise ValueError(f"{source!r} is not builtin://NAME, pvc://CLAIM/PATH or hf://ORG/NAME")
    scheme, rest = m["scheme"], m["rest"]
    if scheme == "pvc":
        claim, _, path = rest.partition("/")
        if not _DNS_LABEL.match(claim):
            raise ValueError(f"PVC name {claim!r} is not a valid Kubernetes name")
        if ".." in path.split("/"):
            raise ValueError(f"path {path!r} must not contain '..'")
        return ModelSource("pvc", claim, path.strip("/"))
    if scheme == "hf" and rest.count("/") != 1:
        raise ValueError(f"hub id {rest!r} must be ORG/NAME")
    return ModelSource(scheme, rest)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def validate(spec: dict[str, Any]) -> list[SpecError]:
    """Every rule a defaulted spec breaks; empty when the operator can serve it."""
    errors: list[SpecError] = []

    def need(ok: bool, field: str, message: str) -> None:
        if not ok:
            errors.append(SpecError(field, message))

    def section(key: str) -> dict[str, Any]:
        value = spec.get(key)
        if not isinstance(value, dict):
            errors.append(SpecError(f"spec.{key}", f"must be an object, not {type(value).__name__}"))
            return {}
        return value

    model = spec.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("source"), str):
        errors.append(SpecError("spec.model.source", "is required (builtin://NAME, pvc://CLAIM/PATH or hf://ORG/NAME)"))
    else:
        try:
            parse_source(model["source"])
        except ValueError as exc:
            errors.append(SpecError("spec.model.source", str(exc)))

    need(isinstance(spec.get("image"), str) and bool(spec.get("image")), "spec.image", "must be a non-empty string")
    need(_is_int(spec.get("replicas")) and spec["replicas"] >= 0, "spec.replicas", "must be an integer >= 0")

    engine = section("engine")
    need(engine.get("blockSize") in BLOCK_SIZES, "spec.engine.blockSize", f"must be one of {list(BLOCK_SIZES)}")
    need(_is_int(engine.get("maxNumSeqs")) and 1 <= engine["maxNumSeqs"] <= 4096,
         "spec.engine.maxNumSeqs", "must be an integer in [1, 4096]")
    for key in ("maxModelLen", "maxNumBatchedTokens"):
        if key in engine:
            need(_is_int(engine[key]) and engine[key] >= 16, f"spec.engine.{key}", "must be an integer >= 16")
    gmu = engine.get("gpuMemoryUtilization")
    need(_is_num(gmu) and 0 < gmu <= 1, "spec.engine.gpuMemoryUtilization", "must be a number in (0, 1]")
    need(_is_num(engine.get("swapSpaceGiB")) and engine["swapSpaceGiB"] >= 0, "spec.engine.swapSpaceGiB",
         "must be a number >= 0")
    need(engine.get("dtype") in DTYPES, "spec.engine.dtype", f"must be one of {list(DTYPES)}")
    need(engine.get("device") in DEVICES, "spec.engine.device", f"must be one of {list(DEVICES)}")
    need(engine.get("tensorParallelSize") == 1, "spec.engine.tensorParallelSize", "only 1 is supported")
    extra = engine.get("extraArgs", [])
    if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
        errors.append(SpecError("spec.engine.extraArgs", "must be a list of strings"))
    else:
        for i, arg in enumerate(extra):
            flag = arg.split("=", 1)[0]
            need(flag not in MANAGED_FLAGS, f"spec.engine.extraArgs[{i}]",
                 f"{flag} is set by the operator from spec; use the matching spec field instead")

    resources = section("resources")
    need(_is_int(resources.get("gpus")) and resources["gpus"] >= 0, "spec.resources.gpus", "must be an integer >= 0")
    if engine.get("device") == "cuda" and resources.get("gpus") == 0:
        errors.append(SpecError("spec.engine.device", "cuda needs spec.resources.gpus >= 1"))

    auto = section("autoscaling")
    lo, hi = auto.get("minReplicas"), auto.get("maxReplicas")
    need(_is_int(lo) and lo >= 0, "spec.autoscaling.minReplicas", "must be an integer >= 0")
    need(_is_int(hi) and hi >= 1, "spec.autoscaling.maxReplicas", "must be an integer >= 1")
    if _is_int(lo) and _is_int(hi) and lo > hi:
        errors.append(SpecError("spec.autoscaling.minReplicas", f"minReplicas ({lo}) must not exceed maxReplicas ({hi})"))
    target = auto.get("targetKVCacheUsage")
    need(_is_num(target) and 0 < target <= 1, "spec.autoscaling.targetKVCacheUsage", "must be a number in (0, 1]")

    tuning = section("tuning")
    need(tuning.get("mode") in TUNING_MODES, "spec.tuning.mode",
         f"must be one of {list(TUNING_MODES)} (quote Off in YAML: unquoted it is a boolean)")
    rng = tuning.get("maxNumSeqs")
    if rng is not None:
        if not isinstance(rng, dict) or not _is_int(rng.get("min")) or not _is_int(rng.get("max")):
            errors.append(SpecError("spec.tuning.maxNumSeqs", "needs integer min and max"))
        elif rng["min"] > rng["max"]:
            errors.append(SpecError("spec.tuning.maxNumSeqs.min",
                                    f"min ({rng['min']}) must not exceed max ({rng['max']})"))
    sizes = tuning.get("blockSizes")
    if sizes is not None:
        need(isinstance(sizes, list) and bool(sizes) and all(s in BLOCK_SIZES for s in sizes),
             "spec.tuning.blockSizes", f"must be a non-empty list of {list(BLOCK_SIZES)}")

    router = section("router")
    need(_is_int(router.get("replicas")) and router["replicas"] >= 0, "spec.router.replicas",
         "must be an integer >= 0")
    service = section("service")
    need(_is_int(service.get("port")) and 1 <= service["port"] <= 65535, "spec.service.port",
         "must be an integer in [1, 65535]")
    return errors

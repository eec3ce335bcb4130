"""The PagedModel spec as the operator reads it: defaults filled in, cross-field rules checked.

The CRD schema rejects most bad input at apply time; this module re-checks what a schema cannot
(CEL rules on clusters that do not evaluate them, flags in extraArgs that would fight the
generated ones, malformed model sources), so a bad spec becomes phase Failed with an
InvalidSpec event instead of an exception in a handler. The defaults are the CRD's own, read from it
(crd_schema.py).
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any, Callable

from .adapters import LORA_FLAGS, adapter_errors
from .crd_schema import load_crd, spec_defaults
from .validation import is_int, is_num

# What the API server fills in, read from the CRD (operator/crd.yaml, a copy of crds/pagedmodel.yaml) so the
# two cannot disagree; with_defaults() applies it to specs that did not pass through an API server (tests,
# a cluster that prunes nothing).
DEFAULTS: dict[str, Any] = spec_defaults(load_crd())

BLOCK_SIZES = (8, 16, 32, 64, 128)
CPU_BLOCK_SIZE, GPU_BLOCK_SIZE = 128, 16   # the engine's --block-size defaults (server/engine/device.py)
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
TUNING_MODES = ("Off", "Recommend", "Auto")

# Flags the operator generates itself; setting them again through extraArgs would silently win or clash.
MANAGED_FLAGS = frozenset({
    "--model", "--host", "--port", "--served-model-name", "--block-size", "--max-num-seqs", "--max-model-len",
    "--max-num-batched-tokens", "--gpu-memory-utilization", "--kv-cache-memory", "--swap-space",
    "--enable-prefix-caching", "--preemption-mode", "--dtype", "--device", "--max-queue-len",
}) | LORA_FLAGS

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
    out = copy.deepcopy(spec) if isinstance(spec, dict) else {}
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


def default_block_size(device: str) -> int:
    """`--block-size` when spec.engine.blockSize is unset, for a resolved device (`cpu` or `cuda`): the engine's
    own default (server/engine/device.py::pick_block_size), written out so the tuner knows where it starts."""
    return CPU_BLOCK_SIZE if device == "cpu" else GPU_BLOCK_SIZE


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


def _int_in(lo: int, hi: int | None = None) -> tuple[Callable[[Any], bool], str]:
    return ((lambda v: is_int(v) and v >= lo and (hi is None or v <= hi)),
            f"must be an integer in [{lo}, {hi}]" if hi is not None else f"must be an integer >= {lo}")


def _one_of(*choices: Any) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: any(v == c and type(v) is type(c) for c in choices)), f"must be one of {list(choices)}"


_FRACTION = ((lambda v: is_num(v) and 0 < v <= 1), "must be a number in (0, 1]")
_NON_NEGATIVE = ((lambda v: is_num(v) and v >= 0), "must be a number >= 0")
_POSITIVE = ((lambda v: is_num(v) and v > 0), "must be a number > 0")
_BOOL = ((lambda v: isinstance(v, bool)), "must be true or false")
_STRING = ((lambda v: isinstance(v, str)), "must be a string")
_NON_EMPTY = ((lambda v: isinstance(v, str) and bool(v)), "must be a non-empty string")
_QUANTITY = ((lambda v: (is_int(v) and v >= 0) or (isinstance(v, str) and bool(_QUANTITY_RE.match(v)))),
             "must be a Kubernetes quantity such as \"4\", \"500m\" or \"32Gi\"")
_STR_LIST = ((lambda v: isinstance(v, list) and all(isinstance(x, str) and x for x in v)),
             "must be a list of non-empty strings")
_STR_MAP = ((lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values())),
            "must be a map of strings")
_OBJ_LIST = ((lambda v: isinstance(v, list) and all(isinstance(x, dict) for x in v)), "must be a list of objects")
_QUANTITY_RE = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_RESOURCE_NAME = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_HEADER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,127}$")
_SERVED_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")

# (section, field) -> (check, message); section "" is spec itself. Checked when the field is present
# (with_defaults makes the defaulted ones present), so optional fields may be omitted but not be wrong.
FIELD_RULES: dict[tuple[str, str], tuple[Callable[[Any], bool], str]] = {
    ("", "image"): _NON_EMPTY,
    ("", "imagePullPolicy"): _one_of("Always", "IfNotPresent", "Never"),
    ("", "imagePullSecrets"): _STR_LIST,
    ("", "replicas"): _int_in(0, 1000),
    ("model", "servedName"): ((lambda v: isinstance(v, str) and bool(_SERVED_NAME.match(v)) and len(v) <= 128),
                              "must be a name of letters, digits, '.', '_', '/', '-' (at most 128)"),
    ("engine", "blockSize"): _one_of(*BLOCK_SIZES),
    ("engine", "maxNumSeqs"): _int_in(1, 4096),
    ("engine", "maxModelLen"): _int_in(16, 1048576),
    ("engine", "maxNumBatchedTokens"): _int_in(16, 1048576),
    ("engine", "gpuMemoryUtilization"): _FRACTION,
    ("engine", "kvCacheMemoryBytes"): _int_in(1 << 20),
    ("engine", "swapSpaceGiB"): ((lambda v: is_num(v) and 0 <= v <= 1024), "must be a number in [0, 1024]"),
    ("engine", "enablePrefixCaching"): _BOOL,
    ("engine", "preemptionMode"): _one_of("swap", "recompute"),
    ("engine", "tensorParallelSize"): ((lambda v: v == 1 and is_int(v)), "only 1 is supported"),
    ("engine", "dtype"): _one_of(*DTYPES),
    ("engine", "device"): _one_of(*DEVICES),
    ("engine", "maxQueueLength"): _int_in(1),
    ("engine", "extraArgs"): _STR_LIST,
    ("engine", "maxLoras"): _int_in(1, 64),
    ("engine", "maxLoraRank"): _int_in(1, 512),
    ("resources", "gpus"): _int_in(0, 16),
    ("resources", "gpuResourceName"): ((lambda v: isinstance(v, str) and bool(_RESOURCE_NAME.match(v))),
                                       "must be an extended resource name such as nvidia.com/gpu"),
    ("resources", "cpu"): _QUANTITY,
    ("resources", "memory"): _QUANTITY,
    ("autoscaling", "enabled"): _BOOL,
    ("autoscaling", "minReplicas"): _int_in(0, 1000),
    ("autoscaling", "maxReplicas"): _int_in(1, 1000),
    ("autoscaling", "targetKVCacheUsage"): _FRACTION,
    ("autoscaling", "targetWaitingPerReplica"): _NON_NEGATIVE,
    ("autoscaling", "intervalSeconds"): _int_in(1, 3600),
    ("autoscaling", "stableWindowSeconds"): _int_in(1, 3600),
    ("autoscaling", "requestsPerSecondPerReplica"): _POSITIVE,
    ("autoscaling", "scaleUpStabilizationSeconds"): _int_in(0, 86400),
    ("autoscaling", "scaleDownStabilizationSeconds"): _int_in(0, 86400),
    ("tuning", "mode"): (_one_of(*TUNING_MODES)[0],
                         f"must be one of {list(TUNING_MODES)} (quote Off in YAML: unquoted it is a boolean)"),
    ("tuning", "cooldownSeconds"): _int_in(0),
    ("tuning", "blockSizes"): ((lambda v: isinstance(v, list) and bool(v) and all(
        is_int(s) and s in BLOCK_SIZES for s in v)), f"must be a non-empty list of {list(BLOCK_SIZES)}"),
    ("router", "replicas"): _int_in(0, 100),
    ("router", "strategy"): _one_of("kv-aware", "least-load", "prefix", "prefix-cache", "round-robin"),
    ("router", "maxQueueLength"): _int_in(0),
    ("router", "queueTimeoutSeconds"): _POSITIVE,
    ("service", "type"): _one_of("ClusterIP", "NodePort", "LoadBalancer"),
    ("service", "port"): _int_in(1, 65535),
    ("probes", "startupTimeoutSeconds"): _int_in(10, 7200),
    ("scheduling", "nodeSelector"): _STR_MAP,
    ("scheduling", "tolerations"): _OBJ_LIST,
    ("scheduling", "priorityClassName"): _STRING,
}
SECTIONS = ("model", "engine", "resources", "autoscaling", "tuning", "router", "service", "probes", "scheduling")


def validate(spec: dict[str, Any], model_name: str = "") -> list[SpecError]:
    """Every rule a defaulted spec breaks; empty when the operator can serve it. `model_name` is the PagedModel's,
    the served model name when spec.model.servedName is absent (an adapter may not take it)."""
    errors: list[SpecError] = []
    if not isinstance(spec, dict):
        return [SpecError("spec", "must be an object")]
    for name in SECTIONS:
        if name in spec and not isinstance(spec[name], dict):
            errors.append(SpecError(f"spec.{name}", f"must be an object, not {type(spec[name]).__name__}"))
    for (section, key), (ok, message) in FIELD_RULES.items():
        holder = spec if not section else spec.get(section)
        if isinstance(holder, dict) and key in holder and not ok(holder[key]):
            where = f"spec.{section}.{key}" if section else f"spec.{key}"
            errors.append(SpecError(where, message))

    model = spec.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("source"), str):
        errors.append(SpecError("spec.model.source", "is required (builtin://NAME, pvc://CLAIM/PATH or hf://ORG/NAME)"))
    else:
        try:
            parse_source(model["source"])
        except ValueError as exc:
            errors.append(SpecError("spec.model.source", str(exc)))

    if "adapters" in spec:
        served = model.get("servedName") if isinstance(model, dict) and model.get("servedName") else model_name
        errors += [SpecError(f, m) for f, m in adapter_errors(spec["adapters"], served)]

    engine = spec.get("engine") if isinstance(spec.get("engine"), dict) else {}
    extra = engine.get("extraArgs")
    if isinstance(extra, list):
        for i, arg in enumerate(extra):
            flag = arg.split("=", 1)[0] if isinstance(arg, str) else ""
            if flag in MANAGED_FLAGS:
                errors.append(SpecError(f"spec.engine.extraArgs[{i}]",
                                        f"{flag} is set by the operator from spec; use the matching spec field instead"))
    resources = spec.get("resources") if isinstance(spec.get("resources"), dict) else {}
    if engine.get("device") == "cuda" and resources.get("gpus") == 0:
        errors.append(SpecError("spec.engine.device", "cuda needs spec.resources.gpus >= 1"))

    auto = spec.get("autoscaling") if isinstance(spec.get("autoscaling"), dict) else {}
    lo, hi = auto.get("minReplicas"), auto.get("maxReplicas")
    if is_int(lo) and is_int(hi) and lo > hi:
        errors.append(SpecError("spec.autoscaling.minReplicas", f"minReplicas ({lo}) must not exceed maxReplicas ({hi})"))

    tuning = spec.get("tuning") if isinstance(spec.get("tuning"), dict) else {}
    rng = tuning.get("maxNumSeqs")
    if rng is not None:
        if not isinstance(rng, dict) or not is_int(rng.get("min")) or not is_int(rng.get("max")):
            errors.append(SpecError("spec.tuning.maxNumSeqs", "needs integer min and max"))
        elif rng["min"] > rng["max"]:
            errors.append(SpecError("spec.tuning.maxNumSeqs.min",
                                    f"min ({rng['min']}) must not exceed max ({rng['max']})"))

    router = spec.get("router") if isinstance(spec.get("router"), dict) else {}
    rate = router.get("rateLimit")
    if rate is not None:
        if not isinstance(rate, dict) or not _POSITIVE[0](rate.get("requestsPerSecond")):
            errors.append(SpecError("spec.router.rateLimit.requestsPerSecond", "must be a number > 0"))
        elif "burst" in rate and not _int_in(1)[0](rate["burst"]):
            errors.append(SpecError("spec.router.rateLimit.burst", "must be an integer >= 1"))
    per_client = router.get("perClientRateLimit")
    if per_client is not None:
        where = "spec.router.perClientRateLimit"
        if not isinstance(per_client, dict) or not _POSITIVE[0](per_client.get("requestsPerSecond")):
            errors.append(SpecError(f"{where}.requestsPerSecond", "must be a number > 0"))
        elif "burst" in per_client and not _int_in(1)[0](per_client["burst"]):
            errors.append(SpecError(f"{where}.burst", "must be an integer >= 1"))
        elif "header" in per_client and not (isinstance(per_client["header"], str)
                                             and _HEADER.match(per_client["header"])):
            errors.append(SpecError(f"{where}.header", "must be an HTTP header name such as X-Tenant"))
    if router.get("tenantLimits") is not None:
        errors += _tenant_limit_errors(router["tenantLimits"])
    return errors


_TENANT = re.compile(r"^\S{1,128}$")


def _tenant_limit_errors(limits: Any) -> list[SpecError]:
    """spec.router.tenantLimits: per-minute numbers > 0, a header name, overrides naming distinct tenants."""
    where = "spec.router.tenantLimits"
    if not isinstance(limits, dict):
        return [SpecError(where, "must be an object")]
    errors: list[SpecError] = []
    for key in ("requestsPerMinute", "tokensPerMinute"):
        if key in limits and not _POSITIVE[0](limits[key]):
            errors.append(SpecError(f"{where}.{key}", "must be a number > 0"))
    if "defaultMaxTokens" in limits and not _int_in(1)[0](limits["defaultMaxTokens"]):
        errors.append(SpecError(f"{where}.defaultMaxTokens", "must be an integer >= 1"))
    if "header" in limits and not (isinstance(limits["header"], str) and _HEADER.match(limits["header"])):
        errors.append(SpecError(f"{where}.header", "must be an HTTP header name such as X-Tenant"))
    overrides = limits.get("overrides")
    if overrides is not None and not isinstance(overrides, list):
        return errors + [SpecError(f"{where}.overrides", "must be a list of {tenant, requestsPerMinute, "
                                                         "tokensPerMinute}")]
    if not any(k in limits for k in ("requestsPerMinute", "tokensPerMinute", "overrides")):
        errors.append(SpecError(where, "needs requestsPerMinute, tokensPerMinute or overrides"))
    seen: set[str] = set()
    for i, item in enumerate(overrides or []):
        at = f"{where}.overrides[{i}]"
        if not isinstance(item, dict) or not (isinstance(item.get("tenant"), str) and _TENANT.match(item["tenant"])):
            errors.append(SpecError(f"{at}.tenant", "is required: the tenant's name, 1-128 characters, no spaces"))
            continue
        if item["tenant"] in seen:
            errors.append(SpecError(f"{at}.tenant", f"tenant {item['tenant']!r} is listed twice"))
        seen.add(item["tenant"])
        present = [k for k in ("requestsPerMinute", "tokensPerMinute") if k in item]
        if not present:
            errors.append(SpecError(at, "needs requestsPerMinute or tokensPerMinute"))
        errors += [SpecError(f"{at}.{k}", "must be a number > 0") for k in present if not _POSITIVE[0](item[k])]
    return errors

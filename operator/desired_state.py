"""Pure reconcile: a PagedModel (plus what was observed) -> the child manifests it asks for.

No I/O here: `desired_state` is a function of its inputs, so it is unit-tested exhaustively and
re-running it yields byte-identical manifests (the basis of idempotent apply). Children:

- engine Deployment `<name>-engine` running `pagedmodel serve`, RollingUpdate maxSurge 1 /
  maxUnavailable 0, with a config-hash annotation on the pod template;
- engine Service `<name>-engine` (what the router discovers) and PodDisruptionBudget;
- router ServiceAccount/Role/RoleBinding/Deployment `<name>-router`;
- public Service `<name>`: selects the router when it is enabled, else the engines directly.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from . import names
from .adapters import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS, adapter_volumes, lora_args, lora_enabled
from .spec import ModelSource, default_block_size, parse_source, with_defaults

MODEL_MOUNT = "/models"
HF_CACHE_MOUNT = "/var/cache/huggingface"
# The root filesystem is read-only and the home under it too: whatever a library caches (Triton's launchers,
# inductor's kernels, anything under XDG's cache) goes to the pod's /tmp emptyDir instead of failing.
SCRATCH_ENV = {"TMPDIR": "/tmp", "XDG_CACHE_HOME": "/tmp/cache", "TRITON_CACHE_DIR": "/tmp/triton",
               "TORCHINDUCTOR_CACHE_DIR": "/tmp/inductor"}
# Probe cadence: /health is cheap; readiness reacts within ~15 s, liveness tolerates a minute of stalls.
STARTUP_PERIOD_S = 5
READINESS = {"periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 3, "successThreshold": 1}
LIVENESS = {"periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6, "successThreshold": 1}
# Engine pods drain for ENGINE_DRAIN_S after SIGTERM (serve --shutdown-timeout, set explicitly so the two
# cannot drift apart); the kubelet's SIGKILL comes SHUTDOWN_MARGIN_S later, leaving time to exit cleanly.
ENGINE_DRAIN_S = 50
SHUTDOWN_MARGIN_S = 10
TERMINATION_GRACE_S = ENGINE_DRAIN_S + SHUTDOWN_MARGIN_S
# The router waits 60 s for running requests after SIGTERM (DRAIN_S in server/router/app.py).
ROUTER_GRACE_S = 60 + SHUTDOWN_MARGIN_S
NON_ROOT_UID = 1000
# Engine fields the tuner may override; anything else in its annotation is ignored.
TUNABLE = frozenset({"maxNumSeqs", "blockSize", "maxNumBatchedTokens", "enablePrefixCaching"})


@dataclass(frozen=True)
class Observed:
    """What the operator saw in the cluster that the desired state depends on.

    engine_replicas: the autoscaler's current choice (status.desiredReplicas) when autoscaling is on.
    tuned: engine overrides from the tuner (camelCase spec.engine keys), applied over the spec.
    router_enabled: whether the operator deploys `pagedmodel router` (--router); without it the public
    Service selects the engines directly and the router Deployment is kept at 0 replicas.
    bind_host: what engines and routers listen on: 0.0.0.0 on real clusters (kubectl port-forward dials
    127.0.0.1 inside the pod), "$(POD_IP)" where pods share one network namespace (hostNetwork pods).
    external_autoscaler: an HPA scales the PagedModel through its scale subresource, so spec.replicas
    (what it writes) is the count, whatever spec.autoscaling says.
    """

    engine_replicas: int | None = None
    tuned: dict[str, Any] = field(default_factory=dict)
    router_enabled: bool = False
    bind_host: str = "0.0.0.0"
    external_autoscaler: bool = False


@dataclass(frozen=True)
class Resolved:
    """What a pass derives from the spec once and hands to every child it builds: the defaulted spec, its
    parsed model source and the engine's effective flags (for the Observed the children are built for)."""

    spec: dict[str, Any]
    source: ModelSource
    engine: dict[str, Any]


def resolve(pm: dict[str, Any], observed: Observed) -> Resolved:
    """Resolved for a PagedModel from scratch, for callers outside a pass (a pass builds it from what it
    already computed)."""
    spec = with_defaults(pm.get("spec"))
    return Resolved(spec, parse_source(spec["model"]["source"]), effective_engine(spec, observed))


def owner_reference(pm: dict[str, Any]) -> dict[str, Any]:
    meta = pm["metadata"]
    return {"apiVersion": names.API_VERSION, "kind": names.KIND, "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def effective_engine(spec: dict[str, Any], observed: Observed) -> dict[str, Any]:
    """spec.engine with the tuner's overrides on top, device resolved against the GPU count, and the
    block size resolved against the device."""
    engine = dict(spec["engine"])
    engine.update({k: v for k, v in observed.tuned.items() if k in TUNABLE})
    engine["extraArgs"] = list(engine.get("extraArgs") or [])
    if engine.get("device", "auto") == "auto":
        engine["device"] = "cuda" if spec["resources"]["gpus"] > 0 else "cpu"
    engine.setdefault("blockSize", default_block_size(engine["device"]))
    if lora_enabled(spec):
        engine.update(enableLora=True, maxLoras=engine.get("maxLoras", DEFAULT_MAX_LORAS),
                      maxLoraRank=engine.get("maxLoraRank", DEFAULT_MAX_LORA_RANK))
    return engine


def engine_args(pm: dict[str, Any], spec: dict[str, Any], engine: dict[str, Any],
                observed: Observed | None = None, source: ModelSource | None = None) -> list[str]:
    """`pagedmodel serve` flags, in a fixed order so equal specs give equal pod templates. `source`: the
    spec's model source, parsed here when the caller has not parsed it already."""
    observed = observed or Observed()
    source = source or parse_source(spec["model"]["source"])
    if source.scheme == "pvc":
        model = f"{MODEL_MOUNT}/{source.path}" if source.path else MODEL_MOUNT
    else:
        model = source.name            # builtin name or hub id: `serve --model` resolves both
    served = spec["model"].get("servedName") or pm["metadata"]["name"]
    args = ["--model", model, "--served-model-name", served,
            "--host", observed.bind_host, "--port", str(names.ENGINE_PORT),
            "--block-size", str(engine["blockSize"]), "--max-num-seqs", str(engine["maxNumSeqs"])]
    for key, flag in (("maxModelLen", "--max-model-len"), ("maxNumBatchedTokens", "--max-num-batched-tokens")):
        if engine.get(key) is not None:
            args += [flag, str(engine[key])]
    if engine["device"] == "cpu":
        args += ["--kv-cache-memory", str(engine["kvCacheMemoryBytes"])] if engine.get("kvCacheMemoryBytes") else []
    else:
        args += ["--gpu-memory-utilization", _num(engine["gpuMemoryUtilization"])]
    args += ["--swap-space", _num(engine["swapSpaceGiB"]), "--dtype", engine["dtype"], "--device", engine["device"]]
    if engine.get("preemptionMode"):
        args += ["--preemption-mode", engine["preemptionMode"]]
    if engine.get("maxQueueLength") is not None:
        args += ["--max-queue-len", str(engine["maxQueueLength"])]
    if engine["enablePrefixCaching"]:
        args.append("--enable-prefix-caching")
    args += lora_args(spec)
    extra = list(engine.get("extraArgs") or [])
    if _drain_override(extra) is None:
        args += ["--shutdown-timeout", str(ENGINE_DRAIN_S)]
    return args + extra


def _drain_override(extra_args: list[str]) -> float | None:
    """The --shutdown-timeout a user put in extraArgs (the last wins, as in argparse), else None."""
    found: float | None = None
    for i, arg in enumerate(extra_args):
        value = arg.split("=", 1)[1] if arg.startswith("--shutdown-timeout=") else (
            extra_args[i + 1] if arg == "--shutdown-timeout" and i + 1 < len(extra_args) else None)
        if value is not None:
            try:
                found = float(value)
            except ValueError:
                continue   # serve itself refuses it, with its own message
    return found


def termination_grace_s(engine: dict[str, Any]) -> int:
    """Grace for engine pods: the drain plus a margin, so a longer --shutdown-timeout in extraArgs is honoured."""
    drain = _drain_override(list(engine.get("extraArgs") or []))
    return TERMINATION_GRACE_S if drain is None else max(TERMINATION_GRACE_S, math.ceil(drain) + SHUTDOWN_MARGIN_S)


def _num(value: float) -> str:
    """0.9 -> '0.9', 4.0 -> '4': stable text for floats that YAML may hand over as ints or floats."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def config_hash(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def engine_replicas(spec: dict[str, Any], observed: Observed) -> int:
    auto = spec["autoscaling"]
    if not auto["enabled"] or observed.external_autoscaler:
        return int(spec["replicas"])
    current = observed.engine_replicas if observed.engine_replicas is not None else auto["minReplicas"]
    return max(auto["minReplicas"], min(auto["maxReplicas"], current))


def _resources(res: dict[str, Any]) -> dict[str, Any]:
    amounts: dict[str, Any] = {}
    for key in ("cpu", "memory"):
        if res.get(key) not in (None, ""):
            amounts[key] = str(res[key])
    if res["gpus"] > 0:
        amounts[res["gpuResourceName"]] = str(res["gpus"])
    # Requests equal limits: a serving replica must not be squeezed by neighbours (Guaranteed QoS with cpu+memory).
    return {"requests": dict(amounts), "limits": dict(amounts)} if amounts else {}


def _pod_security() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": NON_ROOT_UID, "runAsGroup": NON_ROOT_UID, "fsGroup": NON_ROOT_UID,
            "seccompProfile": {"type": "RuntimeDefault"}}


def _container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}


def _scheduling(spec: dict[str, Any]) -> dict[str, Any]:
    sched = spec.get("scheduling") or {}
    out: dict[str, Any] = {}
    if sched.get("nodeSelector"):
        out["nodeSelector"] = dict(sched["nodeSelector"])
    if sched.get("tolerations"):
        out["tolerations"] = [dict(t) for t in sched["tolerations"]]
    if sched.get("priorityClassName"):
        out["priorityClassName"] = sched["priorityClassName"]
    if spec.get("imagePullSecrets"):
        out["imagePullSecrets"] = [{"name": s} for s in spec["imagePullSecrets"]]
    return out


def _metadata(pm: dict[str, Any], name: str, component: str) -> dict[str, Any]:
    return {"name": name, "namespace": pm["metadata"]["namespace"],
            "labels": names.labels(pm["metadata"]["name"], component), "ownerReferences": [owner_reference(pm)]}


def engine_deployment(pm: dict[str, Any], resolved: Resolved, observed: Observed) -> dict[str, Any]:
    model = pm["metadata"]["name"]
    spec, engine, source = resolved.spec, resolved.engine, resolved.source
    args = engine_args(pm, spec, engine, observed, source)
    http = {"path": "/health", "port": "http"}
    volumes = [{"name": "tmp", "emptyDir": {}}]
    mounts = [{"name": "tmp", "mountPath": "/tmp"}]
    env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           *({"name": name, "value": value} for name, value in SCRATCH_ENV.items())]
    if source.scheme == "hf" or lora_enabled(spec):
        # The root filesystem is read-only: hub downloads (the model's, or hf:// adapters') go to a writable
        # scratch volume. Every LoRA engine gets it, so the first hf:// adapter added rolls nothing.
        env.append({"name": "HF_HOME", "value": HF_CACHE_MOUNT})
        volumes.append({"name": "hf-cache", "emptyDir": {}})
        mounts.append({"name": "hf-cache", "mountPath": HF_CACHE_MOUNT})
    if source.scheme == "pvc":
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": source.name, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    adapter_vols, adapter_mounts = adapter_volumes(spec)
    volumes += adapter_vols
    mounts += adapter_mounts
    container: dict[str, Any] = {
        "name": "engine",
        "image": spec["image"],
        "imagePullPolicy": spec["imagePullPolicy"],
        "command": ["pagedmodel", "serve"],
        "args": args,
        "env": env,
        "ports": [{"name": "http", "containerPort": names.ENGINE_PORT, "protocol": "TCP"}],
        "startupProbe": {"httpGet": http, "periodSeconds": STARTUP_PERIOD_S, "timeoutSeconds": 3,
                         "failureThreshold": math.ceil(spec["probes"]["startupTimeoutSeconds"] / STARTUP_PERIOD_S)},
        "readinessProbe": {"httpGet": http, **READINESS},
        "livenessProbe": {"httpGet": http, **LIVENESS},
        "securityContext": _container_security(),
        "volumeMounts": mounts,
        # A failed start's one-line reason (the log's tail) lands in lastState.terminated.message: status.py
        # carries it to the PagedModel's status and events, so `kubectl describe pm` says why.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    resources = _resources(spec["resources"])
    if resources:
        container["resources"] = resources
    template_hash = config_hash({"image": spec["image"], "args": args, "resources": resources})
    annotations = {names.ANNOTATION_CONFIG_HASH: template_hash, "prometheus.io/scrape": "true",
                   "prometheus.io/port": str(names.ENGINE_PORT), "prometheus.io/path": "/metrics"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {**_metadata(pm, names.engine_name(model), names.ENGINE),
                     "annotations": {names.ANNOTATION_ENGINE: json.dumps(engine, sort_keys=True)}},
        "spec": {
            "replicas": engine_replicas(spec, observed),
            "selector": {"matchLabels": names.selector_labels(model, names.ENGINE)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 5,
            "template": {
                "metadata": {"labels": names.labels(model, names.ENGINE), "annotations": annotations},
                "spec": {
                    "automountServiceAccountToken": False,     # engines never call the API server
                    "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": termination_grace_s(engine),
                    "securityContext": _pod_security(),
                    "containers": [container],
                    "volumes": volumes,
                    **_scheduling(spec),
                },
            },
        },
    }


def engine_service(pm: dict[str, Any]) -> dict[str, Any]:
    model = pm["metadata"]["name"]
    return {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(pm, names.engine_name(model), names.ENGINE),
            "spec": {"type": "ClusterIP", "selector": names.selector_labels(model, names.ENGINE),
                     "ports": [{"name": "http", "port": names.ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}]}}


def engine_pdb(pm: dict[str, Any]) -> dict[str, Any]:
    model = pm["metadata"]["name"]
    # One engine at a time may be evicted: drains proceed, capacity never drops by more than a replica.
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _metadata(pm, names.engine_name(model), names.ENGINE),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": names.selector_labels(model, names.ENGINE)}}}


def router_args(pm: dict[str, Any], spec: dict[str, Any], observed: Observed) -> list[str]:
    router = spec["router"]
    model = pm["metadata"]["name"]
    args = ["--host", observed.bind_host, "--port", str(names.ENGINE_PORT),
            "--discover", names.selector_string(model, names.ENGINE), "--strategy", router["strategy"],
            "--max-queue-len", str(router["maxQueueLength"]), "--queue-timeout", _num(router["queueTimeoutSeconds"])]
    if pm["metadata"].get("namespace"):  # discover engines in the model's namespace, whatever the pod can infer
        args += ["--namespace", pm["metadata"]["namespace"]]
    if router.get("rateLimit"):
        args += ["--rate-limit", _num(router["rateLimit"]["requestsPerSecond"])]
        if router["rateLimit"].get("burst") is not None:
            args += ["--burst", str(router["rateLimit"]["burst"])]
    per_client = router.get("perClientRateLimit")
    if per_client:
        args += ["--client-rate-limit", _num(per_client["requestsPerSecond"])]
        if per_client.get("burst") is not None:
            args += ["--client-burst", str(per_client["burst"])]
        if per_client.get("header"):
            args += ["--client-header", per_client["header"]]
    if router.get("tenantLimits"):
        args += tenant_limit_args(router["tenantLimits"], router["replicas"])
    return args


def tenant_limit_args(limits: dict[str, Any], routers: int) -> list[str]:
    """The router flags for spec.router.tenantLimits. The limits are the model's: each of N router replicas
    enforces 1/N of every one, so the total holds when the Service spreads a tenant's requests evenly."""
    share = max(1, routers)
    args = ["--tenant-header", limits["header"]] if limits.get("header") else []
    for key, flag in (("requestsPerMinute", "--tenant-requests-per-minute"),
                      ("tokensPerMinute", "--tenant-tokens-per-minute")):
        if limits.get(key) is not None:
            args += [flag, _num(limits[key] / share)]
    if limits.get("defaultMaxTokens") is not None:
        args += ["--default-max-tokens", str(limits["defaultMaxTokens"])]
    for item in limits.get("overrides") or []:
        parts = [f"{word}={_num(item[key] / share)}" for key, word in (("requestsPerMinute", "requests"),
                                                                      ("tokensPerMinute", "tokens"))
                 if item.get(key) is not None]
        args += ["--tenant-limit", f"{item['tenant']}:{','.join(parts)}"]
    return args


def router_rbac(pm: dict[str, Any]) -> list[dict[str, Any]]:
    """The router discovers engine pods through the API: read-only access to pods and endpoints, nothing else."""
    model = pm["metadata"]["name"]
    name = names.router_name(model)
    meta = _metadata(pm, name, names.ROUTER)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta, "automountServiceAccountToken": True},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta,
         "rules": [{"apiGroups": [""], "resources": ["pods", "endpoints"], "verbs": ["get", "list", "watch"]},
                   {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": pm["metadata"]["namespace"]}]},
    ]


def router_deployment(pm: dict[str, Any], spec: dict[str, Any], observed: Observed) -> dict[str, Any]:
    model = pm["metadata"]["name"]
    http = {"path": "/health", "port": "http"}
    container = {
        "name": "router", "image": spec["image"], "imagePullPolicy": spec["imagePullPolicy"],
        "command": ["pagedmodel", "router"], "args": router_args(pm, spec, observed),
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "http", "containerPort": names.ENGINE_PORT, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": http, **READINESS},
        "livenessProbe": {"httpGet": http, **LIVENESS},
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
        "securityContext": _container_security(),
    }
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _metadata(pm, names.router_name(model), names.ROUTER),
        "spec": {
            "replicas": spec["router"]["replicas"] if observed.router_enabled else 0,
            "selector": {"matchLabels": names.selector_labels(model, names.ROUTER)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 5,
            "template": {
                "metadata": {"labels": names.labels(model, names.ROUTER),
                             "annotations": {"prometheus.io/scrape": "true",
                                             "prometheus.io/port": str(names.ENGINE_PORT),
                                             "prometheus.io/path": "/metrics"}},
                "spec": {"serviceAccountName": names.router_name(model), "enableServiceLinks": False,
                         "terminationGracePeriodSeconds": ROUTER_GRACE_S,
                         "securityContext": _pod_security(), "containers": [container],
                         **({"imagePullSecrets": [{"name": s} for s in spec["imagePullSecrets"]]}
                            if spec.get("imagePullSecrets") else {})},
            },
        },
    }


def public_service(pm: dict[str, Any], spec: dict[str, Any], observed: Observed) -> dict[str, Any]:
    model = pm["metadata"]["name"]
    target = names.ROUTER if observed.router_enabled else names.ENGINE
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _metadata(pm, names.public_service_name(model), target),
            "spec": {"type": spec["service"]["type"], "selector": names.selector_labels(model, target),
                     "ports": [{"name": "http", "port": spec["service"]["port"], "targetPort": "http",
                                "protocol": "TCP"}]}}


def desired_state(pm: dict[str, Any], observed: Observed | None = None,
                  resolved: Resolved | None = None) -> list[dict[str, Any]]:
    """Every child manifest of a (valid) PagedModel, in apply order: RBAC, engines, router, Services, PDB.
    A reconcile pass passes the `resolved` spec it computed; without it the spec is resolved here."""
    observed = observed or Observed()
    resolved = resolved or resolve(pm, observed)
    spec = resolved.spec
    return [
        *router_rbac(pm),
        engine_deployment(pm, resolved, observed),
        engine_service(pm),
        router_deployment(pm, spec, observed),
        public_service(pm, spec, observed),
        engine_pdb(pm),
    ]


def service_url(pm: dict[str, Any], spec: dict[str, Any] | None = None) -> str:
    """The model's in-cluster endpoint; `spec`: the defaulted spec, when the caller has it."""
    spec = spec if spec is not None else with_defaults(pm.get("spec"))
    meta = pm["metadata"]
    port = spec["service"]["port"]
    return f"http://{names.public_service_name(meta['name'])}.{meta['namespace']}.svc:{port}/v1"

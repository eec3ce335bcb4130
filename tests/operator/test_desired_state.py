"""desired_state.py: the manifests are exactly what the spec asks for, and recomputing them changes nothing."""
from __future__ import annotations

import copy
from typing import Any

import pytest

from pagedmodel.operator import names
from pagedmodel.operator.desired_state import Observed, desired_state, engine_args, service_url
from pagedmodel.operator.spec import with_defaults

from pm_factory import make_pm

CPU_SPEC = {"model": {"source": "builtin://smollm2", "servedName": "smol"},
            "engine": {"maxNumSeqs": 4, "maxModelLen": 256, "kvCacheMemoryBytes": 16_000_000, "swapSpaceGiB": 0,
                       "device": "cpu"},
            "resources": {"gpus": 0, "cpu": "1", "memory": "2Gi"}}


def by_kind(manifests: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(m["kind"], m["metadata"]["name"]): m for m in manifests}


def engine(pm: dict[str, Any], observed: Observed | None = None) -> dict[str, Any]:
    return by_kind(desired_state(pm, observed))[("Deployment", f"{pm['metadata']['name']}-engine")]


def container(pm: dict[str, Any], observed: Observed | None = None) -> dict[str, Any]:
    return engine(pm, observed)["spec"]["template"]["spec"]["containers"][0]


def flags(args: list[str]) -> dict[str, str | bool]:
    """--flag value pairs (and bare switches as True) from an argument list."""
    out: dict[str, str | bool] = {}
    i = 0
    while i < len(args):
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            out[args[i]] = args[i + 1]
            i += 2
        else:
            out[args[i]] = True
            i += 1
    return out


def test_children_set_names_and_order():
    manifests = desired_state(make_pm())
    assert [(m["kind"], m["metadata"]["name"]) for m in manifests] == [
        ("ServiceAccount", "smollm2-router"), ("Role", "smollm2-router"), ("RoleBinding", "smollm2-router"),
        ("Deployment", "smollm2-engine"), ("Service", "smollm2-engine"), ("Deployment", "smollm2-router"),
        ("Service", "smollm2"), ("PodDisruptionBudget", "smollm2-engine")]


def test_every_child_is_owned_labelled_and_namespaced():
    pm = make_pm(uid="u-42", namespace="team-a")
    for m in desired_state(pm):
        meta = m["metadata"]
        assert meta["namespace"] == "team-a"
        assert meta["ownerReferences"] == [{"apiVersion": "pagedmodel.io/v1alpha1", "kind": "PagedModel",
                                            "name": "smollm2", "uid": "u-42", "controller": True,
                                            "blockOwnerDeletion": True}]
        assert meta["labels"]["pagedmodel.io/name"] == "smollm2"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "pagedmodel-operator"


def test_cpu_engine_flags_are_exactly_the_spec():
    c = container(make_pm(CPU_SPEC))
    assert c["command"] == ["pagedmodel", "serve"]
    assert flags(c["args"]) == {
        "--model": "smollm2", "--served-model-name": "smol", "--host": "0.0.0.0", "--port": "8000",
        "--block-size": "128", "--max-num-seqs": "4", "--max-model-len": "256", "--kv-cache-memory": "16000000",
        "--swap-space": "0", "--dtype": "auto", "--device": "cpu", "--enable-prefix-caching": True,
        "--shutdown-timeout": "50"}
    assert c["env"][0] == {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    assert c["resources"] == {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"cpu": "1", "memory": "2Gi"}}


def test_every_scratch_path_of_the_engine_is_on_its_tmp_volume():
    """The root filesystem is read-only: each cache a library may write points under the /tmp emptyDir."""
    pod = make_pm(CPU_SPEC)
    c = container(pod)
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    tmp = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "tmp")
    scratch = {e["name"]: e["value"] for e in c["env"] if e["name"] in
               ("TMPDIR", "XDG_CACHE_HOME", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
    assert len(scratch) == 4 and all(value.startswith(tmp) for value in scratch.values()), scratch


@pytest.mark.parametrize("engine_spec, gpus, block", [
    ({"device": "cpu"}, 0, "128"),           # unset: the engine's CPU default, not the GPU one
    ({}, 0, "128"),                          # device auto without GPUs is a CPU engine
    ({}, 1, "16"),                           # device auto with a GPU
    ({"device": "cpu", "blockSize": 32}, 0, "32"),   # a blockSize in the spec is kept
])
def test_an_unset_block_size_is_the_engines_default_for_its_device(engine_spec, gpus, block):
    spec = {"model": {"source": "builtin://smollm2"}, "engine": engine_spec, "resources": {"gpus": gpus}}
    assert flags(container(make_pm(spec))["args"])["--block-size"] == block


@pytest.mark.parametrize("extra, drain, grace", [
    ([], "50", 60),                                    # the default drain ends 10 s before the SIGKILL
    (["--shutdown-timeout", "300"], None, 310),        # the user's longer drain gets a grace to match
    (["--shutdown-timeout=5"], None, 60),              # a shorter one keeps the default grace
])
def test_engine_drain_ends_before_the_kubelets_sigkill(extra, drain, grace):
    spec = copy.deepcopy(CPU_SPEC)
    spec["engine"]["extraArgs"] = extra
    deployment = engine(make_pm(spec))
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args.count("--shutdown-timeout") + sum(a.startswith("--shutdown-timeout=") for a in args) == 1
    if drain is not None:
        assert flags(args)["--shutdown-timeout"] == drain
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == grace


def test_gpu_engine_flags_resources_and_optional_flags():
    spec = {"model": {"source": "pvc://weights/llama/1b"},
            "engine": {"blockSize": 32, "maxNumSeqs": 128, "maxNumBatchedTokens": 4096, "gpuMemoryUtilization": 0.85,
                       "enablePrefixCaching": False, "preemptionMode": "recompute", "dtype": "bfloat16",
                       "maxQueueLength": 64, "extraArgs": ["--log-level=debug"]},
            "resources": {"gpus": 2, "gpuResourceName": "amd.com/gpu", "memory": "32Gi"}}
    c = container(make_pm(spec, name="llama"))
    f = flags(c["args"])
    assert f["--model"] == "/models/llama/1b" and f["--served-model-name"] == "llama"
    assert f["--device"] == "cuda" and f["--gpu-memory-utilization"] == "0.85" and "--kv-cache-memory" not in f
    assert f["--block-size"] == "32" and f["--max-num-batched-tokens"] == "4096" and f["--max-queue-len"] == "64"
    assert f["--preemption-mode"] == "recompute" and f["--dtype"] == "bfloat16" and f["--swap-space"] == "4"
    assert "--enable-prefix-caching" not in f and c["args"][-1] == "--log-level=debug"
    assert c["resources"]["limits"] == {"memory": "32Gi", "amd.com/gpu": "2"}
    assert c["resources"]["requests"] == c["resources"]["limits"]
    pod = engine(make_pm(spec, name="llama"))["spec"]["template"]["spec"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in pod["volumes"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]


def test_pod_ip_binding_for_shared_network_nodes():
    obs = Observed(bind_host="$(POD_IP)", router_enabled=True)
    manifests = by_kind(desired_state(make_pm(CPU_SPEC), obs))
    for name in ("smollm2-engine", "smollm2-router"):
        c = manifests[("Deployment", name)]["spec"]["template"]["spec"]["containers"][0]
        assert flags(c["args"])["--host"] == "$(POD_IP)"
        assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in c["env"]


def test_hf_source_gets_a_writable_hub_cache():
    c = container(make_pm({"model": {"source": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"}}))
    assert flags(c["args"])["--model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert {"name": "HF_HOME", "value": "/var/cache/huggingface"} in c["env"]
    assert {"name": "hf-cache", "mountPath": "/var/cache/huggingface"} in c["volumeMounts"]


def test_probes_are_sized_for_slow_loads():
    c = container(make_pm({"model": {"source": "builtin://smollm2"}, "probes": {"startupTimeoutSeconds": 600}}))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] == 600
    assert c["readinessProbe"]["periodSeconds"] == 5
    assert c["livenessProbe"]["periodSeconds"] * c["livenessProbe"]["failureThreshold"] >= 60


def test_deployment_strategy_security_and_metrics_annotations():
    dep = engine(make_pm(CPU_SPEC))
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert dep["spec"]["selector"] == {"matchLabels": {"pagedmodel.io/name": "smollm2",
                                                       "app.kubernetes.io/component": "engine"}}
    tmpl = dep["spec"]["template"]
    assert tmpl["metadata"]["labels"]["app.kubernetes.io/component"] == "engine"
    ann = tmpl["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "8000"
    assert len(ann[names.ANNOTATION_CONFIG_HASH]) == 16
    pod = tmpl["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["automountServiceAccountToken"] is False
    c = pod["containers"][0]
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]     # read-only root still needs scratch
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]


def test_scheduling_and_pull_secrets_reach_the_pod():
    spec = {**CPU_SPEC, "imagePullSecrets": ["regcred"],
            "scheduling": {"nodeSelector": {"gpu": "h100"}, "priorityClassName": "serving",
                           "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]}}
    pod = engine(make_pm(spec))["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"gpu": "h100"} and pod["priorityClassName"] == "serving"
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists"}]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]


@pytest.mark.parametrize("auto, observed, expected", [
    ({"enabled": False}, None, 3),
    ({"enabled": True, "minReplicas": 2, "maxReplicas": 5}, None, 2),
    ({"enabled": True, "minReplicas": 2, "maxReplicas": 5}, 4, 4),
    ({"enabled": True, "minReplicas": 2, "maxReplicas": 5}, 9, 5),
    ({"enabled": True, "minReplicas": 2, "maxReplicas": 5}, 0, 2),
])
def test_replicas_follow_spec_or_autoscaler_within_bounds(auto, observed, expected):
    pm = make_pm({**CPU_SPEC, "replicas": 3, "autoscaling": auto})
    assert engine(pm, Observed(engine_replicas=observed))["spec"]["replicas"] == expected


def test_tuned_overrides_apply_only_to_tunable_fields():
    obs = Observed(tuned={"maxNumSeqs": 64, "blockSize": 32, "device": "cuda"})
    f = flags(container(make_pm(CPU_SPEC), obs)["args"])
    assert f["--max-num-seqs"] == "64" and f["--block-size"] == "32" and f["--device"] == "cpu"


def test_router_shape_and_public_service_target():
    pm = make_pm({**CPU_SPEC, "router": {"replicas": 2, "strategy": "least-load",
                                         "rateLimit": {"requestsPerSecond": 50, "burst": 100},
                                         "perClientRateLimit": {"requestsPerSecond": 2.5, "burst": 5,
                                                                "header": "X-Tenant"}}})
    off = by_kind(desired_state(pm, Observed(router_enabled=False)))
    on = by_kind(desired_state(pm, Observed(router_enabled=True)))
    assert off[("Deployment", "smollm2-router")]["spec"]["replicas"] == 0
    assert on[("Deployment", "smollm2-router")]["spec"]["replicas"] == 2
    assert off[("Service", "smollm2")]["spec"]["selector"]["app.kubernetes.io/component"] == "engine"
    assert on[("Service", "smollm2")]["spec"]["selector"]["app.kubernetes.io/component"] == "router"
    rc = on[("Deployment", "smollm2-router")]["spec"]["template"]["spec"]
    assert rc["serviceAccountName"] == "smollm2-router"
    # its in-flight streams get the router's whole drain before the kubelet's SIGKILL
    from pagedmodel.server.router.app import DRAIN_S
    assert rc["terminationGracePeriodSeconds"] > DRAIN_S
    f = flags(rc["containers"][0]["args"])
    assert f["--discover"] == "app.kubernetes.io/component=engine,pagedmodel.io/name=smollm2"
    assert f["--strategy"] == "least-load" and f["--rate-limit"] == "50" and f["--burst"] == "100"
    assert f["--namespace"] == pm["metadata"]["namespace"]   # engines are found in the model's namespace
    assert f["--client-rate-limit"] == "2.5" and f["--client-burst"] == "5" and f["--client-header"] == "X-Tenant"
    role = on[("Role", "smollm2-router")]
    assert all(set(r["verbs"]) == {"get", "list", "watch"} for r in role["rules"])
    svc = on[("Service", "smollm2")]["spec"]
    assert svc["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]


def test_tenant_limits_are_shared_out_between_router_replicas():
    import argparse

    from pagedmodel.server.router.app import add_arguments, config_from_args
    from pagedmodel.server.router.token_limits import Limits
    limits = {"header": "X-Tenant", "requestsPerMinute": 600, "tokensPerMinute": 90000, "defaultMaxTokens": 128,
              "overrides": [{"tenant": "acme", "tokensPerMinute": 30000}, {"tenant": "key-0123456789ab",
                                                                          "requestsPerMinute": 60}]}
    for routers in (1, 3):
        pm = make_pm({**CPU_SPEC, "router": {"replicas": routers, "tenantLimits": limits}})
        out = by_kind(desired_state(pm, Observed(router_enabled=True)))
        args = out[("Deployment", "smollm2-router")]["spec"]["template"]["spec"]["containers"][0]["args"]
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        cfg = config_from_args(parser.parse_args(args))     # the router accepts what the operator renders
        assert cfg.tenant_header == "X-Tenant" and cfg.default_max_tokens == 128
        # every router enforces 1/N, so N routers together hold the model's limits
        assert cfg.tenant_requests_per_minute * routers == pytest.approx(600)
        assert cfg.tenant_tokens_per_minute * routers == pytest.approx(90000)
        assert cfg.tenant_overrides["acme"] == Limits(None, 30000 / routers)
        assert cfg.tenant_overrides["key-0123456789ab"] == Limits(60 / routers, None)
    pm = make_pm({**CPU_SPEC, "router": {"replicas": 2}})
    args = by_kind(desired_state(pm, Observed(router_enabled=True)))[("Deployment", "smollm2-router")]
    assert not any(a.startswith("--tenant") for a in args["spec"]["template"]["spec"]["containers"][0]["args"])


def test_pdb_allows_one_engine_down():
    pdb = by_kind(desired_state(make_pm()))[("PodDisruptionBudget", "smollm2-engine")]
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": {
        "pagedmodel.io/name": "smollm2", "app.kubernetes.io/component": "engine"}}}


def test_reconcile_is_deterministic_and_does_not_mutate_input():
    pm = make_pm(CPU_SPEC)
    before = copy.deepcopy(pm)
    assert desired_state(pm) == desired_state(copy.deepcopy(pm))
    assert pm == before


def test_engine_flag_changes_change_the_template_hash_and_nothing_else_does():
    def template_hash(spec: dict[str, Any]) -> str:
        return engine(make_pm(spec))["spec"]["template"]["metadata"]["annotations"][names.ANNOTATION_CONFIG_HASH]

    base = template_hash(CPU_SPEC)
    assert template_hash({**CPU_SPEC, "engine": {**CPU_SPEC["engine"], "maxNumSeqs": 8}}) != base
    assert template_hash({**CPU_SPEC, "image": "registry/pm:2"}) != base
    assert template_hash({**CPU_SPEC, "replicas": 5}) == base
    assert template_hash({**CPU_SPEC, "router": {"replicas": 3}}) == base


def test_floats_render_stably():
    spec = {"model": {"source": "builtin://smollm2"}, "engine": {"swapSpaceGiB": 4.0, "gpuMemoryUtilization": 1}}
    full = with_defaults(spec)
    f = flags(engine_args(make_pm(spec), full, {**full["engine"], "device": "cuda", "blockSize": 16}))
    assert f["--swap-space"] == "4" and f["--gpu-memory-utilization"] == "1"


def test_service_url():
    assert service_url(make_pm(namespace="team-a")) == "http://smollm2.team-a.svc:80/v1"

"""The PagedModel operator end to end, driven through kubectl: CRD validation, a served model, rollouts,
an operator restart mid-rollout, and deletion.

The operator runs as a real `pagedmodel operator` process watching the test's namespace; its engine pods
run `pagedmodel serve` in the chart's image on the real node (SmolLM2-135M on CPU, tiny KV cache).
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import yaml

from .helpers import wait_until

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "pagedmodel.yaml"
EXAMPLE = REPO / "examples" / "cpu-tiny.yaml"
NAME = "smollm2-cpu"                 # metadata.name in the example



@pytest.fixture(scope="module")
def pagedmodel_crd(cluster):
    """The repository's CRD, applied (or updated) for the session's cluster and left installed: deleting a CRD
    is slow (its objects go first) and the chart test installs the same CRD through Helm."""
    cluster.kubectl("apply", "-f", str(CRD))
    cluster.kubectl("wait", "--for=condition=Established", "crd/pagedmodels.pagedmodel.io", "--timeout=30s")
    yield


@contextlib.contextmanager
def operator(cluster, namespace: str, log: Path, router: str = "disabled") -> Iterator[subprocess.Popen[bytes]]:
    """`pagedmodel operator` for one namespace; SIGTERM (then SIGKILL) on exit."""
    env = dict(cluster.env(), OMP_NUM_THREADS="1")
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pagedmodel.cli", "operator", "-n", namespace,
                                 "--status-interval", "1", "--router", router],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def pm_json(cluster, namespace: str, name: str = NAME) -> dict[str, Any]:
    return cluster.kubectl_json("get", "pm", name, namespace=namespace)


def wait_phase(cluster, namespace: str, phase: str, generation: int | None = None, name: str = NAME,
               timeout: float = 120) -> dict[str, Any]:
    def check():
        pm = pm_json(cluster, namespace, name)
        st = pm.get("status") or {}
        if st.get("phase") != phase:
            return None
        if generation is not None and st.get("observedGeneration") != generation:
            return None
        return pm
    return wait_until(check, timeout=timeout, interval=0.5, what=f"PagedModel {name} phase {phase}")


def children(cluster, namespace: str) -> dict[str, list[str]]:
    out = {}
    for kind in ("deployments", "services", "poddisruptionbudgets", "serviceaccounts", "roles", "rolebindings"):
        items = cluster.kubectl_json("get", kind, "-l", f"pagedmodel.io/name={NAME}", namespace=namespace)["items"]
        out[kind] = sorted(i["metadata"]["name"] for i in items)
    return out


EXPECTED_CHILDREN = {
    "deployments": [f"{NAME}-engine", f"{NAME}-router"],
    "services": [NAME, f"{NAME}-engine"],
    "poddisruptionbudgets": [f"{NAME}-engine"],
    "serviceaccounts": [f"{NAME}-router"],
    "roles": [f"{NAME}-router"],
    "rolebindings": [f"{NAME}-router"],
}


def engine_pods(cluster, namespace: str) -> list[dict[str, Any]]:
    return cluster.kubectl_json("get", "pods", "-l", f"pagedmodel.io/name={NAME},app.kubernetes.io/component=engine",
                                namespace=namespace)["items"]


def flag(pod: dict[str, Any], name: str) -> str:
    args = pod["spec"]["containers"][0]["args"]
    return args[args.index(name) + 1]


def untouched_versions(cluster, namespace: str) -> dict[str, dict[str, str]]:
    """Versions of the children a maxNumSeqs change must not rewrite: the resourceVersion of Services and
    Roles (nobody else writes them); the PDB's generation, since the disruption controller keeps writing
    its status (and so its resourceVersion) as engine pods come and go."""
    field = {"services": "resourceVersion", "roles": "resourceVersion", "poddisruptionbudgets": "generation"}
    return {kind: {i["metadata"]["name"]: str(i["metadata"][key]) for i in cluster.kubectl_json(
        "get", kind, "-l", f"pagedmodel.io/name={NAME}", namespace=namespace)["items"]} for kind, key in field.items()}


def events(cluster, namespace: str) -> list[dict[str, Any]]:
    return cluster.kubectl_json("get", "events", "--field-selector", f"involvedObject.name={NAME}",
                                namespace=namespace)["items"]


@pytest.mark.slow
def test_pagedmodel_lifecycle(cluster, namespace, pagedmodel_crd, tmp_path):
    log = tmp_path / "operator.log"
    with operator(cluster, namespace, log) as op:
        applied = cluster.kubectl("apply", "-f", str(EXAMPLE), namespace=namespace)
        assert f"pagedmodel.pagedmodel.io/{NAME} created" in applied.stdout

        # Children appear with owner references to the PagedModel.
        wait_until(lambda: children(cluster, namespace) == EXPECTED_CHILDREN, timeout=30, what="children created")
        uid = pm_json(cluster, namespace)["metadata"]["uid"]
        engine = cluster.kubectl_json("get", "deployment", f"{NAME}-engine", namespace=namespace)
        assert engine["metadata"]["ownerReferences"][0]["uid"] == uid
        assert engine["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}

        # The engine pod is a real `pagedmodel serve`; the model becomes Ready.
        pm = wait_phase(cluster, namespace, "Ready", generation=1, timeout=180)
        st = pm["status"]
        assert st["ready"] == "1/1" and st["readyReplicas"] == 1 and st["desiredReplicas"] == 1
        assert st["selector"] == f"app.kubernetes.io/component=engine,pagedmodel.io/name={NAME}"
        assert st["url"] == f"http://{NAME}.{namespace}.svc:80/v1"
        assert st["engine"]["maxNumSeqs"] == 4 and st["engine"]["device"] == "cpu"
        conditions = {c["type"]: c["status"] for c in st["conditions"]}
        assert {t: conditions[t] for t in ("Ready", "Available", "Progressing", "Degraded")} == {
            "Ready": "True", "Available": "True", "Progressing": "False", "Degraded": "False"}

        # Printer columns (metrics come from the timer's scrape of the engine) and short name.
        pm = wait_until(lambda: (lambda p: p if "metrics" in p["status"] else None)(pm_json(cluster, namespace)),
                        timeout=30, what="status.metrics scraped from the engine")
        assert pm["status"]["metrics"]["stale"] is False and pm["status"]["metrics"]["waiting"] == 0
        conditions = {c["type"]: c for c in pm["status"]["conditions"]}
        assert conditions["MetricsAvailable"]["status"] == "True", conditions
        assert conditions["ScalingActive"]["reason"] == "Disabled"      # autoscaling is off in the example
        table = cluster.kubectl("get", "pm", namespace=namespace).stdout.splitlines()
        assert table[0].split() == ["NAME", "MODEL", "READY", "KV%", "WAITING", "ADAPTERS", "PHASE", "AGE"]
        row = table[1].split()      # no spec.adapters: the ADAPTERS column is blank
        assert row[:3] == [NAME, "builtin://smollm2", "1/1"] and row[4:6] == ["0", "Ready"], table
        assert row[3].isdigit() and 0 <= int(row[3]) <= 100, table
        wide = cluster.kubectl("get", "pm", "-o", "wide", namespace=namespace).stdout.splitlines()
        assert wide[0].split()[-1] == "URL" and wide[1].split()[-1] == f"http://{NAME}.{namespace}.svc:80/v1"
        assert NAME in cluster.kubectl("get", "pagedmodel", namespace=namespace).stdout   # category works too

        # describe: conditions and the operator's events.
        described = cluster.kubectl("describe", "pm", NAME, namespace=namespace).stdout
        for text in ("Conditions:", "AllReplicasReady", "Created", f"created ServiceAccount/{NAME}-router"):
            assert text in described, described

        # A completion through the model's Service.
        with cluster.service_url(namespace, NAME, 80) as url:
            reply = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": "smollm2", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"].strip().startswith("Paris")

        # Changing maxNumSeqs rolls the engines; restart the operator in the middle of the rollout.
        before = untouched_versions(cluster, namespace)
        old_pod = engine_pods(cluster, namespace)[0]["metadata"]["name"]
        cluster.kubectl("patch", "pm", NAME, "--type=merge", "-p", '{"spec":{"engine":{"maxNumSeqs":8}}}',
                        namespace=namespace)
        wait_until(lambda: any(flag(p, "--max-num-seqs") == "8" for p in engine_pods(cluster, namespace)),
                   timeout=30, what="a pod with the new flag")
        # kopf posts events from a queue: let this one land before the kill (a SIGKILL may drop queued events).
        wait_until(lambda: any("maxNumSeqs 4 -> 8" in e["message"] for e in events(cluster, namespace)
                               if e["reason"] == "EngineArgsChanged"), timeout=30, what="EngineArgsChanged event")
        assert pm_json(cluster, namespace)["status"]["phase"] != "Ready" or len(engine_pods(cluster, namespace)) > 1
        stop(op, signal.SIGKILL)           # mid-rollout, no graceful shutdown
    with operator(cluster, namespace, log):
        pm = wait_phase(cluster, namespace, "Ready", generation=2, timeout=180)
        assert pm["status"]["engine"]["maxNumSeqs"] == 8
        pods = wait_until(lambda: (lambda ps: ps if len(ps) == 1 else None)(engine_pods(cluster, namespace)),
                          timeout=60, what="old engine pod gone")
        assert pods[0]["metadata"]["name"] != old_pod and flag(pods[0], "--max-num-seqs") == "8"
        assert children(cluster, namespace) == EXPECTED_CHILDREN          # no duplicates after the restart
        after = untouched_versions(cluster, namespace)
        assert after == before             # untouched children were not rewritten by either operator
        assert "Updated" in [e["reason"] for e in events(cluster, namespace)]

        # Deleting the PagedModel removes every child.
        cluster.kubectl("delete", "pm", NAME, "--timeout=60s", namespace=namespace, timeout=70)
        wait_until(lambda: all(v == [] for v in children(cluster, namespace).values()), timeout=60,
                   what="children garbage-collected")
        wait_until(lambda: engine_pods(cluster, namespace) == [], timeout=60, what="engine pods gone")
    assert "Traceback" not in log.read_text(errors="replace"), log.read_text(errors="replace")[-4000:]


def _pm(spec: dict[str, Any], name: str = "bad") -> str:
    return yaml.safe_dump({"apiVersion": "pagedmodel.io/v1alpha1", "kind": "PagedModel",
                           "metadata": {"name": name}, "spec": spec})


OK_MODEL = {"source": "builtin://smollm2"}
# (spec, field the API server's message must name)
REJECTED_AT_APPLY = [
    ({}, "spec.model"),
    ({"model": {"source": "s3://bucket/x"}}, "spec.model.source"),
    ({"model": {"source": 42}}, "spec.model.source"),
    ({"model": OK_MODEL, "engine": {"blockSize": 12}}, "spec.engine.blockSize"),
    ({"model": OK_MODEL, "engine": {"maxNumSeqs": 0}}, "spec.engine.maxNumSeqs"),
    ({"model": OK_MODEL, "engine": {"maxNumSeqs": "many"}}, "spec.engine.maxNumSeqs"),
    ({"model": OK_MODEL, "engine": {"gpuMemoryUtilization": 0}}, "spec.engine.gpuMemoryUtilization"),
    ({"model": OK_MODEL, "engine": {"gpuMemoryUtilization": 1.2}}, "spec.engine.gpuMemoryUtilization"),
    ({"model": OK_MODEL, "engine": {"dtype": "int3"}}, "spec.engine.dtype"),
    ({"model": OK_MODEL, "engine": {"enablePrefixCaching": "yes"}}, "spec.engine.enablePrefixCaching"),
    ({"model": OK_MODEL, "engine": {"tensorParallelSize": 2}}, "spec.engine.tensorParallelSize"),
    ({"model": OK_MODEL, "replicas": -1}, "spec.replicas"),
    ({"model": OK_MODEL, "resources": {"memory": "lots"}}, "spec.resources.memory"),
    ({"model": OK_MODEL, "autoscaling": {"targetKVCacheUsage": 1.5}}, "spec.autoscaling.targetKVCacheUsage"),
    ({"model": OK_MODEL, "tuning": {"mode": "Sometimes"}}, "spec.tuning.mode"),
    ({"model": OK_MODEL, "tuning": {"blockSizes": [24]}}, "spec.tuning.blockSizes[0]"),
    ({"model": OK_MODEL, "router": {"strategy": "random"}}, "spec.router.strategy"),
    ({"model": OK_MODEL, "service": {"port": 70000}}, "spec.service.port"),
]


@pytest.mark.parametrize("spec, field", REJECTED_AT_APPLY, ids=[f for _, f in REJECTED_AT_APPLY])
def test_invalid_pagedmodel_is_rejected_at_apply(cluster, namespace, pagedmodel_crd, spec, field):
    result = cluster.kubectl("apply", "-f", "-", stdin=_pm(spec), namespace=namespace, check=False)
    assert result.returncode != 0, result.stdout
    assert field in result.stderr, result.stderr
    assert cluster.kubectl("get", "pm", "bad", namespace=namespace, check=False).returncode != 0


# Rules a structural schema cannot state: CEL (evaluated by kube-apiserver; see test_crd_cel.py) or the
# operator's own checks. Either the apply fails naming the field, or the operator reports Failed + InvalidSpec.
CROSS_FIELD = [
    ({"model": OK_MODEL, "autoscaling": {"minReplicas": 5, "maxReplicas": 2}}, "spec.autoscaling.minReplicas"),
    ({"model": OK_MODEL, "tuning": {"maxNumSeqs": {"min": 64, "max": 16}}}, "spec.tuning.maxNumSeqs.min"),
    ({"model": OK_MODEL, "engine": {"extraArgs": ["--port=9000"]}}, "spec.engine.extraArgs[0]"),
    ({"model": OK_MODEL, "engine": {"device": "cuda"}, "resources": {"gpus": 0}}, "spec.engine.device"),
]


def test_cross_field_rules_fail_with_an_event(cluster, namespace, pagedmodel_crd, tmp_path):
    with operator(cluster, namespace, tmp_path / "operator.log"):
        for i, (spec, field) in enumerate(CROSS_FIELD):
            name = f"cross-{i}"
            result = cluster.kubectl("apply", "-f", "-", stdin=_pm(spec, name), namespace=namespace, check=False)
            if result.returncode != 0:          # a real API server evaluating CEL
                assert field in result.stderr, result.stderr
                continue
            pm = wait_phase(cluster, namespace, "Failed", name=name, timeout=30)
            assert field in pm["status"]["message"]
            evs = wait_until(lambda: [e for e in cluster.kubectl_json(
                "get", "events", "--field-selector", f"involvedObject.name={name}", namespace=namespace)["items"]
                if e["reason"] == "InvalidSpec"], timeout=30, what="InvalidSpec event")
            assert evs[0]["type"] == "Warning" and field in evs[0]["message"]
            assert cluster.kubectl_json("get", "deployments", namespace=namespace)["items"] == []
            assert f"InvalidSpec" in cluster.kubectl("describe", "pm", name, namespace=namespace).stdout


def test_status_explains_crash_loops_unschedulable_pods_and_scale(cluster, namespace, pagedmodel_crd, tmp_path):
    cheap = {"model": OK_MODEL, "engine": {"device": "cpu"}, "resources": {"gpus": 0}}
    crashing = {**cheap, "engine": {"device": "cpu", "extraArgs": ["--no-such-flag"]}}   # serve exits 2 at once
    greedy = {"model": OK_MODEL, "resources": {"gpus": 4}}                               # the node has 1 GPU
    with operator(cluster, namespace, tmp_path / "operator.log"):
        cluster.kubectl("apply", "-f", "-", stdin=_pm(crashing, "crashing") + "---\n" + _pm(greedy, "greedy"),
                        namespace=namespace)

        pm = wait_phase(cluster, namespace, "Degraded", name="crashing", timeout=90)
        degraded = next(c for c in pm["status"]["conditions"] if c["type"] == "Degraded")
        assert degraded["status"] == "True" and degraded["reason"] in ("CrashLoopBackOff", "Restarting", "Error")
        assert "pod crashing-engine-" in pm["status"]["message"]
        assert "Degraded" in cluster.kubectl("describe", "pm", "crashing", namespace=namespace).stdout

        pm = wait_until(lambda: (lambda p: p if "Insufficient nvidia.com/gpu" in (p.get("status") or {})
                                 .get("message", "") else None)(pm_json(cluster, namespace, "greedy")),
                        timeout=60, what="unschedulable reason in status")
        assert pm["status"]["phase"] == "Progressing" and pm["status"]["ready"] == "0/1"

        # The scale subresource drives spec.replicas; 0 replicas is Pending/ScaledToZero, not an error.
        cluster.kubectl("scale", "pm", "greedy", "--replicas=0", namespace=namespace)
        pm = wait_phase(cluster, namespace, "Pending", name="greedy", generation=2, timeout=30)
        assert pm["spec"]["replicas"] == 0 and pm["status"]["ready"] == "0/0"
        wait_until(lambda: cluster.kubectl_json("get", "deployment", "greedy-engine", namespace=namespace)
                   ["spec"]["replicas"] == 0, timeout=30, what="engine Deployment scaled to 0")


def test_kubectl_explain_reads_well(cluster, pagedmodel_crd):
    out = cluster.kubectl("explain", "pm.spec.engine").stdout
    assert "Flags of `pagedmodel serve`" in out
    for field in ("blockSize", "maxNumSeqs", "gpuMemoryUtilization", "enablePrefixCaching", "extraArgs"):
        assert field in out, out
    assert "Most sequences batched in one engine step" in cluster.kubectl("explain", "pm.spec.engine.maxNumSeqs").stdout


def test_examples_are_accepted_by_the_api_server(cluster, namespace, pagedmodel_crd):
    out = cluster.kubectl("apply", "--dry-run=server", "-f", str(REPO / "examples"), namespace=namespace)
    assert sorted(line.split()[0] for line in out.stdout.splitlines()) == [
        "pagedmodel.pagedmodel.io/llama-1b", "pagedmodel.pagedmodel.io/smollm2", "pagedmodel.pagedmodel.io/smollm2-cpu"]
    assert cluster.kubectl_json("get", "pm", namespace=namespace)["items"] == []     # dry run stored nothing

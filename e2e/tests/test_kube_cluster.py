"""The local cluster on the real control plane: versions, start-up, the node's health, pods on our
kubelet (status, logs, graceful deletion) and service-account credentials that RBAC applies to."""
from __future__ import annotations

import json
import os
import time

import yaml

from e2e.kube.build import KUBERNETES_VERSION
from e2e.kube.local_cluster import KubeCluster

from .helpers import wait_until



def test_kubectl_version_reports_the_real_server(cluster):
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == KUBERNETES_VERSION
    assert version["clientVersion"]["gitVersion"] == KUBERNETES_VERSION
    # Start-up time is reported, not asserted: tests never assert wall-clock times (e2e/README.md has it).
    print(f"control plane + node healthy in {cluster.local.startup_s:.1f}s")


def test_node_is_ready_with_gpu_capacity_and_a_renewed_lease(cluster):
    node = cluster.kubectl_json("get", "node", cluster.local.node_name)
    assert node["status"]["capacity"]["nvidia.com/gpu"] == "1"
    ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True", ready
    assert not [t for t in node["spec"].get("taints") or [] if t["key"].startswith("node.kubernetes.io/")]
    lease = cluster.kubectl_json("get", "lease", cluster.local.node_name, namespace="kube-node-lease")
    first = lease["spec"]["renewTime"]
    wait_until(lambda: cluster.kubectl_json("get", "lease", cluster.local.node_name, namespace="kube-node-lease")
               ["spec"]["renewTime"] != first, timeout=20, what="lease renewed")


POD = """
apiVersion: v1
kind: Pod
metadata: {{name: {name}}}
spec:
  terminationGracePeriodSeconds: {grace}
  containers:
  - name: main
    image: python:3.11-slim
    command: [python, -c, {script}]
    readinessProbe: {{exec: {{command: [python, -c, "pass"]}}, periodSeconds: 1}}
"""
# Logs a line, ignores SIGTERM (so deletion must wait out the grace period), then idles.
STUBBORN = json.dumps("import signal, time; signal.signal(signal.SIGTERM, lambda *a: print('TERM', flush=True)); "
                      "print('hello from the pod', flush=True); time.sleep(3600)")


def test_pod_runs_logs_and_is_deleted_after_its_grace_period(cluster, namespace):
    cluster.kubectl("apply", "-f", "-", namespace=namespace, stdin=POD.format(name="p", grace=3, script=STUBBORN))
    cluster.kubectl("wait", "--for=condition=Ready", "pod/p", "--timeout=60s", namespace=namespace)
    pod = cluster.kubectl_json("get", "pod", "p", namespace=namespace)
    assert pod["status"]["phase"] == "Running"
    assert pod["status"]["podIP"].startswith(cluster.local.pod_network + ".")
    assert pod["spec"]["nodeName"] == cluster.local.node_name        # bound by kube-scheduler
    wait_until(lambda: "hello from the pod" in cluster.kubectl("logs", "p", namespace=namespace).stdout,
               what="kubectl logs through the kubelet")
    started = time.monotonic()
    cluster.kubectl("delete", "pod", "p", "--wait=true", "--timeout=60s", namespace=namespace)
    elapsed = time.monotonic() - started
    assert 2.5 < elapsed < 20, f"deleted after {elapsed:.1f}s with a 3s grace period and SIGTERM ignored"


RBAC_PROBE = json.dumps(
    "import os\n"
    "from kubernetes import client, config\n"
    "from kubernetes.client.exceptions import ApiException\n"
    "config.load_kube_config(os.environ['KUBECONFIG'])\n"
    "ns = open(os.path.join(os.path.dirname(os.environ['KUBECONFIG']), 'namespace')).read()\n"
    "try:\n"
    "    client.CoreV1Api().list_namespaced_pod(ns)\n"
    "    print('LIST OK', flush=True)\n"
    "except ApiException as exc:\n"
    "    print('LIST', exc.status, flush=True)\n")


def test_pod_talks_to_the_api_as_its_service_account(cluster, namespace):
    """The token comes from TokenRequest: RBAC applies to it, so listing pods is refused until a
    RoleBinding grants it."""
    cluster.kubectl("create", "serviceaccount", "probe", namespace=namespace)
    job = POD.format(name="before", grace=1, script=RBAC_PROBE).replace(
        "  containers:", "  serviceAccountName: probe\n  restartPolicy: Never\n  containers:")
    job = job.replace("    readinessProbe: {exec: {command: [python, -c, \"pass\"]}, periodSeconds: 1}\n", "")
    cluster.kubectl("apply", "-f", "-", namespace=namespace, stdin=job)
    wait_until(lambda: "LIST 403" in cluster.kubectl("logs", "before", namespace=namespace, check=False).stdout,
               timeout=60, what="the pod's list refused with 403")
    cluster.kubectl("create", "role", "pod-reader", "--verb=list", "--resource=pods", namespace=namespace)
    cluster.kubectl("create", "rolebinding", "probe-reads", "--role=pod-reader",
                    f"--serviceaccount={namespace}:probe", namespace=namespace)
    cluster.kubectl("apply", "-f", "-", namespace=namespace, stdin=job.replace("name: before", "name: after"))
    wait_until(lambda: "LIST OK" in cluster.kubectl("logs", "after", namespace=namespace, check=False).stdout,
               timeout=60, what="the pod's list allowed after the RoleBinding")
    token = yaml.safe_load(open(_pod_kubeconfig(cluster, namespace, "after")).read())["users"][0]["user"]["token"]
    review = json.loads(cluster.kubectl("create", "-o", "json", "-f", "-", stdin=json.dumps({
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": token}})).stdout)
    assert review["status"]["user"]["username"] == f"system:serviceaccount:{namespace}:probe"
    assert review["status"]["user"]["extra"]["authentication.kubernetes.io/pod-name"] == ["after"]


def _pod_kubeconfig(cluster, namespace: str, name: str) -> str:
    uid = cluster.kubectl_json("get", "pod", name, namespace=namespace)["metadata"]["uid"]
    return str(cluster.local.workdir / "pods" / f"{namespace}_{name}_{uid}" / ".serviceaccount" / "kubeconfig")


def test_stop_leaves_no_process_behind(tmp_path):
    with KubeCluster(tmp_path / "c") as other:
        pids = other.control_plane.pids()
        assert len(pids) == 4
    time.sleep(0.2)
    alive = [pid for pid in pids if os.path.exists(f"/proc/{pid}") and
             open(f"/proc/{pid}/stat").read().split()[2] != "Z"]
    assert alive == []

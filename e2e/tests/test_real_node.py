"""The real node (e2e/node/): kubelet v1.37 on containerd runs the chart's image from the local
registry, with pod networking, Service ClusterIPs (kube-proxy), cluster DNS (CoreDNS), the kubelet's
exec/logs/port-forward, cgroup memory limits and device-plugin GPUs."""
from __future__ import annotations

import hashlib
import json
import re
import urllib.request
from pathlib import Path

import pytest

from e2e.node import images
from e2e.target import ClusterTarget

from .helpers import wait_until

pytestmark = pytest.mark.slow

IMAGE = images.chart_image()
REPO = Path(__file__).resolve().parents[2]
# As the operator runs its pods: uid 1000, read-only root, only /tmp writable.
LOCKED_DOWN = {"runAsUser": 1000, "runAsGroup": 1000, "runAsNonRoot": True, "readOnlyRootFilesystem": True,
               "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
WEB_SERVER = ["python3", "-m", "http.server", "8080", "--directory", "/tmp"]


def pod(name: str, command: list[str], *, restart: str = "Always", resources: dict | None = None,
        labels: dict | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {"app": name}},
            "spec": {"restartPolicy": restart, "terminationGracePeriodSeconds": 2,
                     "containers": [{"name": "main", "image": IMAGE, "command": command,
                                     "securityContext": LOCKED_DOWN, "resources": resources or {},
                                     "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]}],
                     "volumes": [{"name": "tmp", "emptyDir": {}}]}}


def apply(cluster: ClusterTarget, namespace: str, *objects: dict) -> None:
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)}),
                    namespace=namespace)


def pod_status(cluster: ClusterTarget, namespace: str, name: str) -> dict:
    return cluster.kubectl_json("get", "pod", name, namespace=namespace).get("status", {})


def wait_ready(cluster: ClusterTarget, namespace: str, name: str, timeout: float = 300) -> dict:
    # The first pod of a fresh node pulls the image from the local registry: minutes, not seconds.
    def ready():
        status = pod_status(cluster, namespace, name)
        return status if any(c["type"] == "Ready" and c["status"] == "True"
                             for c in status.get("conditions", [])) else None
    return wait_until(ready, timeout=timeout, interval=0.5, what=f"pod {name} Ready")


def terminated(cluster: ClusterTarget, namespace: str, name: str, timeout: float = 300) -> dict:
    def done():
        for container in pod_status(cluster, namespace, name).get("containerStatuses", []):
            state = container.get("state", {}).get("terminated") or container.get("lastState", {}).get("terminated")
            if state:
                return state
        return None
    return wait_until(done, timeout=timeout, interval=0.5, what=f"pod {name}'s container to end")


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            return resp.status == 200
    except OSError:
        return False


def test_the_node_is_the_real_kubelet_on_containerd(cluster: ClusterTarget):
    wide = cluster.kubectl("get", "nodes", "-o", "wide").stdout
    row = wide.splitlines()[1].split()
    assert row[1] == "Ready", wide
    assert re.fullmatch(r"v1\.37\.\d+", row[4]), wide
    assert row[-1].startswith("containerd://"), wide


def test_chart_image_runs_read_only_as_uid_1000(cluster: ClusterTarget, namespace: str):
    # `pagedmodel --help` as the operator's pods run; then the user, and that the root really is read-only.
    script = "pagedmodel --help && id -u && if touch /opt/probe 2>/dev/null; then echo WRITABLE; fi; touch /tmp/ok"
    apply(cluster, namespace, pod("help", ["sh", "-c", script], restart="Never"))
    state = terminated(cluster, namespace, "help")
    logs = cluster.kubectl("logs", "help", namespace=namespace).stdout
    assert state["exitCode"] == 0, (state, logs)
    assert "serve" in logs and "operator" in logs, logs
    assert logs.strip().splitlines()[-1] == "1000", logs
    assert "WRITABLE" not in logs


SOURCE_DIGESTS = """
import hashlib, json, pathlib, pagedmodel
root = pathlib.Path(pagedmodel.__file__).parent
print(json.dumps({str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()[:16]
                  for p in sorted(root.rglob('*.py')) if '__pycache__' not in p.parts}))
"""


def checkout_digests() -> dict[str, str]:
    """What the wheel should install: pagedmodel/, with server/ and operator/ as its subpackages."""
    out = {}
    for folder, prefix in (("pagedmodel", ""), ("server", "server/"), ("operator", "operator/")):
        base = REPO / folder
        for path in sorted(base.rglob("*.py")):
            if "__pycache__" not in path.parts:
                out[prefix + str(path.relative_to(base))] = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return out


def test_the_image_holds_this_checkout(cluster: ClusterTarget, namespace: str):
    # Every module of the checkout, byte for byte: a module the wheel leaves out, or a stale image whose
    # layer cache kept old code, fails here before any scenario runs on it.
    apply(cluster, namespace, pod("sources", ["python3", "-c", SOURCE_DIGESTS], restart="Never"))
    state = terminated(cluster, namespace, "sources")
    logs = cluster.kubectl("logs", "sources", namespace=namespace).stdout
    assert state["exitCode"] == 0, logs
    installed, expected = json.loads(logs), checkout_digests()
    missing = sorted(set(expected) - set(installed))
    differing = sorted(p for p in set(expected) & set(installed) if expected[p] != installed[p])
    assert not missing and not differing, (f"the image's package differs from the checkout (rebuild with "
                                           f"python -m e2e.node.images): missing {missing}, differing {differing}")


def test_services_dns_exec_logs_and_port_forward(cluster: ClusterTarget, namespace: str):
    ns = namespace
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web-svc"},
               "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]}}
    apply(cluster, ns, pod("web", WEB_SERVER), service)
    status = wait_ready(cluster, ns, "web")
    assert status["podIP"].startswith("10.244."), status
    cluster_ip = cluster.kubectl_json("get", "service", "web-svc", namespace=ns)["spec"]["clusterIP"]

    # kube-proxy: the ClusterIP answers from this host once it has synced the Service's EndpointSlice
    # (until then its rules reject the connection).
    wait_until(lambda: answers(f"http://{cluster_ip}/"), timeout=30, what="the Service's ClusterIP to answer")

    # CoreDNS, from inside the pod (kubectl exec through the kubelet's streaming server).
    resolve = ("import socket, sys; print(socket.gethostbyname('web-svc'), "
               "socket.gethostbyname(f'web-svc.{sys.argv[1]}.svc.cluster.local'), "
               "socket.gethostbyname('kubernetes.default'))")
    out = cluster.kubectl("exec", "web", "--", "python3", "-c", resolve, ns, namespace=ns).stdout.split()
    assert out == [cluster_ip, cluster_ip, "10.96.0.1"], out

    # The pod reaches the API server as its ServiceAccount, through the kubernetes Service.
    whoami = ("import json, ssl, urllib.request; d = '/var/run/secrets/kubernetes.io/serviceaccount/'; "
              "ctx = ssl.create_default_context(cafile=d + 'ca.crt'); "
              "req = urllib.request.Request('https://kubernetes.default.svc/version', "
              "headers={'Authorization': 'Bearer ' + open(d + 'token').read()}); "
              "print(json.load(urllib.request.urlopen(req, context=ctx))['gitVersion'])")
    version = cluster.kubectl("exec", "web", "--", "python3", "-c", whoami, namespace=ns).stdout.strip()
    assert version.startswith("v1.37."), version

    # kubectl port-forward into the pod, and the request shows in kubectl logs.
    with cluster.kubectl_stream("port-forward", "pod/web", ":8080", namespace=ns) as proc:
        assert proc.stdout is not None
        line = proc.stdout.readline()   # "Forwarding from 127.0.0.1:NNNNN -> 8080"
        port = int(line.split("->")[0].strip().rsplit(":", 1)[-1])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/?via=port-forward", timeout=10) as resp:
            assert resp.status == 200
    wait_until(lambda: "via=port-forward" in cluster.kubectl("logs", "web", namespace=ns).stdout,
               timeout=10, what="the forwarded request in kubectl logs")


def test_memory_limit_is_enforced_by_the_kernel(cluster: ClusterTarget, namespace: str):
    hog = ["python3", "-c", "x = bytearray(400 * 2**20); print('allocated', flush=True)"]
    apply(cluster, namespace, pod("hog", hog, restart="Never",
                                            resources={"limits": {"memory": "128Mi", "cpu": "1"}}))
    state = terminated(cluster, namespace, "hog")
    assert (state["reason"], state["exitCode"]) == ("OOMKilled", 137), state


def test_gpus_come_from_the_device_plugin(cluster: ClusterTarget, namespace: str):
    ns = namespace
    node = cluster.kubectl_json("get", "nodes")["items"][0]
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "1"
    gpu = {"limits": {"nvidia.com/gpu": "1"}}
    apply(cluster, ns, pod("gpu-a", WEB_SERVER, resources=gpu))
    wait_ready(cluster, ns, "gpu-a")
    env = cluster.kubectl("exec", "gpu-a", "--", "printenv", "CUDA_VISIBLE_DEVICES", namespace=ns).stdout
    assert env.strip() == "0"
    # The one device is taken: a second claimant stays Pending, as on a full GPU node.
    apply(cluster, ns, pod("gpu-b", WEB_SERVER, resources=gpu))

    def unschedulable():
        events = cluster.kubectl("get", "events", "--field-selector", "involvedObject.name=gpu-b",
                                      namespace=ns).stdout
        return "Insufficient nvidia.com/gpu" in events
    wait_until(unschedulable, timeout=30, what="gpu-b to be refused for lack of GPUs")
    assert pod_status(cluster, ns, "gpu-b")["phase"] == "Pending"

"""Service-account credentials in pods: mounted unless the pod or its ServiceAccount opts out, and usable
by an in-cluster client. Locally the kubelet writes the TokenRequest token and a kubeconfig using it to
the pod's directory and exports ``KUBECONFIG`` (see e2e/kubelet/service_account.py); on a real node it is
the projected token."""
from __future__ import annotations

import yaml

from .helpers import wait_until

IMAGE = "python:3.11-slim"
TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
# Prints whether the container got credentials of either kind, then the local stand-in's namespace.
PROBE = ("import os, pathlib; cfg = os.environ.get('KUBECONFIG'); "
         f"print('credentials', bool(cfg) or pathlib.Path({TOKEN!r}).exists()); "
         "print('kubeconfig', cfg and pathlib.Path(cfg).read_text())")


def _pod(name: str, account: str | None = None, automount: bool | None = None, code: str = PROBE) -> dict:
    spec: dict = {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                  "containers": [{"name": "c", "image": IMAGE, "command": ["python", "-c", code]}]}
    if account is not None:
        spec["serviceAccountName"] = account
    if automount is not None:
        spec["automountServiceAccountToken"] = automount
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def _finished_log(cluster, namespace: str, name: str) -> str:
    pod = wait_until(lambda: (lambda p: p if p["status"].get("phase") in ("Succeeded", "Failed") else None)(
        cluster.kubectl_json("get", "pod", name, namespace=namespace)), timeout=60, what=f"pod {name} finished")
    out = cluster.kubectl("logs", name, namespace=namespace).stdout
    assert pod["status"]["phase"] == "Succeeded", out
    return out


def test_token_mounted_unless_pod_or_service_account_opts_out(cluster, namespace):
    quiet = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "quiet"},
             "automountServiceAccountToken": False}
    pods = {"default-sa": (_pod("default-sa"), True),
            "pod-opts-out": (_pod("pod-opts-out", automount=False), False),
            "sa-opts-out": (_pod("sa-opts-out", account="quiet"), False),
            "pod-overrides-sa": (_pod("pod-overrides-sa", account="quiet", automount=True), True)}
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all([quiet] + [p for p, _ in pods.values()]),
                    namespace=namespace)
    for name, (_, expected) in pods.items():
        first = _finished_log(cluster, namespace, name).splitlines()[0]
        assert first == f"credentials {expected}", (name, first)


def test_local_kubeconfig_acts_as_the_pods_service_account(cluster, namespace, local_node):
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(_pod("who")), namespace=namespace)
    out = _finished_log(cluster, namespace, "who")
    assert "kubeconfig None" not in out, out
    config = yaml.safe_load(out.split("kubeconfig ", 1)[1])
    context = config["contexts"][0]["context"]
    assert context["namespace"] == namespace            # what the projected `namespace` file would say
    assert context["user"] == f"system:serviceaccount:{namespace}:default"
    assert config["clusters"][0]["cluster"]["server"] == cluster.local.url


def test_in_cluster_client_lists_pods_from_inside_a_pod(cluster, namespace, local_node):
    """The router's discovery code, run in a pod, reaches the API with the pod's credentials and infers the
    pod's namespace (local only: the test image on a real node does not carry pagedmodel)."""
    code = ("import sys; from pagedmodel.server.router.discovery import PodDiscovery, current_namespace; "
            "ns = current_namespace(); d = PodDiscovery('app=peer', ns, print); d.connect(); "
            "pods = d._api.list_namespaced_pod(ns, label_selector='app=peer').items; "
            "print(ns, sorted(p.metadata.name for p in pods))")
    # RBAC applies to the pod's token: the default ServiceAccount may list pods only once granted.
    cluster.kubectl("create", "role", "pod-lister", "--verb=list", "--resource=pods", namespace=namespace)
    cluster.kubectl("create", "rolebinding", "default-lists-pods", "--role=pod-lister",
                    f"--serviceaccount={namespace}:default", namespace=namespace)
    peer = _pod("peer", code="import time; time.sleep(120)")
    peer["metadata"]["labels"] = {"app": "peer"}
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all([peer, _pod("lister", code=code)]),
                    namespace=namespace)
    out = _finished_log(cluster, namespace, "lister")
    assert out.strip().splitlines()[-1] == f"{namespace} ['peer']", out

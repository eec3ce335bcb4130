"""A stand-in for the service-account credentials a kubelet mounts into pods.

A real kubelet projects a token, the cluster CA and the namespace into
``/var/run/secrets/kubernetes.io/serviceaccount``; in-cluster clients
(``config.load_incluster_config()``) read them from there. Local pods are plain processes that cannot
own that path (and several pods with different namespaces share one filesystem), so the local kubelet
writes a per-pod kubeconfig instead and points ``KUBECONFIG`` at it. Clients that try in-cluster
credentials first and fall back to ``$KUBECONFIG`` (the router's discovery, kopf, the `kubernetes`
client's usual pattern) then reach the emulator as the pod's service account would. The
kubeconfig's context namespace is the pod's namespace: that is what the projected ``namespace`` file
tells an in-cluster client.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from ..apiserver.api import Api


def service_account_name(pod: dict[str, Any]) -> str:
    spec = pod.get("spec") or {}
    return spec.get("serviceAccountName") or spec.get("serviceAccount") or "default"


def automounts_token(api: Api, pod: dict[str, Any]) -> bool:
    """Whether a real kubelet would mount a token: the pod's ``automountServiceAccountToken`` wins, then the
    ServiceAccount's, and the default is to mount (as in Kubernetes)."""
    pod_setting = (pod.get("spec") or {}).get("automountServiceAccountToken")
    if pod_setting is not None:
        return bool(pod_setting)
    account = api.store.peek("serviceaccounts", pod["metadata"]["namespace"], service_account_name(pod))
    # A missing ServiceAccount would be refused by a real API server's admission; the emulator has no
    # admission plugins, so such a pod is treated like one using an account that mounts its token.
    if account is not None and account.get("automountServiceAccountToken") is not None:
        return bool(account["automountServiceAccountToken"])
    return True


def kubeconfig(api_url: str, namespace: str, service_account: str) -> dict[str, Any]:
    """A kubeconfig acting as ``namespace/service_account`` (the emulator accepts any token)."""
    if not api_url:
        raise ValueError("the kubelet needs the API server URL to hand pods credentials")
    user = f"system:serviceaccount:{namespace}:{service_account}"
    return {
        "apiVersion": "v1", "kind": "Config", "preferences": {},
        "clusters": [{"name": "in-cluster", "cluster": {"server": api_url}}],
        "users": [{"name": user, "user": {"token": f"e2e-serviceaccount-token:{namespace}:{service_account}"}}],
        "contexts": [{"name": "in-cluster", "context": {"cluster": "in-cluster", "user": user,
                                                         "namespace": namespace}}],
        "current-context": "in-cluster",
    }


def write_kubeconfig(path: Path, api_url: str, namespace: str, service_account: str) -> Path:
    """Write the pod's kubeconfig (mode 0600, like a token file) and return its path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(kubeconfig(api_url, namespace, service_account)))
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)   # a restarting container never reads a half-written file
    return path

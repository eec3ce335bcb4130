"""A pod's service-account credentials from the real TokenRequest API.

kube-apiserver's ServiceAccount admission adds a projected ``kube-api-access-*`` volume to every
pod that should see a token (the pod's and the account's ``automountServiceAccountToken`` decide).
A kubelet answers that volume with a bound token: TokenRequest for the pod's account, bound to the
pod (``boundObjectRef``, so deleting the pod invalidates it), with the volume's audience and expiry.
Local pods are plain processes that cannot own ``/var/run/secrets/kubernetes.io/serviceaccount``,
so the files go to the pod's own directory and a kubeconfig pointing at them is exported as
``KUBECONFIG`` (clients fall back to it when in-cluster files are absent). The token is requested
at every container start; kube-apiserver extends the admission's 3607 s tokens to a year
(``--service-account-extend-token-expiration``), so no refresh is needed within a test session.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml


def token_projection(pod: dict[str, Any]) -> dict[str, Any] | None:
    """The ``serviceAccountToken`` projection admission added, or None (no token for this pod)."""
    for volume in (pod.get("spec") or {}).get("volumes") or []:
        for source in (volume.get("projected") or {}).get("sources") or []:
            if "serviceAccountToken" in source:
                return source["serviceAccountToken"]
    return None


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)   # a restarting container never reads a half-written file


async def project(api: Any, pod: dict[str, Any], directory: Path) -> str | None:
    """Request the pod's token, write token/ca.crt/namespace/kubeconfig; returns the kubeconfig path."""
    projection = token_projection(pod)
    if projection is None:
        return None
    meta, spec = pod["metadata"], pod["spec"]
    account = spec.get("serviceAccountName") or "default"
    request = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {
        "audiences": [projection["audience"]] if projection.get("audience") else [],
        "expirationSeconds": int(projection.get("expirationSeconds") or 3607),
        "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]}}}
    try:
        answer = await api.request("POST", f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{account}/token",
                                   request)
    except Exception as exc:   # surfaced as the container's waiting reason, as a kubelet would
        raise ValueError(f"CreateContainerConfigError: token request for {account!r} failed: {exc}") from None
    token = answer["status"]["token"]
    directory.mkdir(parents=True, exist_ok=True)
    _write(directory / "token", token)
    _write(directory / "ca.crt", Path(api.ca_file).read_text())
    _write(directory / "namespace", meta["namespace"])
    user = f"system:serviceaccount:{meta['namespace']}:{account}"
    config = {"apiVersion": "v1", "kind": "Config", "preferences": {},
              "clusters": [{"name": "in-cluster", "cluster": {"server": api.api_url,
                                                               "certificate-authority": str(directory / "ca.crt")}}],
              "users": [{"name": user, "user": {"token": token}}],
              "contexts": [{"name": "in-cluster", "context": {"cluster": "in-cluster", "user": user,
                                                               "namespace": meta["namespace"]}}],
              "current-context": "in-cluster"}
    _write(directory / "kubeconfig", yaml.safe_dump(config))
    return str(directory / "kubeconfig")

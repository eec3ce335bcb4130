"""A container's command line and environment, as the kubelet would build them."""
from __future__ import annotations

import base64
import os
import re
import shutil
import sys
from typing import Any, Callable

# (storage, namespace, name) -> the stored object or None; "configmaps" and "secrets" are asked.
Lookup = Callable[[str, str, str], "dict[str, Any] | None"]

_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: unknown references stay literal, ``$$`` escapes."""
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _REF.sub(sub, text)


def _field(pod: dict[str, Any], path: str) -> str:
    meta = pod["metadata"]
    simple = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"], "metadata.uid": meta["uid"],
              "spec.nodeName": pod["spec"].get("nodeName", ""),
              "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "default"),
              "status.podIP": (pod.get("status") or {}).get("podIP", ""),
              "status.hostIP": (pod.get("status") or {}).get("hostIP", "")}
    if path in simple:
        return simple[path]
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    raise ValueError(f"CreateContainerConfigError: unsupported fieldRef {path!r}")


def _lookup(api: Lookup, ns: str, kind: str, name: str, key: str | None, optional: bool) -> Any:
    storage = "configmaps" if kind == "configmap" else "secrets"
    obj = api(storage, ns, name)
    if obj is None:
        if optional:
            return None
        raise ValueError(f'CreateContainerConfigError: {kind} "{name}" not found')
    if storage == "secrets":
        data = {k: base64.b64decode(v).decode(errors="replace") for k, v in (obj.get("data") or {}).items()}
    else:
        data = dict(obj.get("data") or {})
    if key is None:
        return data
    if key not in data:
        if optional:
            return None
        raise ValueError(f"CreateContainerConfigError: couldn't find key {key} in {kind.capitalize()} {ns}/{name}")
    return data[key]


def resolve_command(argv: list[str]) -> list[str]:
    """Images are not pulled: ``python``/``python3`` mean the harness's interpreter, others come from PATH."""
    if not argv:
        raise ValueError("CreateContainerError: the local kubelet needs an explicit command (images are not pulled)")
    head = argv[0]
    if head in ("python", "python3"):
        return [sys.executable] + argv[1:]
    if os.sep not in head and shutil.which(head) is None:
        raise ValueError(f'CreateContainerError: exec: "{head}": executable file not found in $PATH')
    return argv


def build(api: Lookup, pod: dict[str, Any], container: dict[str, Any], api_host: str,
          api_port: int, kubeconfig: str | None = None) -> tuple[list[str], dict[str, str]]:
    """argv and env of one container. ``kubeconfig``: the pod's service-account kubeconfig (see
    service_account.py), exported as ``KUBECONFIG`` unless the container sets that variable itself."""
    ns = pod["metadata"]["namespace"]
    env: dict[str, str] = {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "HOSTNAME": pod["metadata"]["name"],
        # Where a pod would find the API server (its kubeconfig is what clients here actually use).
        "KUBERNETES_SERVICE_HOST": api_host, "KUBERNETES_SERVICE_PORT": str(api_port),
        # Logs must appear as they are written (kubectl logs -f), not when a buffer fills.
        "PYTHONUNBUFFERED": "1",
    }
    if kubeconfig is not None:
        env["KUBECONFIG"] = kubeconfig
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for kind, key in (("configmap", "configMapRef"), ("secret", "secretRef")):
            if key in source:
                ref = source[key]
                data = _lookup(api, ns, kind, ref["name"], None, bool(ref.get("optional")))
                for k, v in (data or {}).items():
                    env[prefix + k] = v
    for item in container.get("env") or []:
        name = item["name"]
        if "value" in item:
            env[name] = expand(str(item["value"]), env)
            continue
        source = item.get("valueFrom") or {}
        value: Any = ""
        if "fieldRef" in source:
            value = _field(pod, source["fieldRef"]["fieldPath"])
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            value = _lookup(api, ns, "configmap", ref["name"], ref["key"], bool(ref.get("optional")))
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            value = _lookup(api, ns, "secret", ref["name"], ref["key"], bool(ref.get("optional")))
        elif "resourceFieldRef" in source:
            resources = container.get("resources") or {}
            kind, _, res = source["resourceFieldRef"]["resource"].partition(".")
            value = str((resources.get(kind) or {}).get(res, ""))
        if value is not None:
            env[name] = str(value)
    argv = [expand(str(a), env) for a in (container.get("command") or []) + (container.get("args") or [])]
    if not container.get("command") and container.get("args"):
        argv = []
    return resolve_command(argv), env

"""Defaulting and the basic validation kube-apiserver applies to the built-in kinds we serve."""
from __future__ import annotations

import base64
import re
from typing import Any

from .errors import FieldError
from .selectors import labels_match, selector_from_label_selector

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# Kinds whose names must be DNS labels rather than subdomains.
_LABEL_NAMED = {"namespaces", "services"}


def validate_name(storage: str, name: str) -> list[FieldError]:
    if storage in ("events",) or ":" in name and storage.startswith(("clusterroles", "clusterrolebindings", "roles")):
        return []   # event names embed timestamps; RBAC names may hold ':'
    if storage in _LABEL_NAMED:
        if len(name) > 63 or not _DNS_LABEL.match(name):
            return [FieldError("FieldValueInvalid", "metadata.name",
                               f'Invalid value: "{name}": a lowercase RFC 1123 label must consist of lower case '
                               "alphanumeric characters or '-', and must start and end with an alphanumeric "
                               "character (e.g. 'my-name',  or '123-abc', regex used for validation is "
                               "'[a-z0-9]([-a-z0-9]*[a-z0-9])?')")]
        return []
    if len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        return [FieldError("FieldValueInvalid", "metadata.name",
                           f'Invalid value: "{name}": a lowercase RFC 1123 subdomain must consist of lower case '
                           "alphanumeric characters, '-' or '.', and must start and end with an alphanumeric "
                           "character (e.g. 'example.com', regex used for validation is "
                           "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")]
    return []


def _probe_defaults(probe: dict[str, Any] | None) -> None:
    if probe is None:
        return
    probe.setdefault("timeoutSeconds", 1)
    probe.setdefault("periodSeconds", 10)
    probe.setdefault("successThreshold", 1)
    probe.setdefault("failureThreshold", 3)
    if "httpGet" in probe:
        probe["httpGet"].setdefault("path", "/")
        probe["httpGet"].setdefault("scheme", "HTTP")


def default_pod_spec(spec: dict[str, Any]) -> None:
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("securityContext", {})
    for container in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        image = container.get("image", "")
        latest = ":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest")
        container.setdefault("imagePullPolicy", "Always" if latest else "IfNotPresent")
        container.setdefault("terminationMessagePath", "/dev/termination-log")
        container.setdefault("terminationMessagePolicy", "File")
        container.setdefault("resources", {})
        for port in container.get("ports") or []:
            port.setdefault("protocol", "TCP")
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            _probe_defaults(container.get(probe))


def _validate_pod_spec(spec: dict[str, Any], path: str) -> list[FieldError]:
    errors = []
    containers = spec.get("containers")
    if not containers:
        errors.append(FieldError("FieldValueRequired", f"{path}.containers", "Required value"))
    for i, c in enumerate(containers or []):
        if not c.get("name"):
            errors.append(FieldError("FieldValueRequired", f"{path}.containers[{i}].name", "Required value"))
        if not c.get("image"):
            errors.append(FieldError("FieldValueRequired", f"{path}.containers[{i}].image", "Required value"))
    return errors


def _validate_workload(obj: dict[str, Any]) -> list[FieldError]:
    spec = obj.get("spec") or {}
    errors = []
    selector = spec.get("selector")
    if not selector:
        errors.append(FieldError("FieldValueRequired", "spec.selector", "Required value"))
    template = spec.get("template") or {}
    labels = (template.get("metadata") or {}).get("labels") or {}
    if selector and not labels_match(selector_from_label_selector(selector), {"metadata": {"labels": labels}}):
        errors.append(FieldError("FieldValueInvalid", "spec.template.metadata.labels",
                                 f"Invalid value: {labels!r}: `selector` does not match template `labels`"))
    errors += _validate_pod_spec(template.get("spec") or {}, "spec.template.spec")
    if spec.get("replicas", 1) < 0:
        errors.append(FieldError("FieldValueInvalid", "spec.replicas",
                                 f"Invalid value: {spec['replicas']}: must be greater than or equal to 0"))
    return errors


def default_and_validate(storage: str, obj: dict[str, Any], creating: bool) -> list[FieldError]:
    """Apply built-in defaults in place and return validation errors (empty when valid)."""
    meta = obj["metadata"]
    if storage == "namespaces":
        obj.setdefault("spec", {}).setdefault("finalizers", ["kubernetes"])
        obj.setdefault("status", {}).setdefault("phase", "Active")
        meta.setdefault("labels", {})["kubernetes.io/metadata.name"] = meta["name"]
    elif storage == "pods":
        obj.setdefault("spec", {})
        default_pod_spec(obj["spec"])
        if creating:
            obj["status"] = {"phase": "Pending", "qosClass": _qos_class(obj["spec"])}
        return _validate_pod_spec(obj["spec"], "spec")
    elif storage in ("deployments.apps", "replicasets.apps", "statefulsets.apps"):
        obj.setdefault("spec", {})
        spec = obj["spec"]
        spec.setdefault("replicas", 1)
        if storage == "deployments.apps":
            strategy = spec.setdefault("strategy", {"type": "RollingUpdate"})
            if strategy.get("type", "RollingUpdate") == "RollingUpdate":
                strategy.setdefault("type", "RollingUpdate")
                ru = strategy.setdefault("rollingUpdate", {})
                ru.setdefault("maxSurge", "25%")
                ru.setdefault("maxUnavailable", "25%")
            spec.setdefault("revisionHistoryLimit", 10)
            spec.setdefault("progressDeadlineSeconds", 600)
        template = spec.setdefault("template", {})
        default_pod_spec(template.setdefault("spec", {}))
        return _validate_workload(obj)
    elif storage == "jobs.batch":
        spec = obj.setdefault("spec", {})
        spec.setdefault("parallelism", 1)
        spec.setdefault("backoffLimit", 6)
        spec.setdefault("completionMode", "NonIndexed")
        if "completions" not in spec:
            spec["completions"] = 1
        template = spec.setdefault("template", {})
        pod_spec = template.setdefault("spec", {})
        default_pod_spec(pod_spec)
        if pod_spec.get("restartPolicy") not in ("Never", "OnFailure"):
            return [FieldError("FieldValueNotSupported", "spec.template.spec.restartPolicy",
                               f'Unsupported value: "{pod_spec.get("restartPolicy")}": supported values: '
                               '"OnFailure", "Never"')]
        return _validate_pod_spec(pod_spec, "spec.template.spec")
    elif storage == "services":
        obj.setdefault("spec", {})
        svc = obj["spec"]
        svc.setdefault("type", "ClusterIP")
        svc.setdefault("sessionAffinity", "None")
        for port in svc.get("ports") or []:
            port.setdefault("protocol", "TCP")
            port.setdefault("targetPort", port.get("port"))
        if not svc.get("ports") and svc.get("clusterIP") != "None" and svc.get("type") != "ExternalName":
            return [FieldError("FieldValueRequired", "spec.ports", "Required value")]
    elif storage == "secrets":
        obj.setdefault("type", "Opaque")
        string_data = obj.pop("stringData", None) or {}
        data = obj.setdefault("data", {})
        for k, v in string_data.items():
            data[k] = base64.b64encode(str(v).encode()).decode()
    return []


def _qos_class(spec: dict[str, Any]) -> str:
    resources = [c.get("resources") or {} for c in spec.get("containers") or []]
    if not any(r.get("requests") or r.get("limits") for r in resources):
        return "BestEffort"
    if all(r.get("limits") and (not r.get("requests") or r["requests"] == r["limits"])
           and {"cpu", "memory"} <= set(r["limits"]) for r in resources):
        return "Guaranteed"
    return "Burstable"


# Pod spec fields an update may change (besides binding an unscheduled pod to a node).
_POD_MUTABLE = ("activeDeadlineSeconds", "terminationGracePeriodSeconds", "tolerations")


def _pod_spec_without_mutable(spec: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in spec.items() if k not in _POD_MUTABLE + ("nodeName",)}
    for key in ("containers", "initContainers"):
        if key in out:
            out[key] = [{k: v for k, v in c.items() if k != "image"} for c in out[key]]
    return out


def validate_update(storage: str, old: dict[str, Any], new: dict[str, Any]) -> list[FieldError]:
    """The immutability rules users most often trip over, with the API server's wording.

    Allocated values an update leaves out (a Service's clusterIP) are carried over into ``new``.
    """
    errors: list[FieldError] = []
    if storage in ("deployments.apps", "replicasets.apps", "statefulsets.apps"):
        before, after = (old.get("spec") or {}).get("selector"), (new.get("spec") or {}).get("selector")
        if before != after:
            errors.append(FieldError("FieldValueInvalid", "spec.selector",
                                     f"Invalid value: {after!r}: field is immutable"))
    elif storage == "pods":
        before, after = old.get("spec") or {}, new.get("spec") or {}
        if before.get("nodeName") and after.get("nodeName") != before.get("nodeName"):
            errors.append(FieldError("FieldValueForbidden", "spec.nodeName", "Forbidden: field is immutable"))
        if _pod_spec_without_mutable(before) != _pod_spec_without_mutable(after):
            errors.append(FieldError(
                "FieldValueForbidden", "spec",
                "Forbidden: pod updates may not change fields other than `spec.containers[*].image`,"
                "`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions "
                "to existing tolerations),`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was "
                "previously negative)"))
    elif storage == "services":
        before, after = (old.get("spec") or {}).get("clusterIP"), (new.get("spec") or {}).get("clusterIP")
        if before and not after:
            # An update that omits the allocated address keeps it, as the Service registry does.
            new.setdefault("spec", {})["clusterIP"] = before
            new["spec"]["clusterIPs"] = list((old.get("spec") or {}).get("clusterIPs") or [before])
        elif before and after != before:
            errors.append(FieldError("FieldValueInvalid", "spec.clusterIPs[0]",
                                     f"Invalid value: {[after]!r}: may not change once set"))
    elif storage in ("configmaps", "secrets") and old.get("immutable"):
        for field in ("data", "binaryData", "immutable"):
            if old.get(field) != new.get(field):
                errors.append(FieldError("FieldValueForbidden", field,
                                         "Forbidden: field is immutable when `immutable` is set"))
    return errors


def default_job_selector(job: dict[str, Any]) -> None:
    """Jobs get a selector on their own UID (assigned at creation), labels on their pod template."""
    uid, name = job["metadata"]["uid"], job["metadata"]["name"]
    spec = job["spec"]
    if spec.get("manualSelector") and spec.get("selector"):
        return
    spec["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}
    labels = spec["template"].setdefault("metadata", {}).setdefault("labels", {})
    labels.update({"batch.kubernetes.io/controller-uid": uid, "batch.kubernetes.io/job-name": name,
                   "controller-uid": uid, "job-name": name})

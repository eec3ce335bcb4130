"""Job controller: runs pods to ``completions`` successes within ``parallelism``, fails past ``backoffLimit``."""
from __future__ import annotations

import copy
from typing import Any

from ..apiserver.api import Api, now_iso
from ..apiserver.errors import ApiError
from .common import owned_by, owner_ref, pod_ready, set_condition, terminating

COMPONENT = "job-controller"


def _finished(job: dict[str, Any]) -> bool:
    return any(c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
               for c in (job.get("status") or {}).get("conditions") or [])


def reconcile(api: Api, stored: dict[str, Any]) -> None:
    if terminating(stored):
        return
    jobs_rt, pods_rt = api.builtin("jobs.batch"), api.builtin("pods")
    job = api.served(jobs_rt, stored)
    ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
    spec = job["spec"]
    pods = [p for p in api.store.list("pods", ns) if owned_by(p, job)]
    phase = lambda p: (p.get("status") or {}).get("phase")  # noqa: E731
    active = [p for p in pods if phase(p) not in ("Succeeded", "Failed") and not terminating(p)]
    succeeded = sum(1 for p in pods if phase(p) == "Succeeded")
    failed = sum(1 for p in pods if phase(p) == "Failed")
    completions = spec.get("completions")
    status = copy.deepcopy(job.get("status") or {})
    status.setdefault("startTime", now_iso())
    conditions = list(status.get("conditions") or [])
    if not _finished(job):
        done = succeeded >= (completions if completions is not None else 1)
        if done or failed > spec.get("backoffLimit", 6):
            for pod in active:
                try:
                    api.delete(pods_rt, ns, pod["metadata"]["name"])
                except ApiError:
                    pass
            active = []
            if done:
                conditions = set_condition(conditions, "SuccessCriteriaMet", "True", "CompletionsReached",
                                           "Reached expected number of succeeded pods")
                conditions = set_condition(conditions, "Complete", "True", "CompletionsReached",
                                           "Reached expected number of succeeded pods")
                status["completionTime"] = now_iso()
                api.record_event(job, "Normal", "Completed", "Job completed", COMPONENT)
            else:
                conditions = set_condition(conditions, "FailureTarget", "True", "BackoffLimitExceeded",
                                           "Job has reached the specified backoff limit")
                conditions = set_condition(conditions, "Failed", "True", "BackoffLimitExceeded",
                                           "Job has reached the specified backoff limit")
                api.record_event(job, "Warning", "BackoffLimitExceeded", "Job has reached the specified backoff "
                                 "limit", COMPONENT)
        elif not spec.get("suspend"):
            remaining = (completions - succeeded) if completions is not None else 1
            want = max(0, min(spec.get("parallelism", 1), remaining) - len(active))
            template = copy.deepcopy(spec["template"])
            for _ in range(want):
                body = {"apiVersion": "v1", "kind": "Pod",
                        "metadata": {"generateName": f"{name}-", "namespace": ns,
                                     "labels": dict((template.get("metadata") or {}).get("labels") or {}),
                                     "annotations": dict((template.get("metadata") or {}).get("annotations") or {}),
                                     "ownerReferences": [owner_ref(job)]},
                        "spec": copy.deepcopy(template["spec"])}
                try:
                    pod = api.create(pods_rt, ns, body)
                except ApiError as err:
                    api.record_event(job, "Warning", "FailedCreate", err.message, COMPONENT)
                    break
                active.append(pod)
                api.record_event(job, "Normal", "SuccessfulCreate", f"Created pod: {pod['metadata']['name']}",
                                 COMPONENT)
    status.update({"active": len(active), "succeeded": succeeded, "failed": failed,
                   "ready": sum(1 for p in active if pod_ready(p))})
    for key in ("active", "succeeded", "failed"):
        if not status[key]:
            status.pop(key)
    status["conditions"] = conditions
    if not conditions:
        status.pop("conditions")
    if status != (job.get("status") or {}):
        try:
            api.update(jobs_rt, ns, name, dict(job, status=status), subresource="status")
        except ApiError:
            pass

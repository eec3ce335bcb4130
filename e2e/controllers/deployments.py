"""Deployment controller: ReplicaSet per pod template, rolling updates, Recreate, status and conditions."""
from __future__ import annotations

import copy
import hashlib
import json
import math
from typing import Any

from ..apiserver.api import Api
from ..apiserver.errors import ApiError
from .common import event, owned_by, owner_ref, pod_available, pod_ready, set_condition, terminating
from .replicasets import owned_pods

COMPONENT = "deployment-controller"
HASH_LABEL = "pod-template-hash"
REVISION = "deployment.kubernetes.io/revision"
_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"


def template_hash(template: dict[str, Any]) -> str:
    clean = copy.deepcopy(template)
    (clean.get("metadata") or {}).get("labels", {}).pop(HASH_LABEL, None)
    digest = hashlib.sha256(json.dumps(clean, sort_keys=True).encode()).digest()
    return "".join(_ALPHABET[b % len(_ALPHABET)] for b in digest[:10])


def resolve(value: int | str | None, total: int, round_up: bool) -> int:
    """An IntOrString (``2`` or ``"25%"``) against ``total``."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    text = str(value).strip()
    if text.endswith("%"):
        exact = int(text[:-1]) * total / 100
        return math.ceil(exact) if round_up else math.floor(exact)
    return int(text)


def _revision(rs: dict[str, Any]) -> int:
    try:
        return int((rs["metadata"].get("annotations") or {}).get(REVISION, "0"))
    except ValueError:
        return 0


class DeploymentController:
    def __init__(self, api: Api) -> None:
        self.api = api
        self.rs_rt = api.builtin("replicasets.apps")
        self.d_rt = api.builtin("deployments.apps")

    def reconcile(self, stored: dict[str, Any]) -> None:
        if terminating(stored):
            return
        api = self.api
        d = api.served(self.d_rt, stored)
        ns = d["metadata"]["namespace"]
        spec = d["spec"]
        replicas = spec.get("replicas", 1)
        rss = [api.served(self.rs_rt, rs) for rs in api.store.list("replicasets.apps", ns) if owned_by(rs, d)]
        thash = template_hash(spec["template"])
        new_rs = next((rs for rs in rss if (rs["metadata"].get("labels") or {}).get(HASH_LABEL) == thash), None)
        olds = sorted((rs for rs in rss if rs is not new_rs), key=lambda r: r["metadata"]["creationTimestamp"])
        max_revision = max([_revision(rs) for rs in rss] or [0])
        strategy = spec.get("strategy") or {"type": "RollingUpdate"}
        if spec.get("paused"):
            self._write_status(d, new_rs, rss)
            return
        if new_rs is None:
            live_olds = any(rs["spec"].get("replicas", 0) > 0 for rs in olds)
            initial = 0 if (live_olds or strategy.get("type") == "Recreate") else replicas
            if strategy.get("type") == "RollingUpdate" and live_olds:
                surge = resolve((strategy.get("rollingUpdate") or {}).get("maxSurge", "25%"), replicas, True)
                total = sum(rs["spec"].get("replicas", 0) for rs in olds)
                initial = max(0, min(replicas, replicas + surge - total))
            new_rs = self._create_rs(d, thash, initial, max_revision + 1)
            if new_rs is None:
                return
            rss.append(new_rs)
        elif _revision(new_rs) < max_revision or REVISION not in (new_rs["metadata"].get("annotations") or {}):
            # Rolling back to an older template makes its ReplicaSet the newest revision.
            new_rs = self._patch_rs(new_rs, annotations={REVISION: str(max_revision + (1 if olds else 0) or 1)}) \
                or new_rs
        if strategy.get("type") == "Recreate":
            self._recreate(d, new_rs, olds)
        else:
            self._rolling(d, new_rs, olds, strategy.get("rollingUpdate") or {})
        self._cleanup(d, olds)
        rss = [api.served(self.rs_rt, rs) for rs in api.store.list("replicasets.apps", ns) if owned_by(rs, d)]
        new_rs = next((rs for rs in rss if rs["metadata"]["uid"] == new_rs["metadata"]["uid"]), new_rs)
        self._write_status(d, new_rs, rss)

    # --- strategies --------------------------------------------------------------------

    def _recreate(self, d: dict[str, Any], new_rs: dict[str, Any], olds: list[dict[str, Any]]) -> None:
        for rs in olds:
            if rs["spec"].get("replicas", 0) != 0:
                self._scale(d, rs, 0)
        if any(owned_pods(self.api, rs, include_terminating=True) for rs in olds):
            return   # Recreate waits until every old pod is gone
        self._scale(d, new_rs, d["spec"].get("replicas", 1))

    def _rolling(self, d: dict[str, Any], new_rs: dict[str, Any], olds: list[dict[str, Any]],
                 params: dict[str, Any]) -> None:
        replicas = d["spec"].get("replicas", 1)
        min_ready = d["spec"].get("minReadySeconds", 0)
        surge = resolve(params.get("maxSurge", "25%"), replicas, True)
        unavailable = resolve(params.get("maxUnavailable", "25%"), replicas, False)
        if surge == 0 and unavailable == 0:
            unavailable = 1
        live_olds = [rs for rs in olds if rs["spec"].get("replicas", 0) > 0]
        if not live_olds:
            if new_rs["spec"].get("replicas", 0) != replicas:
                self._scale(d, new_rs, replicas)
            return
        # Scale the new ReplicaSet up within the surge budget.
        total = sum(rs["spec"].get("replicas", 0) for rs in [new_rs] + olds)
        new_count = new_rs["spec"].get("replicas", 0)
        if new_count > replicas:
            self._scale(d, new_rs, replicas)
            new_count = replicas
        elif new_count < replicas and total < replicas + surge:
            target = min(replicas, new_count + replicas + surge - total)
            self._scale(d, new_rs, target)
            new_count = target
        # Scale old ReplicaSets down without dropping below replicas - maxUnavailable available pods.
        min_available = replicas - unavailable
        new_available = sum(1 for p in owned_pods(self.api, new_rs) if pod_available(p, min_ready))
        total = new_count + sum(rs["spec"].get("replicas", 0) for rs in olds)
        budget = total - min_available - (new_count - new_available)
        for rs in live_olds:   # first drop old pods that are not available anyway
            if budget <= 0:
                break
            pods = owned_pods(self.api, rs)
            unhealthy = rs["spec"]["replicas"] - sum(1 for p in pods if pod_available(p, min_ready))
            take = min(budget, max(0, unhealthy))
            if take:
                rs["spec"]["replicas"] -= take
                self._scale(d, rs, rs["spec"]["replicas"])
                budget -= take
        available = new_available + sum(sum(1 for p in owned_pods(self.api, rs) if pod_available(p, min_ready))
                                        for rs in olds)
        budget = available - min_available
        for rs in live_olds:
            if budget <= 0:
                break
            take = min(budget, rs["spec"]["replicas"])
            if take:
                self._scale(d, rs, rs["spec"]["replicas"] - take)
                budget -= take

    # --- writes ------------------------------------------------------------------------

    def _create_rs(self, d: dict[str, Any], thash: str, replicas: int, revision: int) -> dict[str, Any] | None:
        template = copy.deepcopy(d["spec"]["template"])
        template.setdefault("metadata", {}).setdefault("labels", {})[HASH_LABEL] = thash
        selector = copy.deepcopy(d["spec"]["selector"])
        selector.setdefault("matchLabels", {})[HASH_LABEL] = thash
        body = {"apiVersion": "apps/v1", "kind": "ReplicaSet",
                "metadata": {"name": f"{d['metadata']['name']}-{thash}", "namespace": d["metadata"]["namespace"],
                             "labels": dict(template["metadata"]["labels"]),
                             "annotations": {REVISION: str(revision),
                                             "deployment.kubernetes.io/desired-replicas": str(d["spec"]["replicas"])},
                             "ownerReferences": [owner_ref(d)]},
                "spec": {"replicas": replicas, "minReadySeconds": d["spec"].get("minReadySeconds", 0),
                         "selector": selector, "template": template}}
        try:
            rs = self.api.create(self.rs_rt, d["metadata"]["namespace"], body)
        except ApiError as err:
            event(self.api, d, "Warning", "FailedCreate", err.message, COMPONENT)
            return None
        event(self.api, d, "Normal", "ScalingReplicaSet",
              f"Scaled up replica set {rs['metadata']['name']} from 0 to {replicas}", COMPONENT)
        return rs

    def _patch_rs(self, rs: dict[str, Any], annotations: dict[str, str]) -> dict[str, Any] | None:
        try:
            return self.api.patch(self.rs_rt, rs["metadata"]["namespace"], rs["metadata"]["name"],
                                  "application/merge-patch+json", {"metadata": {"annotations": annotations}})
        except ApiError:
            return None

    def _scale(self, d: dict[str, Any], rs: dict[str, Any], replicas: int) -> None:
        current = rs["spec"].get("replicas", 0)
        stored = self.api.store.peek("replicasets.apps", rs["metadata"]["namespace"], rs["metadata"]["name"])
        if stored is not None and stored["spec"].get("replicas") == replicas:
            return
        try:
            self.api.patch(self.rs_rt, rs["metadata"]["namespace"], rs["metadata"]["name"],
                           "application/merge-patch+json",
                           {"spec": {"replicas": replicas},
                            "metadata": {"annotations": {
                                "deployment.kubernetes.io/desired-replicas": str(d["spec"].get("replicas", 1))}}})
        except ApiError:
            return
        direction = "up" if replicas > current else "down"
        event(self.api, d, "Normal", "ScalingReplicaSet",
              f"Scaled {direction} replica set {rs['metadata']['name']} from {current} to {replicas}", COMPONENT)
        rs["spec"]["replicas"] = replicas

    def _cleanup(self, d: dict[str, Any], olds: list[dict[str, Any]]) -> None:
        limit = d["spec"].get("revisionHistoryLimit", 10)
        idle = [rs for rs in olds if rs["spec"].get("replicas", 0) == 0
                and not owned_pods(self.api, rs, include_terminating=True)]
        for rs in idle[: max(0, len(idle) - limit)]:
            try:
                self.api.delete(self.rs_rt, rs["metadata"]["namespace"], rs["metadata"]["name"])
            except ApiError:
                pass

    def _write_status(self, d: dict[str, Any], new_rs: dict[str, Any] | None, rss: list[dict[str, Any]]) -> None:
        api = self.api
        replicas = d["spec"].get("replicas", 1)
        min_ready = d["spec"].get("minReadySeconds", 0)
        pods_by_rs = {rs["metadata"]["uid"]: owned_pods(api, rs) for rs in rss}
        all_pods = [p for pods in pods_by_rs.values() for p in pods]
        new_pods = pods_by_rs.get(new_rs["metadata"]["uid"], []) if new_rs else []
        available = sum(1 for p in all_pods if pod_available(p, min_ready))
        params = (d["spec"].get("strategy") or {}).get("rollingUpdate") or {}
        max_unavailable = resolve(params.get("maxUnavailable", "25%"), replicas, False) \
            if (d["spec"].get("strategy") or {}).get("type", "RollingUpdate") == "RollingUpdate" else 0
        status: dict[str, Any] = dict(d.get("status") or {})
        status.update({
            "observedGeneration": d["metadata"].get("generation", 1),
            "replicas": len(all_pods),
            "updatedReplicas": len(new_pods),
            "readyReplicas": sum(1 for p in all_pods if pod_ready(p)),
            "availableReplicas": available,
            "unavailableReplicas": max(0, sum(rs["spec"].get("replicas", 0) for rs in rss) - available),
        })
        for key in ("readyReplicas", "availableReplicas", "unavailableReplicas", "updatedReplicas", "replicas"):
            if not status[key]:
                status.pop(key)
        conditions = list(status.get("conditions") or [])
        if available >= replicas - max_unavailable:
            conditions = set_condition(conditions, "Available", "True", "MinimumReplicasAvailable",
                                       "Deployment has minimum availability.", with_update_time=True)
        else:
            conditions = set_condition(conditions, "Available", "False", "MinimumReplicasUnavailable",
                                       "Deployment does not have minimum availability.", with_update_time=True)
        rs_name = new_rs["metadata"]["name"] if new_rs else ""
        old_pods = len(all_pods) - len(new_pods)
        complete = (len(new_pods) == replicas and old_pods == 0 and
                    sum(1 for p in new_pods if pod_available(p, min_ready)) == replicas)
        if complete:
            conditions = set_condition(conditions, "Progressing", "True", "NewReplicaSetAvailable",
                                       f'ReplicaSet "{rs_name}" has successfully progressed.', with_update_time=True)
        else:
            conditions = set_condition(conditions, "Progressing", "True", "ReplicaSetUpdated",
                                       f'ReplicaSet "{rs_name}" is progressing.', with_update_time=True)
        # Available before Progressing, as kubectl describe lists them.
        status["conditions"] = sorted(conditions, key=lambda c: ["Available", "Progressing"].index(c["type"])
                                      if c["type"] in ("Available", "Progressing") else 9)
        annotations = dict(d["metadata"].get("annotations") or {})
        if new_rs is not None:
            revision = (new_rs["metadata"].get("annotations") or {}).get(REVISION)
            if revision and annotations.get(REVISION) != revision:
                try:
                    api.patch(self.d_rt, d["metadata"]["namespace"], d["metadata"]["name"],
                              "application/merge-patch+json", {"metadata": {"annotations": {REVISION: revision}}})
                    d = api.get(self.d_rt, d["metadata"]["namespace"], d["metadata"]["name"])
                except ApiError:
                    return
        if d.get("status") != status:
            try:
                api.update(self.d_rt, d["metadata"]["namespace"], d["metadata"]["name"], dict(d, status=status),
                           subresource="status")
            except ApiError:
                pass

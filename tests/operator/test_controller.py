"""controller.py against an in-memory API: creates once, re-runs change nothing, spec changes update and roll."""
from __future__ import annotations

import copy
from typing import Any

from pagedmodel.operator.children import ANNOTATION_APPLIED, Kube
from pagedmodel.operator.controller import reconcile

from pm_factory import make_pm

CPU = {"model": {"source": "builtin://smollm2"}, "engine": {"maxNumSeqs": 4, "device": "cpu"},
       "resources": {"gpus": 0}}


class FakeKube(Kube):
    """Kube over a dict store: counts writes, bumps resourceVersions, rejects stale PUTs like the API server."""

    def __init__(self, existing: set[str] | None = None) -> None:
        self.store: dict[str, dict[str, Any]] = {}
        self.writes: list[tuple[str, str]] = []
        self.rv = 0
        self.existing = existing or set()

    def _call(self, method: str, path: str, body: Any = None, query: Any = None) -> Any:
        if method == "GET":
            obj = self.store.get(path)
            if obj is None:
                from kubernetes.client.exceptions import ApiException
                raise ApiException(status=404)
            return copy.deepcopy(obj)
        self.rv += 1
        body = copy.deepcopy(body)
        if method == "POST":
            path = f"{path}/{body['metadata']['name']}"
            assert path not in self.store, f"duplicate create of {path}"
        else:
            assert body["metadata"]["resourceVersion"] == self.store[path]["metadata"]["resourceVersion"]
        body["metadata"]["resourceVersion"] = str(self.rv)
        self.store[path] = body
        self.writes.append((method, path))
        return body

    def exists(self, namespace: str, plural: str, name: str) -> bool:
        return f"{plural}/{name}" in self.existing

    def pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        return []


def test_first_pass_creates_every_child_once_and_second_pass_writes_nothing():
    kube = FakeKube()
    first = reconcile(kube, make_pm(CPU), router_enabled=False, now="2026-01-01T00:00:00Z")
    assert [m for m, _ in kube.writes] == ["POST"] * 8
    assert [e.reason for e in first.events] == ["Created", "Progressing"]   # created, no pod ready yet
    assert all(ANNOTATION_APPLIED in o["metadata"]["annotations"] for o in kube.store.values())
    kube.writes.clear()
    pm = make_pm(CPU, status=first.status)
    second = reconcile(kube, pm, router_enabled=False, now="2026-01-01T00:01:00Z")
    assert kube.writes == [] and second.events == []
    assert second.status == first.status           # including lastTransitionTime


def test_engine_flag_change_updates_only_the_engine_deployment_with_an_event():
    kube = FakeKube()
    first = reconcile(kube, make_pm(CPU), router_enabled=False)
    kube.writes.clear()
    changed = {**CPU, "engine": {**CPU["engine"], "maxNumSeqs": 8}}
    out = reconcile(kube, make_pm(changed, generation=2, status=first.status), router_enabled=False)
    assert kube.writes == [("PUT", "/apis/apps/v1/namespaces/ml/deployments/smollm2-engine")]
    reasons = {e.reason: e.message for e in out.events}
    assert reasons["Updated"] == "updated Deployment/smollm2-engine"
    assert reasons["EngineArgsChanged"] == "rolling engines: maxNumSeqs 4 -> 8"
    args = kube.store["/apis/apps/v1/namespaces/ml/deployments/smollm2-engine"]["spec"]["template"]["spec"][
        "containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "8"


def test_hand_scaled_engine_deployment_is_scaled_back():
    kube = FakeKube()
    first = reconcile(kube, make_pm(CPU), router_enabled=False)
    path = "/apis/apps/v1/namespaces/ml/deployments/smollm2-engine"
    kube.store[path]["spec"]["replicas"] = 5          # kubectl scale deployment ... behind the operator's back
    kube.writes.clear()
    reconcile(kube, make_pm(CPU, status=first.status), router_enabled=False)
    assert kube.writes == [("PUT", path)] and kube.store[path]["spec"]["replicas"] == 1


def test_invalid_spec_fails_without_touching_the_cluster_and_warns_once():
    kube = FakeKube()
    bad = {**CPU, "autoscaling": {"minReplicas": 5, "maxReplicas": 2}}
    out = reconcile(kube, make_pm(bad), router_enabled=False)
    assert kube.writes == [] and out.status["phase"] == "Failed"
    assert [(e.type, e.reason) for e in out.events] == [("Warning", "InvalidSpec")]
    assert "spec.autoscaling.minReplicas" in out.events[0].message
    again = reconcile(kube, make_pm(bad, status=out.status), router_enabled=False)
    assert again.events == []


def test_missing_pvc_and_secret_fail_with_an_event_but_children_are_kept():
    kube = FakeKube()
    spec = {**CPU, "model": {"source": "pvc://weights/m"}, "imagePullSecrets": ["regcred"]}
    out = reconcile(kube, make_pm(spec), router_enabled=False)
    assert out.status["phase"] == "Failed" and len(kube.writes) == 8
    warning = next(e for e in out.events if e.reason == "MissingDependency")
    assert "PersistentVolumeClaim 'weights'" in warning.message and "Secret 'regcred'" in warning.message
    ok = FakeKube(existing={"persistentvolumeclaims/weights", "secrets/regcred"})
    assert reconcile(ok, make_pm(spec), router_enabled=False).status["phase"] == "Progressing"


def test_garbled_tuner_annotation_is_ignored_not_fatal():
    kube = FakeKube()
    pm = make_pm(CPU, annotations={"pagedmodel.io/tuned-engine": "{not json"})
    assert reconcile(kube, pm, router_enabled=False).status["engine"]["maxNumSeqs"] == 4
    pm = make_pm(CPU, annotations={"pagedmodel.io/tuned-engine": '{"maxNumSeqs": 16}'})
    assert reconcile(FakeKube(), pm, router_enabled=False).status["engine"]["maxNumSeqs"] == 16


def test_create_race_converges_instead_of_failing():
    """Another pass created the child between our GET and POST: the 409 turns into a normal update check."""
    from kubernetes.client.exceptions import ApiException

    from pagedmodel.operator.reconcile import desired_state

    class RacyKube(FakeKube):
        def _call(self, method, path, body=None, query=None):
            if method == "POST" and not getattr(self, "raced", False):
                self.raced = True
                super()._call(method, path, body)          # the other writer wins...
                raise ApiException(status=409)             # ...and our POST is refused
            return super()._call(method, path, body, query)

    kube = RacyKube()
    manifest = desired_state(make_pm(CPU))[0]
    applied = kube.apply(manifest)
    assert applied.action == "unchanged" and [m for m, _ in kube.writes] == ["POST"]

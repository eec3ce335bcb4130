"""reconcile() against an in-memory API: creates once, re-runs change nothing, spec changes update and roll."""
from __future__ import annotations

import copy
from typing import Any

from pagedmodel.operator.kube_client import ANNOTATION_APPLIED, Kube
from pagedmodel.operator.reconcile import reconcile

from pm_factory import make_pm

CPU = {"model": {"source": "builtin://smollm2"}, "engine": {"maxNumSeqs": 4, "device": "cpu"},
       "resources": {"gpus": 0}}


class FakeKube(Kube):
    """Kube over a dict store: counts writes, bumps resourceVersions; server-side apply (PATCH) replaces the
    operator's fields and keeps the status, as the API server does for a manager owning every spec field."""

    def __init__(self, existing: set[str] | None = None) -> None:
        self.store: dict[str, dict[str, Any]] = {}
        self.writes: list[tuple[str, str]] = []
        self.rv = 0
        self.existing = existing or set()
        self.status_patches: list[dict[str, Any]] = []     # merge patches to the PagedModel's status

    def _call(self, method: str, path: str, body: Any = None, query: Any = None,
              content_type: str = "application/json") -> Any:
        if method == "GET":
            obj = self.store.get(path)
            if obj is None:
                from kubernetes.client.exceptions import ApiException
                raise ApiException(status=404)
            return copy.deepcopy(obj)
        self.rv += 1
        body = copy.deepcopy(body)
        if path.endswith("/status"):
            assert method == "PATCH" and content_type == "application/merge-patch+json"
            self.status_patches.append(body["status"])
            return body
        assert method == "PATCH" and ("fieldManager", "pagedmodel-operator") in query and ("force", "true") in query
        assert "resourceVersion" not in body["metadata"]      # apply never races on a stale version
        if path in self.store and "status" in self.store[path]:
            body["status"] = self.store[path]["status"]
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
    assert [m for m, _ in kube.writes] == ["PATCH"] * 8
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
    assert kube.writes == [("PATCH", "/apis/apps/v1/namespaces/ml/deployments/smollm2-engine")]
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
    assert kube.writes == [("PATCH", path)] and kube.store[path]["spec"]["replicas"] == 1


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


def test_child_created_by_someone_else_is_taken_over_by_apply():
    """A child that exists without our hash (another writer created it) is applied over, not re-created."""
    from pagedmodel.operator.desired_state import desired_state

    kube = FakeKube()
    manifest = desired_state(make_pm(CPU))[0]
    path = kube.path(manifest["kind"], manifest["metadata"]["namespace"], manifest["metadata"]["name"])
    kube.store[path] = {"metadata": {"name": manifest["metadata"]["name"], "resourceVersion": "1"}}
    applied = kube.apply(manifest)
    assert applied.action == "updated" and kube.writes == [("PATCH", path)]
    assert kube.store[path]["metadata"]["annotations"][ANNOTATION_APPLIED]
    assert kube.apply(manifest).action == "unchanged"


def test_the_engine_container_reports_its_log_tail_when_it_fails():
    """Guards: the engine's startup error reaches `kubectl describe pm`: the container's termination message
    falls back to its log's tail (where `pagedmodel serve` prints its one line), which status.py reads."""
    kube = FakeKube()
    reconcile(kube, make_pm(CPU), router_enabled=False, now="2026-01-01T00:00:00Z")
    dep = next(o for p, o in kube.store.items() if p.endswith("/deployments/smollm2-engine"))
    [container] = dep["spec"]["template"]["spec"]["containers"]
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_a_pass_derives_the_spec_once_and_passes_it_down(monkeypatch):
    """Guards issue #48: a pass defaulted the spec 3 times, computed the engine's flags 3 times and parsed the
    model source 4 times. Now: defaults and engine flags once (the tuner leaves the overrides alone here),
    the source once to validate it and once for the children."""
    from pagedmodel.operator import desired_state as desired_module, reconcile as reconcile_module, spec as spec_module

    calls: dict[str, int] = {}

    def counted(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return wrapper

    originals = {"with_defaults": spec_module.with_defaults, "parse_source": spec_module.parse_source,
                 "effective_engine": desired_module.effective_engine}
    for module in (spec_module, desired_module, reconcile_module):      # every name a caller looks up
        for name, original in originals.items():
            if hasattr(module, name):
                monkeypatch.setattr(module, name, counted(name, original))
    reconcile(FakeKube(), make_pm(CPU), router_enabled=False, now="2026-01-01T00:00:00Z")
    assert calls == {"with_defaults": 1, "effective_engine": 1, "parse_source": 2}


def test_status_is_written_once_a_pass_through_patch_status_and_only_what_changed():
    kube = FakeKube()
    first = reconcile(kube, make_pm(CPU), router_enabled=False, now="2026-01-01T00:00:00Z")
    assert kube.status_patches == [first.status]
    kube.status_patches.clear()
    second = reconcile(kube, make_pm(CPU, status=first.status), router_enabled=False, now="2026-01-01T00:01:00Z")
    assert second.status == first.status and kube.status_patches == []
    bigger = {**CPU, "engine": {**CPU["engine"], "maxNumSeqs": 8}}
    third = reconcile(kube, make_pm(bigger, generation=2, status=first.status), router_enabled=False)
    [patch] = kube.status_patches
    assert patch and patch == {k: v for k, v in third.status.items() if first.status.get(k) != v}
    assert patch["engine"]["maxNumSeqs"] == 8

"""Object semantics through the real `kubernetes` client: metadata, errors, selectors, patches, deletion."""
from __future__ import annotations

import pytest
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient

from .helpers import raw, wait_until


def _cm(name: str, **data: str) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data}


def test_version_has_every_field(api_client):
    info = k8s.VersionApi(api_client).get_code()
    assert info.major and info.minor and info.git_version.startswith("v1.")
    for field in ("build_date", "compiler", "git_commit", "git_tree_state", "go_version", "platform"):
        assert getattr(info, field), field


def test_create_sets_server_fields_and_rv_increases(api_client, namespace):
    core = k8s.CoreV1Api(api_client)
    a = core.create_namespaced_config_map(namespace, _cm("a", k="1"))
    b = core.create_namespaced_config_map(namespace, {"metadata": {"generateName": "gen-"}, "data": {}})
    assert a.metadata.uid and a.metadata.creation_timestamp is not None
    assert int(b.metadata.resource_version) > int(a.metadata.resource_version)
    assert b.metadata.name.startswith("gen-") and len(b.metadata.name) == len("gen-") + 5


def test_errors_are_status_bodies(api_client, namespace):
    core = k8s.CoreV1Api(api_client)
    with pytest.raises(ApiException) as missing:
        core.read_namespaced_config_map("nope", namespace)
    assert missing.value.status == 404
    status, body, _ = raw(api_client, "GET", f"/api/v1/namespaces/{namespace}/configmaps/nope")
    assert (status, body["kind"], body["reason"]) == (404, "Status", "NotFound")
    assert body["message"] == 'configmaps "nope" not found'

    core.create_namespaced_config_map(namespace, _cm("dup"))
    status, body, _ = raw(api_client, "POST", f"/api/v1/namespaces/{namespace}/configmaps", body=_cm("dup"))
    assert (status, body["reason"]) == (409, "AlreadyExists")

    stale = core.read_namespaced_config_map("dup", namespace)
    core.patch_namespaced_config_map("dup", namespace, {"data": {"x": "1"}})
    stale.data = {"y": "2"}
    with pytest.raises(ApiException) as conflict:
        core.replace_namespaced_config_map("dup", namespace, stale)
    assert conflict.value.status == 409 and "the object has been modified" in conflict.value.body

    status, body, _ = raw(api_client, "POST", f"/api/v1/namespaces/{namespace}/configmaps", body=_cm("Bad_Name"))
    assert (status, body["reason"]) == (422, "Invalid")
    assert body["details"]["causes"][0]["field"] == "metadata.name"


def test_generation_bumps_only_on_spec_changes(api_client, namespace):
    apps = k8s.AppsV1Api(api_client)
    dep = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "gen"},
           "spec": {"replicas": 0, "selector": {"matchLabels": {"app": "gen"}},
                    "template": {"metadata": {"labels": {"app": "gen"}},
                                 "spec": {"containers": [{"name": "c", "image": "busybox", "command": ["true"]}]}}}}
    created = apps.create_namespaced_deployment(namespace, dep)
    assert created.metadata.generation == 1
    labelled = apps.patch_namespaced_deployment("gen", namespace, {"metadata": {"labels": {"x": "y"}}})
    assert labelled.metadata.generation == 1
    scaled = apps.patch_namespaced_deployment("gen", namespace, {"spec": {"replicas": 0, "paused": True}})
    assert scaled.metadata.generation == 2


def test_label_and_field_selectors_and_paging(api_client, namespace):
    core = k8s.CoreV1Api(api_client)
    for i, tier in enumerate(["web", "web", "db", "cache"]):
        body = _cm(f"cm{i}")
        body["metadata"]["labels"] = {"tier": tier, **({"canary": "yes"} if i == 1 else {})}
        core.create_namespaced_config_map(namespace, body)

    def names(**kw):
        return sorted(c.metadata.name for c in core.list_namespaced_config_map(namespace, **kw).items
                      if c.metadata.name.startswith("cm"))

    assert names(label_selector="tier=web") == ["cm0", "cm1"]
    assert names(label_selector="tier!=web") == ["cm2", "cm3"]
    assert names(label_selector="tier in (db,cache)") == ["cm2", "cm3"]
    assert names(label_selector="tier notin (web),!canary") == ["cm2", "cm3"]
    assert names(label_selector="canary") == ["cm1"]
    assert names(field_selector="metadata.name=cm2") == ["cm2"]
    assert names(field_selector="metadata.name!=cm2", label_selector="tier") == ["cm0", "cm1", "cm3"]

    first = core.list_namespaced_config_map(namespace, label_selector="tier", limit=3)
    assert len(first.items) == 3 and first.metadata._continue
    rest = core.list_namespaced_config_map(namespace, label_selector="tier", limit=3,
                                           _continue=first.metadata._continue)
    assert [c.metadata.name for c in first.items + rest.items] == ["cm0", "cm1", "cm2", "cm3"]
    assert not rest.metadata._continue


def test_patch_kinds(api_client, namespace):
    apps = k8s.AppsV1Api(api_client)
    dep = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "p"},
           "spec": {"replicas": 0, "selector": {"matchLabels": {"app": "p"}},
                    "template": {"metadata": {"labels": {"app": "p"}}, "spec": {"containers": [
                        {"name": "a", "image": "img:1", "env": [{"name": "X", "value": "1"}],
                         "ports": [{"containerPort": 80}]},
                        {"name": "b", "image": "img:1"}]}}}}
    apps.create_namespaced_deployment(namespace, dep)
    path = f"/apis/apps/v1/namespaces/{namespace}/deployments/p"
    # strategic merge: containers merge by name, env by name, ports by containerPort
    smp = {"spec": {"template": {"spec": {"containers": [
        {"name": "a", "image": "img:2", "env": [{"name": "Y", "value": "2"}], "ports": [{"containerPort": 81}]}]}}}}
    status, body, _ = raw(api_client, "PATCH", path, body=smp,
                          headers={"Content-Type": "application/strategic-merge-patch+json"})
    assert status == 200, body
    containers = body["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["a", "b"]
    assert containers[0]["image"] == "img:2"
    assert [e["name"] for e in containers[0]["env"]] == ["X", "Y"]
    assert [p["containerPort"] for p in containers[0]["ports"]] == [80, 81]
    # $patch: delete removes one element by key
    status, body, _ = raw(api_client, "PATCH", path, headers={"Content-Type": "application/strategic-merge-patch+json"},
                          body={"spec": {"template": {"spec": {"containers": [{"name": "b", "$patch": "delete"}]}}}})
    assert [c["name"] for c in body["spec"]["template"]["spec"]["containers"]] == ["a"]
    # merge patch replaces lists wholesale and null deletes
    status, body, _ = raw(api_client, "PATCH", path, headers={"Content-Type": "application/merge-patch+json"},
                          body={"metadata": {"labels": {"k": "v"}}, "spec": {"minReadySeconds": None}})
    assert status == 200 and body["metadata"]["labels"] == {"k": "v"} and "minReadySeconds" not in body["spec"]
    # JSON patch with a passing and a failing test op
    ops = [{"op": "test", "path": "/metadata/labels/k", "value": "v"},
           {"op": "replace", "path": "/metadata/labels/k", "value": "w"}]
    status, body, _ = raw(api_client, "PATCH", path, body=ops, headers={"Content-Type": "application/json-patch+json"})
    assert status == 200 and body["metadata"]["labels"]["k"] == "w"
    status, body, _ = raw(api_client, "PATCH", path, body=ops, headers={"Content-Type": "application/json-patch+json"})
    assert status == 422 and body["kind"] == "Status"


def test_status_and_scale_subresources(api_client, namespace):
    apps = k8s.AppsV1Api(api_client)
    dep = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "s"},
           "spec": {"replicas": 0, "paused": True, "selector": {"matchLabels": {"app": "s"}},
                    "template": {"metadata": {"labels": {"app": "s"}},
                                 "spec": {"containers": [{"name": "c", "image": "i", "command": ["true"]}]}}}}
    apps.create_namespaced_deployment(namespace, dep)
    path = f"/apis/apps/v1/namespaces/{namespace}/deployments/s"
    merge = {"Content-Type": "application/merge-patch+json"}
    # main resource writes ignore status; the status subresource ignores spec
    _, body, _ = raw(api_client, "PATCH", path, body={"status": {"replicas": 7}}, headers=merge)
    assert (body.get("status") or {}).get("replicas") != 7
    _, body, _ = raw(api_client, "PATCH", path + "/status", body={"status": {"replicas": 7}, "spec": {"replicas": 5}},
                     headers=merge)
    assert body["status"]["replicas"] == 7 and body["spec"]["replicas"] == 0
    scale = apps.read_namespaced_deployment_scale("s", namespace)
    assert scale.spec.replicas == 0 and scale.status.selector == "app=s"
    apps.patch_namespaced_deployment_scale("s", namespace, {"spec": {"replicas": 2}})
    assert apps.read_namespaced_deployment("s", namespace).spec.replicas == 2


def test_finalizers_hold_deletion(api_client, namespace):
    core = k8s.CoreV1Api(api_client)
    body = _cm("fin")
    body["metadata"]["finalizers"] = ["e2e.pagedmodel.io/hold"]
    core.create_namespaced_config_map(namespace, body)
    core.delete_namespaced_config_map("fin", namespace)
    held = core.read_namespaced_config_map("fin", namespace)
    assert held.metadata.deletion_timestamp is not None
    status, err, _ = raw(api_client, "PATCH", f"/api/v1/namespaces/{namespace}/configmaps/fin",
                         headers={"Content-Type": "application/merge-patch+json"},
                         body={"metadata": {"finalizers": ["e2e.pagedmodel.io/hold", "another"]}})
    assert status == 422 and "no new finalizers" in err["message"]
    core.patch_namespaced_config_map("fin", namespace, {"metadata": {"finalizers": None}})
    with pytest.raises(ApiException) as gone:
        core.read_namespaced_config_map("fin", namespace)
    assert gone.value.status == 404


@pytest.mark.parametrize("policy", ["Background", "Foreground", "Orphan"])
def test_owner_reference_garbage_collection(api_client, namespace, policy):
    core = k8s.CoreV1Api(api_client)
    owner = core.create_namespaced_config_map(namespace, _cm("owner"))
    child = _cm("child")
    child["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner",
                                             "uid": owner.metadata.uid, "blockOwnerDeletion": True}]
    core.create_namespaced_config_map(namespace, child)
    core.delete_namespaced_config_map("owner", namespace, propagation_policy=policy)

    def exists(name):
        try:
            core.read_namespaced_config_map(name, namespace)
            return True
        except ApiException as exc:
            assert exc.status == 404
            return False

    wait_until(lambda: not exists("owner"), what="owner removal")
    if policy == "Orphan":
        orphan = core.read_namespaced_config_map("child", namespace)
        assert not orphan.metadata.owner_references
    else:
        wait_until(lambda: not exists("child"), what="dependent removal")


def test_namespace_deletion_empties_it(cluster, api_client):
    core = k8s.CoreV1Api(api_client)
    ns = cluster.new_namespace("gone")
    core.create_namespaced_config_map(ns, _cm("x"))
    core.delete_namespace(ns)
    assert core.read_namespace(ns).status.phase == "Terminating"
    status, body, _ = raw(api_client, "POST", f"/api/v1/namespaces/{ns}/configmaps", body=_cm("late"))
    assert status in (403, 404), body

    def gone():
        try:
            core.read_namespace(ns)
            return False
        except ApiException as exc:
            return exc.status == 404

    wait_until(gone, what="namespace removal")


def test_table_output(api_client, namespace):
    k8s.CoreV1Api(api_client).create_namespaced_config_map(namespace, _cm("tbl", a="1", b="2"))
    status, table, _ = raw(api_client, "GET", f"/api/v1/namespaces/{namespace}/configmaps",
                           headers={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"})
    assert status == 200 and table["kind"] == "Table"
    assert [c["name"] for c in table["columnDefinitions"]] == ["Name", "Data", "Age"]
    row = next(r for r in table["rows"] if r["cells"][0] == "tbl")
    assert row["cells"][1] == 2 and row["object"]["metadata"]["name"] == "tbl"


def test_events_core_and_events_k8s_io(api_client, namespace):
    core = k8s.CoreV1Api(api_client)
    cm = core.create_namespaced_config_map(namespace, _cm("ev"))
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "ev", "namespace": namespace, "uid": cm.metadata.uid}
    core.create_namespaced_event(namespace, {"metadata": {"name": "ev.1"}, "involvedObject": ref, "reason": "Poked",
                                             "message": "poked it", "type": "Normal"})
    core.create_namespaced_event(namespace, {"metadata": {"name": "ev.2"}, "reason": "Other", "message": "m",
                                             "involvedObject": dict(ref, name="other", uid="x")})
    found = core.list_namespaced_event(namespace, field_selector=f"involvedObject.uid={cm.metadata.uid},"
                                                                  "involvedObject.kind=ConfigMap")
    assert [e.reason for e in found.items] == ["Poked"]
    new = k8s.EventsV1Api(api_client).list_namespaced_event(namespace, field_selector="regarding.name=ev")
    assert [(e.reason, e.note) for e in new.items] == [("Poked", "poked it")]


def test_dynamic_client_and_discovery(api_client, namespace):
    dyn = DynamicClient(api_client)
    deployments = dyn.resources.get(api_version="apps/v1", kind="Deployment")
    assert deployments.namespaced and "deploy" in deployments.short_names
    assert {"status", "scale"} <= set(deployments.subresources)
    cms = dyn.resources.get(api_version="v1", kind="ConfigMap")
    cms.create(body=_cm("dyn", a="b"), namespace=namespace)
    assert cms.get(name="dyn", namespace=namespace).data.a == "b"
    status, root, _ = raw(api_client, "GET", "/openapi/v3")
    assert status == 200 and "apis/apps/v1" in root["paths"]
    status, doc, _ = raw(api_client, "GET", root["paths"]["apis/apps/v1"]["serverRelativeURL"].split("?")[0])
    patch_op = doc["paths"]["/apis/apps/v1/namespaces/{namespace}/deployments/{name}"]["patch"]
    assert patch_op["x-kubernetes-group-version-kind"]["kind"] == "Deployment"
    assert any(p["name"] == "fieldValidation" for p in patch_op["parameters"])


def test_dry_run_and_delete_collection(api_client, namespace):
    core = k8s.CoreV1Api(api_client)
    dry = core.create_namespaced_config_map(namespace, _cm("dry"), dry_run="All")
    assert dry.metadata.name == "dry"
    with pytest.raises(ApiException):
        core.read_namespaced_config_map("dry", namespace)
    for i in range(3):
        body = _cm(f"bulk{i}")
        body["metadata"]["labels"] = {"bulk": "yes" if i < 2 else "no"}
        core.create_namespaced_config_map(namespace, body)
    core.delete_collection_namespaced_config_map(namespace, label_selector="bulk=yes")
    left = sorted(c.metadata.name for c in core.list_namespaced_config_map(namespace, label_selector="bulk").items)
    assert left == ["bulk2"]


def test_update_via_put_keeps_server_fields(api_client, namespace):
    core = k8s.CoreV1Api(api_client)
    created = core.create_namespaced_config_map(namespace, _cm("put", a="1"))
    status, body, _ = raw(api_client, "PUT", f"/api/v1/namespaces/{namespace}/configmaps/put",
                          body={"apiVersion": "v1", "kind": "ConfigMap",
                                "metadata": {"name": "put", "uid": created.metadata.uid,
                                             "creationTimestamp": "2000-01-01T00:00:00Z"},
                                "data": {"a": "2"}})
    assert status == 200 and body["data"] == {"a": "2"}
    assert body["metadata"]["creationTimestamp"] == created.metadata.creation_timestamp.strftime("%Y-%m-%dT%H:%M:%SZ")
    status, body, _ = raw(api_client, "PUT", f"/api/v1/namespaces/{namespace}/configmaps/put",
                          body={"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "other"}})
    assert status == 400 and "does not match the name on the URL" in body["message"]
    status, body, _ = raw(api_client, "POST", f"/api/v1/namespaces/{namespace}/configmaps",
                          body={"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "wrongkind"}})
    assert status == 400 and "does not match the expected kind" in body["message"]


def test_events_k8s_io_writes_are_core_events(api_client, namespace):
    events_v1 = k8s.EventsV1Api(api_client)
    events_v1.create_namespaced_event(namespace, {
        "apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"name": "new-style"},
        "eventTime": "2026-01-01T00:00:00.000000Z", "reportingController": "e2e.pagedmodel.io/test",
        "reportingInstance": "e2e-1", "action": "Testing", "reason": "NewStyle", "note": "written via events.k8s.io",
        "type": "Normal", "regarding": {"kind": "Namespace", "name": namespace}})
    core = k8s.CoreV1Api(api_client).read_namespaced_event("new-style", namespace)
    assert (core.reason, core.message, core.involved_object.name) == ("NewStyle", "written via events.k8s.io",
                                                                       namespace)
    assert core.reporting_component == "e2e.pagedmodel.io/test"


def test_protected_namespaces_cannot_be_deleted(api_client):
    status, body, _ = raw(api_client, "DELETE", "/api/v1/namespaces/default")
    assert status == 403 and body["reason"] == "Forbidden"


@pytest.mark.parametrize("query", [{"limit": "ten"}, {"watch": "1", "timeoutSeconds": "soon"},
                                   {"labelSelector": "a in b"}, {"fieldSelector": "nonsense"}])
def test_bad_query_parameters_are_400(api_client, namespace, query):
    status, body, _ = raw(api_client, "GET", f"/api/v1/namespaces/{namespace}/configmaps", query=query)
    assert status == 400 and body["kind"] == "Status" and body["reason"] == "BadRequest", body


def test_immutable_fields(api_client, namespace):
    core = k8s.CoreV1Api(api_client)
    frozen = _cm("frozen", a="1")
    frozen["immutable"] = True
    core.create_namespaced_config_map(namespace, frozen)
    status, body, _ = raw(api_client, "PATCH", f"/api/v1/namespaces/{namespace}/configmaps/frozen",
                          headers={"Content-Type": "application/merge-patch+json"}, body={"data": {"a": "2"}})
    assert status == 422 and "field is immutable when `immutable` is set" in body["message"]
    apps = k8s.AppsV1Api(api_client)
    apps.create_namespaced_deployment(namespace, {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "sel"},
        "spec": {"replicas": 0, "selector": {"matchLabels": {"app": "sel"}},
                 "template": {"metadata": {"labels": {"app": "sel", "v": "1"}},
                              "spec": {"containers": [{"name": "c", "image": "i", "command": ["true"]}]}}}})
    status, body, _ = raw(api_client, "PATCH", f"/apis/apps/v1/namespaces/{namespace}/deployments/sel",
                          headers={"Content-Type": "application/merge-patch+json"},
                          body={"spec": {"selector": {"matchLabels": {"app": "sel", "v": "1"}}}})
    assert status == 422 and "spec.selector" in body["message"] and "field is immutable" in body["message"]


def test_unknown_fields_of_builtin_kinds_are_dropped_with_a_warning(api_client, namespace):
    body = _cm("typo", a="1")
    body["metadata"]["labelz"] = {"x": "y"}
    body["dataa"] = {"b": "2"}
    status, created, headers = raw(api_client, "POST", f"/api/v1/namespaces/{namespace}/configmaps", body=body)
    assert status == 201 and "dataa" not in created and "labelz" not in created["metadata"]
    assert 'unknown field \\"dataa\\"' in headers["Warning"] and 'unknown field \\"metadata.labelz\\"' in headers["Warning"]
    status, err, _ = raw(api_client, "POST", f"/api/v1/namespaces/{namespace}/configmaps",
                         query={"fieldValidation": "Strict"}, body=dict(body, metadata={"name": "strict"}))
    assert status == 400 and 'strict decoding error: unknown field "dataa"' in err["message"]

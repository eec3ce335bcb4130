"""CustomResourceDefinitions: discovery, conditions, schema validation, defaulting, pruning, columns, cleanup."""
from __future__ import annotations

import copy


from kubernetes import client as k8s
from kubernetes.dynamic import DynamicClient

from .helpers import WIDGET_CRD, raw, wait_until

GROUP, VERSION, PLURAL = "e2e.pagedmodel.io", "v1", "widgets"


def _widget(obj_name: str, **spec) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Widget", "metadata": {"name": obj_name}, "spec": spec}


def test_crd_status_and_discovery(api_client, widget_crd):
    crd = k8s.ApiextensionsV1Api(api_client).read_custom_resource_definition(widget_crd["metadata"]["name"])
    conditions = {c.type: c.status for c in crd.status.conditions}
    assert conditions == {"NamesAccepted": "True", "Established": "True"}
    assert crd.status.accepted_names.kind == "Widget" and crd.status.stored_versions == ["v1"]
    status, doc, _ = raw(api_client, "GET", f"/apis/{GROUP}/{VERSION}")
    names = {r["name"]: r for r in doc["resources"]}
    assert {"widgets", "widgets/status", "widgets/scale"} <= set(names)
    assert names["widgets"]["shortNames"] == ["wdg"] and names["widgets"]["categories"] == ["e2e"]
    _, groups, _ = raw(api_client, "GET", "/apis")
    assert GROUP in {g["name"] for g in groups["groups"]}


def test_schema_validation_messages(api_client, namespace, widget_crd):
    status, body, _ = raw(api_client, "POST", f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}",
                          body=_widget("bad", size=11, color="green", name="Abc", tags=["a", "b", "c", "d"]))
    assert status == 422 and body["reason"] == "Invalid"
    causes = {c["field"]: c["message"] for c in body["details"]["causes"]}
    assert causes["spec.size"] == "Invalid value: 11: spec.size in body should be less than or equal to 10"
    assert causes["spec.color"] == 'Unsupported value: "green": supported values: "red", "blue"'
    assert causes["spec.name"] == "Invalid value: \"Abc\": spec.name in body should match '^[a-z]+$'"
    assert causes["spec.tags"] == "Too many: 4: must have at most 3 items"
    assert body["message"].startswith('Widget.e2e.pagedmodel.io "bad" is invalid: [')
    status, body, _ = raw(api_client, "POST", f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}",
                          body=_widget("untyped", size="three"))
    assert status == 422
    assert body["details"]["causes"][0]["message"] == \
        'Invalid value: "string": spec.size in body must be of type integer: "string"'
    status, body, _ = raw(api_client, "POST", f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}",
                          body={"apiVersion": f"{GROUP}/{VERSION}", "kind": "Widget", "metadata": {"name": "nospec"},
                                "spec": {}})
    assert status == 422 and body["details"]["causes"][0] == {"reason": "FieldValueRequired",
                                                              "message": "Required value", "field": "spec.size"}


def test_defaults_pruning_and_strict_field_validation(api_client, namespace, widget_crd):
    custom = k8s.CustomObjectsApi(api_client)
    body = _widget("w", size=2, unknown="x", extra={"free": {"form": 1}})
    created = custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)
    assert created["spec"]["color"] == "red" and created["spec"]["replicas"] == 1
    assert "unknown" not in created["spec"] and created["spec"]["extra"] == {"free": {"form": 1}}
    status, _, headers = raw(api_client, "POST", f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}",
                             body=_widget("warned", size=1, bogus=True))
    assert status == 201 and 'unknown field \\"spec.bogus\\"' in headers.get("Warning", "")
    status, err, _ = raw(api_client, "POST", f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}",
                         query={"fieldValidation": "Strict"}, body=_widget("strict", size=1, bogus=True))
    assert status == 400 and 'strict decoding error: unknown field "spec.bogus"' in err["message"]


def test_status_scale_and_generation(api_client, namespace, widget_crd):
    custom = k8s.CustomObjectsApi(api_client)
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, _widget("s", size=1))
    after_status = custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, "s", {"status": {"replicas": 1, "selector": "app=s"}, "spec": {"size": 9}})
    assert after_status["spec"]["size"] == 1 and after_status["metadata"]["generation"] == 1
    ignored = custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "s",
                                                    {"status": {"replicas": 5}})
    assert ignored["status"]["replicas"] == 1 and ignored["metadata"]["generation"] == 1
    custom.patch_namespaced_custom_object_scale(GROUP, VERSION, namespace, PLURAL, "s", {"spec": {"replicas": 4}})
    scaled = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "s")
    assert scaled["spec"]["replicas"] == 4 and scaled["metadata"]["generation"] == 2
    scale = custom.get_namespaced_custom_object_scale(GROUP, VERSION, namespace, PLURAL, "s")
    assert scale["status"] == {"replicas": 1, "selector": "app=s"}
    status, _, _ = raw(api_client, "PATCH", f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/s",
                       body={"spec": {"size": 3}},
                       headers={"Content-Type": "application/strategic-merge-patch+json"})
    assert status == 415   # custom resources take merge and JSON patches only


def test_printer_columns_in_tables(api_client, namespace, widget_crd):
    custom = k8s.CustomObjectsApi(api_client)
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, _widget("t", size=5, color="blue"))
    custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, "t",
                                                 {"status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    _, table, _ = raw(api_client, "GET", f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}",
                      headers={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"})
    assert [c["name"] for c in table["columnDefinitions"]] == ["Name", "Size", "Color", "Ready", "Age"]
    row = next(r for r in table["rows"] if r["cells"][0] == "t")
    assert row["cells"][1:4] == [5, "blue", "True"] and row["cells"][4].endswith("s")


def test_deleting_crd_removes_resources_and_discovery(cluster, api_client, namespace):
    crd = copy.deepcopy(WIDGET_CRD)
    crd["metadata"]["name"] = "gadgets.e2e.pagedmodel.io"
    crd["spec"]["names"] = {"plural": "gadgets", "singular": "gadget", "kind": "Gadget"}
    ext = k8s.ApiextensionsV1Api(api_client)
    ext.create_custom_resource_definition(crd)
    dyn = DynamicClient(api_client)
    gadgets = wait_until(lambda: dyn.resources.get(api_version=f"{GROUP}/{VERSION}", kind="Gadget"),
                         what="Gadget discovery")
    gadgets.create(namespace=namespace, body={"apiVersion": f"{GROUP}/{VERSION}", "kind": "Gadget",
                                              "metadata": {"name": "g"}, "spec": {"size": 1}})
    ext.delete_custom_resource_definition(crd["metadata"]["name"])

    def gone():
        status, _, _ = raw(api_client, "GET", f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/gadgets")
        return status == 404

    wait_until(gone, what="gadgets endpoint removal")
    _, doc, _ = raw(api_client, "GET", f"/apis/{GROUP}/{VERSION}")
    assert "gadgets" not in {r["name"] for r in doc.get("resources", [])}

"""Patch semantics as pure functions (the API tests cover them over HTTP too)."""
from __future__ import annotations

import pytest

from e2e.apiserver.errors import ApiError
from e2e.apiserver.patch import json_patch, merge_patch, strategic_merge_patch


def test_merge_patch_rfc7386_examples():
    assert merge_patch({"a": "b"}, {"a": "c"}) == {"a": "c"}
    assert merge_patch({"a": "b"}, {"b": "c"}) == {"a": "b", "b": "c"}
    assert merge_patch({"a": "b"}, {"a": None}) == {}
    assert merge_patch({"a": [{"b": "c"}]}, {"a": [1]}) == {"a": [1]}
    assert merge_patch({"e": None}, {"a": 1}) == {"e": None, "a": 1}
    assert merge_patch({"a": {"b": "c"}}, {"a": {"b": "d", "c": None}}) == {"a": {"b": "d"}}


def test_json_patch_ops_and_failures():
    doc = {"a": {"b": [1, 2]}, "c": "x"}
    out = json_patch(doc, [{"op": "add", "path": "/a/b/-", "value": 3},
                           {"op": "add", "path": "/a/b/0", "value": 0},
                           {"op": "remove", "path": "/c"},
                           {"op": "copy", "from": "/a/b", "path": "/d"},
                           {"op": "move", "from": "/d", "path": "/e"},
                           {"op": "replace", "path": "/a/b/1", "value": 9},
                           {"op": "add", "path": "/k~1x", "value": "slash"},
                           {"op": "test", "path": "/e", "value": [0, 1, 2, 3]}])
    assert out == {"a": {"b": [0, 9, 2, 3]}, "e": [0, 1, 2, 3], "k/x": "slash"}
    assert doc == {"a": {"b": [1, 2]}, "c": "x"}   # input untouched
    with pytest.raises(ApiError) as failed:
        json_patch(doc, [{"op": "test", "path": "/c", "value": "y"}])
    assert failed.value.code == 422
    with pytest.raises(ApiError) as missing:
        json_patch(doc, [{"op": "remove", "path": "/nope"}])
    assert missing.value.code == 422
    with pytest.raises(ApiError) as bad:
        json_patch(doc, {"op": "add"})
    assert bad.value.code == 400


def test_strategic_merge_by_key_and_directives():
    pod = {"spec": {"containers": [{"name": "a", "image": "1", "ports": [{"containerPort": 80}],
                                    "env": [{"name": "X", "value": "1"}, {"name": "Y", "value": "2"}]},
                                   {"name": "b", "image": "1"}],
                    "volumes": [{"name": "v1"}], "tolerations": [{"key": "t"}]},
           "metadata": {"finalizers": ["f1"]},
           "status": {"conditions": [{"type": "Ready", "status": "False"}]}}
    patch = {"spec": {"containers": [{"name": "a", "image": "2", "ports": [{"containerPort": 81}],
                                      "env": [{"name": "Y", "$patch": "delete"}, {"name": "Z", "value": "3"}]},
                                     {"name": "c", "image": "1"}],
                      "$setElementOrder/containers": [{"name": "c"}, {"name": "a"}, {"name": "b"}],
                      "tolerations": [{"key": "u"}]},
             "metadata": {"finalizers": ["f2"], "$deleteFromPrimitiveList/finalizers": ["f1"]},
             "status": {"conditions": [{"type": "Ready", "status": "True"}, {"type": "Other", "status": "x"}]}}
    out = strategic_merge_patch(pod, patch)
    assert [c["name"] for c in out["spec"]["containers"]] == ["c", "a", "b"]
    a = out["spec"]["containers"][1]
    assert a["image"] == "2" and [p["containerPort"] for p in a["ports"]] == [80, 81]
    assert a["env"] == [{"name": "X", "value": "1"}, {"name": "Z", "value": "3"}]
    assert out["spec"]["tolerations"] == [{"key": "u"}]   # no merge key: replaced
    assert out["metadata"]["finalizers"] == ["f2"]
    assert out["status"]["conditions"] == [{"type": "Ready", "status": "True"}, {"type": "Other", "status": "x"}]
    assert strategic_merge_patch({"spec": {"a": 1, "b": 2}}, {"spec": {"$patch": "replace", "c": 3}}) == \
        {"spec": {"c": 3}}
    assert strategic_merge_patch({"spec": {"a": 1, "b": 2}}, {"spec": {"$retainKeys": ["a"], "a": 5}}) == \
        {"spec": {"a": 5}}
    service = strategic_merge_patch({"spec": {"ports": [{"port": 80, "name": "http"}]}},
                                    {"spec": {"ports": [{"port": 80, "targetPort": 8080}, {"port": 443}]}})
    assert service["spec"]["ports"] == [{"port": 80, "name": "http", "targetPort": 8080}, {"port": 443}]

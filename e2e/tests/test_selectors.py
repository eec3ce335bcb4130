"""Label and field selector parsing, and the printer-column JSONPath subset."""
from __future__ import annotations

import pytest

from e2e.apiserver import jsonpath
from e2e.apiserver.errors import ApiError
from e2e.apiserver.selectors import (field_selector_name, labels_match, parse_field_selector, parse_label_selector,
                                     selector_from_label_selector, selector_string)


def _obj(**labels):
    return {"metadata": {"name": "n", "labels": labels}, "involvedObject": {"kind": "Pod", "uid": "u1"}}


@pytest.mark.parametrize("selector,labels,expected", [
    ("app=web", {"app": "web"}, True),
    ("app==web", {"app": "db"}, False),
    ("app!=web", {}, True),
    ("tier in (a, b)", {"tier": "b"}, True),
    ("tier notin (a,b)", {"tier": "a"}, False),
    ("tier notin (a,b)", {}, True),
    ("app.kubernetes.io/name", {"app.kubernetes.io/name": "x"}, True),
    ("!canary", {"canary": "1"}, False),
    ("app=web,tier in (a),!canary", {"app": "web", "tier": "a"}, True),
])
def test_label_selectors(selector, labels, expected):
    assert labels_match(parse_label_selector(selector), _obj(**labels)) is expected


def test_bad_label_selector_is_400():
    with pytest.raises(ApiError) as err:
        parse_label_selector("a in b")
    assert err.value.code == 400


def test_field_selectors():
    match = parse_field_selector("involvedObject.kind=Pod,involvedObject.uid!=u2,metadata.name==n")
    assert match(_obj()) and not parse_field_selector("involvedObject.uid=u2")(_obj())
    assert field_selector_name("metadata.namespace=x,metadata.name=foo") == "foo"
    with pytest.raises(ApiError):
        parse_field_selector("no-operator")


def test_label_selector_objects_round_trip():
    sel = {"matchLabels": {"b": "2", "a": "1"}, "matchExpressions": [{"key": "t", "operator": "In", "values": ["x"]},
                                                                     {"key": "g", "operator": "DoesNotExist"}]}
    assert selector_string(sel) == "a=1,b=2,t in (x),!g"
    assert labels_match(selector_from_label_selector(sel), _obj(a="1", b="2", t="x"))
    assert not labels_match(selector_from_label_selector(sel), _obj(a="1", b="2", t="x", g="y"))


def test_jsonpath_subset():
    obj = {"status": {"conditions": [{"type": "Ready", "status": "True"}, {"type": "X", "status": "False"}]},
           "metadata": {"labels": {"app.kubernetes.io/name": "m"}}, "spec": {"items": [{"n": 1}, {"n": 2}]}}
    assert jsonpath.evaluate(obj, '.status.conditions[?(@.type=="Ready")].status') == ["True"]
    assert jsonpath.evaluate(obj, ".spec.items[*].n") == [1, 2]
    assert jsonpath.evaluate(obj, ".spec.items[-1].n") == [2]
    assert jsonpath.evaluate(obj, r".metadata.labels.app\.kubernetes\.io/name") == ["m"]
    assert jsonpath.evaluate(obj, ".metadata.labels['app.kubernetes.io/name']") == ["m"]
    assert jsonpath.evaluate(obj, ".missing.path") == []
    with pytest.raises(ValueError):
        jsonpath.evaluate(obj, ".a[?(bad)]")

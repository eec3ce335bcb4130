"""CRD structural schemas: defaulting, pruning and validation messages as pure functions."""
from __future__ import annotations

from e2e.apiserver.schema import apply_defaults, prune, validate

SCHEMA = {
    "type": "object",
    "properties": {
        "spec": {"type": "object", "required": ["n"], "properties": {
            "n": {"type": "integer", "minimum": 0, "exclusiveMaximum": True, "maximum": 10, "multipleOf": 2},
            "f": {"type": "number"},
            "port": {"x-kubernetes-int-or-string": True},
            "mode": {"type": "string", "enum": ["A", "B"], "default": "A"},
            "items": {"type": "array", "minItems": 1, "uniqueItems": True,
                      "items": {"type": "object", "properties": {"k": {"type": "string", "default": "d"}}}},
            "labels": {"type": "object", "additionalProperties": {"type": "string", "minLength": 2}},
            "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            "maybe": {"type": "string", "nullable": True},
            "when": {"type": "string", "format": "date-time"},
        }},
    },
}


def _messages(obj):
    return {e.field: e.message for e in validate(SCHEMA, obj)}


def test_defaults_fill_nested_objects_and_items():
    obj = {"spec": {"n": 2, "items": [{}, {"k": "x"}]}}
    apply_defaults(SCHEMA, obj)
    assert obj["spec"]["mode"] == "A" and obj["spec"]["items"] == [{"k": "d"}, {"k": "x"}]


def test_prune_drops_unknown_but_keeps_preserved_and_top_level():
    obj = {"apiVersion": "x/v1", "kind": "K", "metadata": {"name": "n"},
           "spec": {"n": 1, "bogus": 1, "free": {"any": {"thing": 1}}, "items": [{"k": "a", "z": 1}]}, "extra": 1}
    unknown: list[str] = []
    prune(SCHEMA, obj, "", unknown, top=True)
    assert sorted(unknown) == ["extra", "spec.bogus", "spec.items[0].z"]
    assert obj["spec"] == {"n": 1, "free": {"any": {"thing": 1}}, "items": [{"k": "a"}]}
    assert obj["metadata"] == {"name": "n"}


def test_prune_never_touches_metadata_even_when_the_schema_declares_it():
    # a CRD may say `metadata: {type: object}`; the API server still keeps name, labels and the rest
    schema = {"type": "object", "properties": {"metadata": {"type": "object"}, "spec": {"type": "object"}}}
    obj = {"apiVersion": "x/v1", "kind": "K", "metadata": {"name": "n", "labels": {"a": "b"}}, "spec": {}}
    unknown: list[str] = []
    prune(schema, obj, "", unknown, top=True)
    assert obj["metadata"] == {"name": "n", "labels": {"a": "b"}} and unknown == []


def test_validation_messages_match_the_api_server():
    assert _messages({"spec": {"n": 10}}) == {
        "spec.n": "Invalid value: 10: spec.n in body should be less than 10"}
    assert _messages({"spec": {"n": -2}}) == {
        "spec.n": "Invalid value: -2: spec.n in body should be greater than or equal to 0"}
    assert _messages({"spec": {"n": 3}}) == {"spec.n": "Invalid value: 3: spec.n in body should be a multiple of 2"}
    assert _messages({"spec": {}}) == {"spec.n": "Required value"}
    assert _messages({"spec": {"n": True}}) == {
        "spec.n": 'Invalid value: "boolean": spec.n in body must be of type integer: "boolean"'}
    assert _messages({"spec": {"n": 2, "mode": "C"}}) == {
        "spec.mode": 'Unsupported value: "C": supported values: "A", "B"'}
    assert _messages({"spec": {"n": 2, "items": []}}) == {
        "spec.items": "Invalid value: 0: spec.items in body should have at least 1 items"}
    assert _messages({"spec": {"n": 2, "items": [{"k": "a"}, {"k": "a"}]}}) == {
        "spec.items": 'Duplicate value: {"k":"a"}'}
    assert _messages({"spec": {"n": 2, "labels": {"a": "x"}}}) == {
        "spec.labels.a": 'Invalid value: "x": spec.labels.a in body should be at least 2 chars long'}
    assert _messages({"spec": {"n": 2, "port": 1.5}}) == {
        "spec.port": 'Invalid value: "number": spec.port in body must be of type integer,string: "number"'}
    assert _messages({"spec": {"n": 2, "f": 1, "port": "http", "maybe": None, "when": "2026-01-01T00:00:00Z"}}) == {}
    assert "spec.when" in _messages({"spec": {"n": 2, "when": "yesterday"}})

"""spec.adapters: sources and container paths, validation, the LoRA flags and volumes of the engine pod, and
that the pod template does not follow the adapter list (adding an adapter must not roll the engines)."""
from __future__ import annotations

import pytest

from pagedmodel.operator.adapters import (ADAPTER_MOUNT, AdapterSource, adapter_volumes, container_path,
                                          desired_adapters, lora_args, parse_adapter_source)
from pagedmodel.operator.desired_state import desired_state
from pagedmodel.operator.spec import MANAGED_FLAGS, validate, with_defaults

from pm_factory import make_pm

BASE = {"model": {"source": "builtin://smollm2", "servedName": "smollm2"}, "engine": {"device": "cpu"},
        "resources": {"gpus": 0}}


def spec_with(adapters, **engine):
    return {**BASE, "adapters": adapters, "engine": {**BASE["engine"], **engine}}


def engine_template(spec):
    deployment = next(m for m in desired_state(make_pm(spec)) if m["kind"] == "Deployment"
                      and m["metadata"]["name"].endswith("-engine"))
    return deployment["spec"]["template"]


@pytest.mark.parametrize("source, parsed, path", [
    ("pvc://adapters/sql", AdapterSource("pvc", "adapters", "sql"), f"{ADAPTER_MOUNT}/adapters/sql"),
    ("pvc://adapters/team/chat/", AdapterSource("pvc", "adapters", "team/chat"), f"{ADAPTER_MOUNT}/adapters/team/chat"),
    ("pvc://one-adapter", AdapterSource("pvc", "one-adapter", ""), f"{ADAPTER_MOUNT}/one-adapter"),
    ("file:///opt/adapters/sql", AdapterSource("file", "", "/opt/adapters/sql"), "/opt/adapters/sql"),
    ("hf://acme/sql-lora.v2", AdapterSource("hf", "", "hf://acme/sql-lora.v2"), "hf://acme/sql-lora.v2"),
])
def test_sources_resolve_to_paths_inside_the_container(source, parsed, path):
    assert parse_adapter_source(source) == parsed
    assert container_path(parsed) == path


@pytest.mark.parametrize("source, words", [
    ("hf://org", "not a Hugging Face Hub id hf://ORG/NAME"),
    ("hf://org/a/b", "not a Hugging Face Hub id hf://ORG/NAME"),
    ("hf://org/../x", "not a Hugging Face Hub id hf://ORG/NAME"),
    ("s3://bucket/x", "not one of pvc://, file://, hf://"),
    ("pvc://Bad_Claim/x", "not a valid Kubernetes name"),
    ("pvc://claim/../other", "'..'"),
    ("file://relative/dir", "absolute directory"),
    ("file:///", "absolute directory"),
    ("file:///a b", "whitespace"),
    ("/opt/adapters", "is not pvc://CLAIM/PATH, file:///PATH or hf://ORG/NAME"),
    (42, "is not pvc://CLAIM/PATH, file:///PATH or hf://ORG/NAME"),
])
def test_bad_sources_say_why(source, words):
    with pytest.raises(ValueError) as info:
        parse_adapter_source(source)
    assert words in str(info.value)


@pytest.mark.parametrize("adapters, field, words", [
    ([{"name": "sql", "source": "pvc://a/sql"}, {"name": "sql", "source": "pvc://a/other"}],
     "spec.adapters[1].name", "listed twice"),
    ([{"name": "smollm2", "source": "pvc://a/sql"}], "spec.adapters[0].name", "served name"),
    ([{"name": "-sql", "source": "pvc://a/sql"}], "spec.adapters[0].name", "letters, digits"),
    ([{"name": "has space", "source": "pvc://a/sql"}], "spec.adapters[0].name", "letters, digits"),
    ([{"source": "pvc://a/sql"}], "spec.adapters[0].name", "is required"),
    ([{"name": "sql", "source": "hf://org/sql/extra"}], "spec.adapters[0].source", "hf://ORG/NAME"),
    ([{"name": "sql"}], "spec.adapters[0].source", "pvc://CLAIM/PATH"),
    (["sql"], "spec.adapters[0]", "must be an object"),
    ({"sql": "pvc://a/sql"}, "spec.adapters", "must be a list"),
    ([{"name": f"a{i}", "source": "pvc://a/x"} for i in range(65)], "spec.adapters", "at most 64"),
])
def test_adapter_rules_name_the_field(adapters, field, words):
    errors = validate(with_defaults(spec_with(adapters)), "smollm2")
    assert any(e.field == field and words in e.message for e in errors), errors


def test_default_served_name_is_the_pagedmodel_name():
    spec = {**BASE, "model": {"source": "builtin://smollm2"}, "adapters": [{"name": "mymodel", "source": "pvc://a/x"}]}
    assert [e.field for e in validate(with_defaults(spec), "mymodel")] == ["spec.adapters[0].name"]
    assert validate(with_defaults(spec), "other") == []


def test_lora_limits_are_checked_and_lora_flags_are_managed():
    assert {"--enable-lora", "--max-loras", "--max-lora-rank", "--lora-modules"} <= MANAGED_FLAGS
    errors = validate(with_defaults(spec_with([], maxLoras=0, maxLoraRank=True, extraArgs=["--lora-modules=a=/x"])))
    assert {e.field for e in errors} == {"spec.engine.maxLoras", "spec.engine.maxLoraRank", "spec.engine.extraArgs[0]"}


def test_lora_flags_only_with_adapters_present_and_never_lora_modules():
    assert lora_args(with_defaults(BASE)) == []
    assert "--enable-lora" not in engine_template(BASE)["spec"]["containers"][0]["args"]
    for adapters in ([], [{"name": "sql", "source": "pvc://a/sql"}]):
        args = engine_template(spec_with(adapters))["spec"]["containers"][0]["args"]
        assert args[args.index("--enable-lora"):args.index("--enable-lora") + 5] == [
            "--enable-lora", "--max-loras", "4", "--max-lora-rank", "16"]
        assert "--lora-modules" not in args
    args = engine_template(spec_with([], maxLoras=2, maxLoraRank=64))["spec"]["containers"][0]["args"]
    assert args[args.index("--max-loras") + 1] == "2" and args[args.index("--max-lora-rank") + 1] == "64"


def test_adding_or_removing_adapters_on_a_mounted_claim_leaves_the_pod_template_unchanged():
    one = [{"name": "sql", "source": "pvc://adapters/sql"}]
    two = one + [{"name": "chat", "source": "pvc://adapters/chat"}, {"name": "img", "source": "file:///opt/img"}]
    assert engine_template(spec_with(one)) == engine_template(spec_with(two)) == engine_template(
        spec_with([{"name": "x", "source": "pvc://adapters/x"}]))
    # the empty list keeps LoRA on and the template of a file:// only list
    assert engine_template(spec_with([])) == engine_template(spec_with([{"name": "i", "source": "file:///opt/i"}]))


def test_hf_adapters_are_fetched_by_the_engines_into_a_writable_cache_every_lora_pod_has():
    hub = [{"name": "sql", "source": "hf://acme/sql-lora"}]
    template = engine_template(spec_with(hub))
    container = template["spec"]["containers"][0]
    assert {"name": "HF_HOME", "value": "/var/cache/huggingface"} in container["env"]
    assert {"name": "hf-cache", "mountPath": "/var/cache/huggingface"} in container["volumeMounts"]
    assert {"name": "hf-cache", "emptyDir": {}} in template["spec"]["volumes"]
    # the cache is there before any hf:// adapter: adding the first one rolls nothing
    assert template == engine_template(spec_with([])) == engine_template(spec_with(hub + [
        {"name": "chat", "source": "hf://acme/chat-lora"}]))
    assert [a.path for a in desired_adapters(with_defaults(spec_with(hub)))] == ["hf://acme/sql-lora"]
    assert "HF_HOME" not in {e["name"] for e in engine_template(BASE)["spec"]["containers"][0]["env"]}


def test_a_new_claim_adds_a_read_only_volume_and_does_change_the_template():
    spec = with_defaults(spec_with([{"name": "sql", "source": "pvc://adapters/sql"},
                                    {"name": "chat", "source": "pvc://team-b/chat"},
                                    {"name": "again", "source": "pvc://adapters/again"}]))
    volumes, mounts = adapter_volumes(spec)
    assert [v["persistentVolumeClaim"] for v in volumes] == [{"claimName": "adapters", "readOnly": True},
                                                              {"claimName": "team-b", "readOnly": True}]
    assert [(m["mountPath"], m["readOnly"]) for m in mounts] == [("/adapters/adapters", True),
                                                                  ("/adapters/team-b", True)]
    assert all(len(v["name"]) <= 63 for v in volumes) and len({v["name"] for v in volumes}) == 2
    template = engine_template(spec)
    assert {v["name"] for v in volumes} <= {v["name"] for v in template["spec"]["volumes"]}
    assert template != engine_template(spec_with([{"name": "sql", "source": "pvc://adapters/sql"}]))
    assert [a.path for a in desired_adapters(spec)] == ["/adapters/adapters/sql", "/adapters/team-b/chat",
                                                        "/adapters/adapters/again"]


def test_crd_schema_carries_the_adapter_rules(crd, crd_schema):
    import re

    spec = crd_schema["properties"]["spec"]["properties"]
    adapters = spec["adapters"]
    assert adapters["x-kubernetes-list-type"] == "map" and adapters["x-kubernetes-list-map-keys"] == ["name"]
    assert adapters["items"]["required"] == ["name", "source"]
    name = re.compile(adapters["items"]["properties"]["name"]["pattern"])
    source = re.compile(adapters["items"]["properties"]["source"]["pattern"])
    assert name.match("sql-v2.1/team") and not name.match("-x") and not name.match("a b")
    assert source.match("pvc://adapters/sql") and source.match("file:///opt/a") and not source.match("s3://b/x")
    assert source.match("hf://acme/sql-lora") and not source.match("hf://acme") and not source.match("hf://a/b/c")
    rules = [r["rule"] for r in adapters["items"]["x-kubernetes-validations"]]
    assert any("[.][.]" in r for r in rules)
    root_rules = [r["rule"] for r in crd_schema["x-kubernetes-validations"]]
    assert any("servedName" in r and "self.metadata.name" in r for r in root_rules)
    engine = spec["engine"]["properties"]
    assert (engine["maxLoras"]["minimum"], engine["maxLoras"]["maximum"]) == (1, 64)
    assert (engine["maxLoraRank"]["minimum"], engine["maxLoraRank"]["maximum"]) == (1, 512)

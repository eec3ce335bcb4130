"""LoRA adapters through the operator, end to end (issue #17 item 4).

A PagedModel with two adapters (PEFT directories made by peft on SmolLM2-135M, random non-zero weights)
runs two engines (`pagedmodel serve` in the chart's image on the real node, CPU, float32) under a real
`pagedmodel operator`. The adapters reach the pods as users ship them: on a PersistentVolumeClaim
(`pvc://adapters/NAME`), here bound to a hostPath PersistentVolume over the directory peft wrote. Requests to each
adapter's name through the model's Service, and to every engine pod, give the offline engine's greedy
text for that adapter (`LLM(enable_lora=True)` + `LoRARequest`). Adding a third adapter to the spec makes
it servable on every engine with the pods' UIDs, restart counts and the Deployment's template unchanged;
an adapter that cannot load is a Warning, a status message and AdaptersReady=False while the others serve.
The CRD's CEL rules for spec.adapters are checked by the real API server.
"""
from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from .helpers import wait_until
from .test_operator_pagedmodel import operator, pagedmodel_crd, pm_json  # noqa: F401  (pagedmodel_crd: fixture)

NAME = "lora"
ENGINES = 2
PROMPT = "The capital of France is"
NEW_TOKENS = 10
ADAPTER_SEEDS = {"sql": 11, "chat": 12, "math": 13}


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory) -> dict[str, Path]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from lora_adapters import make_peft_adapter
    from pagedmodel.server.engine.model_store import resolve_model

    base, root = resolve_model(None), tmp_path_factory.mktemp("adapters")
    return {name: make_peft_adapter(base, root / name, rank=8, seed=seed, std=0.05)
            for name, seed in ADAPTER_SEEDS.items()}


@pytest.fixture(scope="module")
def offline(adapter_dirs) -> dict[str | None, str]:
    """The offline engine's greedy text per adapter (None: the base model)."""
    from pagedmodel import LLM, LoRARequest, SamplingParams

    llm = LLM(model="smollm2", device="cpu", dtype="float32", enable_lora=True, max_loras=len(adapter_dirs),
              max_lora_rank=8, max_model_len=256, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    out: dict[str | None, str] = {None: llm.generate([PROMPT], params)[0].outputs[0].text}
    for i, (name, path) in enumerate(adapter_dirs.items(), start=1):
        out[name] = llm.generate([PROMPT], params, lora_request=LoRARequest(name, i, str(path)))[0].outputs[0].text
    del llm
    gc.collect()
    assert len(set(out.values())) == len(out), out          # every adapter changes the greedy text
    return out


CLAIM = "adapters"


@pytest.fixture
def adapter_claim(cluster, namespace, adapter_dirs) -> str:
    """The PVC ``adapters`` in the test's namespace, bound to a hostPath PV over the adapters' directory
    (readable by the engines' uid 1000)."""
    root = next(iter(adapter_dirs.values())).parent
    subprocess.run(["chmod", "-R", "a+rX", str(root)], check=True)
    volume = f"adapters-{namespace}"
    objects = [
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": volume},
         "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"], "storageClassName": "",
                  "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(root), "type": "Directory"},
                  "claimRef": {"namespace": namespace, "name": CLAIM}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": CLAIM, "namespace": namespace},
         "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": volume,
                  "resources": {"requests": {"storage": "1Gi"}}}}]
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(objects))
    wait_until(lambda: cluster.kubectl_json("get", "pvc", CLAIM, namespace=namespace)["status"].get("phase") == "Bound",
               timeout=60, what="the adapters' claim Bound")
    yield CLAIM
    cluster.kubectl("delete", "pv", volume, "--wait=false", check=False)


def manifest(adapters: dict[str, Path]) -> str:
    spec = {
        "model": {"source": "builtin://smollm2", "servedName": "smollm2"},
        "adapters": [{"name": n, "source": f"pvc://{CLAIM}/{p.name}"} for n, p in adapters.items()],
        "engine": {"maxNumSeqs": 4, "maxModelLen": 256, "kvCacheMemoryBytes": 16000000, "swapSpaceGiB": 0,
                   "device": "cpu", "dtype": "float32", "maxLoras": 4, "maxLoraRank": 8},
        "resources": {"gpus": 0, "cpu": "1", "memory": "2Gi"},
        "replicas": ENGINES,
    }
    return yaml.safe_dump({"apiVersion": "pagedmodel.io/v1alpha1", "kind": "PagedModel",
                           "metadata": {"name": NAME}, "spec": spec})


def engine_pods(cluster, namespace: str) -> list[dict[str, Any]]:
    return cluster.kubectl_json("get", "pods", "-l", f"pagedmodel.io/name={NAME},app.kubernetes.io/component=engine",
                                namespace=namespace)["items"]


def complete(url: str, model: str) -> str:
    r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": NEW_TOKENS,
                                                 "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == model
    return body["choices"][0]["text"]


def adapters_on(ip: str) -> dict[str, str]:
    cards = httpx.get(f"http://{ip}:8000/v1/models", timeout=10).json()["data"]
    return {c["id"]: c["parent"] for c in cards if c.get("parent")}


def adapters_settled(cluster, namespace: str, want: str):
    def check():
        st = pm_json(cluster, namespace, NAME).get("status") or {}
        entries = st.get("adapters") or []
        ok = (st.get("adaptersReady") == want and st.get("readyReplicas") == ENGINES
              and all(a["readyReplicas"] == ENGINES for a in entries))
        return st if ok else None
    return check


def identity(pods: list[dict[str, Any]]) -> dict[str, tuple[str, int]]:
    return {p["metadata"]["name"]: (p["metadata"]["uid"], p["status"]["containerStatuses"][0]["restartCount"])
            for p in pods}


def test_adapters_served_through_the_service_and_added_without_restarts(cluster, namespace, pagedmodel_crd,
                                                                         local_node, adapter_dirs, adapter_claim,
                                                                         offline, tmp_path):
    first_two = {n: adapter_dirs[n] for n in ("sql", "chat")}
    with operator(cluster, namespace, tmp_path / "operator.log"):
        cluster.kubectl("apply", "-f", "-", stdin=manifest(first_two), namespace=namespace)
        status = wait_until(adapters_settled(cluster, namespace, "2/2"), timeout=240, interval=1,
                            what="both adapters loaded on both engines")
        assert [(a["name"], a["readyReplicas"], a["message"]) for a in status["adapters"]] == [
            ("sql", ENGINES, ""), ("chat", ENGINES, "")]
        conditions = {c["type"]: c for c in status["conditions"]}
        assert conditions["AdaptersReady"]["status"] == "True", conditions["AdaptersReady"]

        # Through the Service, each name gives its adapter's text, and the base model its own.
        with cluster.service_url(namespace, NAME, 80) as url:
            for model in ("sql", "chat"):
                assert complete(url, model) == offline[model], model
            assert complete(url, "smollm2") == offline[None]
        pods = engine_pods(cluster, namespace)
        assert len(pods) == ENGINES
        for pod in pods:                                         # and on every replica, not just one
            ip = pod["status"]["podIP"]
            assert adapters_on(ip) == {"sql": "smollm2", "chat": "smollm2"}
            assert complete(f"http://{ip}:8000", "chat") == offline["chat"]
            args = pod["spec"]["containers"][0]["args"]
            assert "--enable-lora" in args and "--lora-modules" not in args
        before = identity(pods)
        deployment = cluster.kubectl_json("get", "deployment", f"{NAME}-engine", namespace=namespace)

        # A third adapter: loaded into the running engines, nothing restarts or rolls.
        cluster.kubectl("apply", "-f", "-", stdin=manifest(adapter_dirs), namespace=namespace)
        wait_until(adapters_settled(cluster, namespace, "3/3"), timeout=120, interval=1,
                   what="the third adapter loaded on both engines")
        pods = engine_pods(cluster, namespace)
        assert identity(pods) == before
        after = cluster.kubectl_json("get", "deployment", f"{NAME}-engine", namespace=namespace)
        assert after["metadata"]["generation"] == deployment["metadata"]["generation"]
        assert after["spec"]["template"] == deployment["spec"]["template"]
        for pod in pods:
            ip = pod["status"]["podIP"]
            assert set(adapters_on(ip)) == {"sql", "chat", "math"}
            assert complete(f"http://{ip}:8000", "math") == offline["math"]
        row = cluster.kubectl("get", "pm", NAME, "--no-headers", namespace=namespace).stdout.split()
        assert "3/3" in row, row                                  # the Adapters printer column
        reasons = [(e["reason"], e["message"]) for e in cluster.kubectl_json(
            "get", "events", "--field-selector", f"involvedObject.name={NAME}", namespace=namespace)["items"]]
        assert any(r == "AdapterLoaded" and m.startswith("adapter math loaded on ") for r, m in reasons), reasons

        # An adapter that cannot load: a Warning and a status message; the others keep serving.
        broken = {**adapter_dirs, "broken": Path("no-such-adapter")}
        cluster.kubectl("apply", "-f", "-", stdin=manifest(broken), namespace=namespace)

        def load_failed():
            st = pm_json(cluster, namespace, NAME).get("status") or {}
            cond = {c["type"]: c for c in st.get("conditions") or []}.get("AdaptersReady") or {}
            return st if cond.get("reason") == "LoadFailed" else None
        st = wait_until(load_failed, timeout=60, interval=1, what="AdaptersReady=False, LoadFailed")
        entry = next(a for a in st["adapters"] if a["name"] == "broken")
        # the engine's reason, relayed: a path with nothing there (404, as vLLM answers it)
        assert entry["readyReplicas"] == 0 and "does not exist" in entry["message"], entry
        assert st["adaptersReady"] == "3/4" and st["phase"] == "Ready"
        warnings = [e for e in cluster.kubectl_json("get", "events", "--field-selector",
                                                    f"involvedObject.name={NAME},type=Warning",
                                                    namespace=namespace)["items"]]
        assert any(e["reason"] == "AdapterLoadFailed" and "broken" in e["message"] for e in warnings), warnings
        assert complete(f"http://{pods[0]['status']['podIP']}:8000", "sql") == offline["sql"]
        assert identity(engine_pods(cluster, namespace)) == before


@pytest.mark.parametrize("adapters, words", [
    ([{"name": "sql", "source": "file:///a"}, {"name": "sql", "source": "file:///b"}], "Duplicate value"),
    ([{"name": "smollm2", "source": "file:///a"}], "must differ from the model's served name"),
    ([{"name": "sql", "source": "hf://org/sql/extra"}], "spec.adapters[0].source"),
    ([{"name": "sql", "source": "pvc://claim/../x"}], "must not contain '..'"),
    ([{"name": "sql", "source": "s3://bucket/x"}], "spec.adapters[0].source"),
    ([{"name": "-sql", "source": "file:///a"}], "spec.adapters[0].name"),
])
def test_the_api_server_rejects_bad_adapters(cluster, namespace, pagedmodel_crd, adapters, words):
    doc = {"apiVersion": "pagedmodel.io/v1alpha1", "kind": "PagedModel", "metadata": {"name": "bad"},
           "spec": {"model": {"source": "builtin://smollm2", "servedName": "smollm2"}, "adapters": adapters}}
    result = cluster.kubectl("apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump(doc), namespace=namespace,
                             check=False)
    assert result.returncode != 0 and words in result.stderr, result.stderr


def test_the_api_server_accepts_every_adapter_source_scheme(cluster, namespace, pagedmodel_crd):
    adapters = [{"name": "sql", "source": "pvc://adapters/sql"}, {"name": "chat", "source": "file:///opt/chat"},
                {"name": "hub", "source": "hf://acme/sql-lora.v2"}]
    doc = {"apiVersion": "pagedmodel.io/v1alpha1", "kind": "PagedModel", "metadata": {"name": "good"},
           "spec": {"model": {"source": "builtin://smollm2", "servedName": "smollm2"}, "adapters": adapters}}
    result = cluster.kubectl("apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump(doc), namespace=namespace,
                             check=False)
    assert result.returncode == 0, result.stderr


def test_the_default_served_name_is_the_object_name(cluster, namespace, pagedmodel_crd):
    doc = {"apiVersion": "pagedmodel.io/v1alpha1", "kind": "PagedModel", "metadata": {"name": "mine"},
           "spec": {"model": {"source": "builtin://smollm2"}, "adapters": [{"name": "mine", "source": "file:///a"}]}}
    result = cluster.kubectl("apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump(doc), namespace=namespace,
                             check=False)
    assert result.returncode != 0 and "must differ from the model's served name" in result.stderr, result.stderr

"""LoRA adapters through the HTTP API with the real `openai` SDK: `model` picks the adapter and the
text equals HF transformers + peft's greedy output for it; /v1/models lists adapters with their
parent; adapters load and unload at run time (vLLM's endpoints) with clear 4xx for bad input;
vllm:lora_requests_info is exported."""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from lora_adapters import hf_peft_greedy_all, make_peft_adapter

from .conftest import ServerProcess

PROMPT = "The capital of France is"
NEW = 6


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, server_model_dir):
    root = tmp_path_factory.mktemp("api-adapters")
    return {"a8": make_peft_adapter(server_model_dir, root / "a8", rank=8, seed=1),
            "a16": make_peft_adapter(server_model_dir, root / "a16", rank=16, targets=("q_proj", "v_proj"), seed=2)}


@pytest.fixture(scope="module")
def expected(server_model_dir, adapters) -> dict:
    """Greedy text per model name (base and each adapter) from HF transformers + peft."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(server_model_dir))
    ids = tok.encode(PROMPT)
    ref = hf_peft_greedy_all(server_model_dir, {"base": None, **adapters}, [ids], NEW)
    return {name: tok.decode(tokens[0]) for name, tokens in ref.items()}


@pytest.fixture(scope="module")
def lora_server(server_model_dir, adapters, tmp_path_factory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("lora-server") / "serve.log"
    srv = ServerProcess(server_model_dir, log, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
                        "--lora-modules", f"a8={adapters['a8']}", "--served-model-name", "base", "--dtype", "float32")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def _client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0)


def _complete(srv: ServerProcess, model: str) -> openai.types.Completion:
    return _client(srv).completions.create(model=model, prompt=PROMPT, max_tokens=NEW, temperature=0.0,
                                           extra_body={"ignore_eos": True})


def test_model_names_the_adapter_and_outputs_match_hf_peft(lora_server, expected):
    assert expected["a8"] != expected["base"]
    for model in ("a8", "base"):
        out = _complete(lora_server, model)
        assert out.model == model
        assert out.choices[0].text == expected[model]
    chunks = list(_client(lora_server).completions.create(model="a8", prompt=PROMPT, max_tokens=NEW, temperature=0.0,
                                                          stream=True, extra_body={"ignore_eos": True}))
    assert {c.model for c in chunks} == {"a8"}
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected["a8"]


def test_models_lists_adapters_with_parent(lora_server, adapters):
    models = {m.id: m for m in _client(lora_server).models.list().data}
    assert set(models) == {"base", "a8"}
    assert models["a8"].parent == "base" and models["a8"].root == str(adapters["a8"])
    assert getattr(models["base"], "parent", None) is None


def test_unknown_model_is_404(lora_server):
    with pytest.raises(openai.NotFoundError) as info:
        _complete(lora_server, "nope")
    assert info.value.body["code"] == "model_not_found" and "`a8`" in info.value.body["message"]


def test_runtime_load_and_unload(lora_server, adapters, expected, tmp_path):
    url = lora_server.base_url
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "a16", "lora_path": str(adapters["a16"])})
    assert r.status_code == 200, r.text
    assert _complete(lora_server, "a16").choices[0].text == expected["a16"]
    assert {m.id for m in _client(lora_server).models.list().data} == {"base", "a8", "a16"}
    again = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "a16", "lora_path": str(adapters["a16"])})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    bad = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path)})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    assert "adapter_config.json" in bad.json()["error"]["message"]
    # a path with nothing there is 404 as in vLLM (an adapter we cannot use stays 400)
    gone = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "gone", "lora_path": str(tmp_path / "nope")})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_path", gone.text
    assert "does not exist" in gone.json()["error"]["message"]
    missing = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a16"})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        _complete(lora_server, "a16")
    gone = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a16"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    assert httpx.get(url + "/health").status_code == 200
    assert _complete(lora_server, "a8").choices[0].text == expected["a8"]   # the others are untouched


def test_lora_requests_info_metric(lora_server):
    from pagedmodel import metrics_contract as mc

    _complete(lora_server, "a8")
    samples = [s for s in mc.parse(httpx.get(lora_server.base_url + "/metrics").text)
               if s.name == "vllm:lora_requests_info"]
    assert len(samples) == 1
    assert samples[0].labels["max_lora"] == "2" and samples[0].value > 0
    assert set(samples[0].labels) == {"max_lora", "waiting_lora_adapters", "running_lora_adapters"}


def test_without_enable_lora_the_endpoints_say_so(api_server):
    r = httpx.post(api_server.base_url + "/v1/load_lora_adapter", headers=api_server.headers,
                   json={"lora_name": "a", "lora_path": "/tmp"})
    assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]
    assert "vllm:lora_requests_info" not in httpx.get(api_server.base_url + "/metrics").text

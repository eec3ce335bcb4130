"""vLLM's serving surface beyond the OpenAI routes, against a live `pagedmodel serve`: /tokenize,
/detokenize, /version, /ping, and the metrics vLLM-aware routers and dashboards read."""
from __future__ import annotations

from importlib.metadata import version

import httpx
import pytest

from .conftest import API_KEY, ServerProcess

MODEL = "tiny-smol"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def _post(srv: ServerProcess, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(srv.base_url + path, json=body, headers=AUTH if headers is None else headers, timeout=60)


def test_tokenize_a_prompt_matches_what_completions_count_and_detokenize_inverts_it(api_server: ServerProcess) -> None:
    r = _post(api_server, "/tokenize", {"model": MODEL, "prompt": "The capital of France is",
                                        "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) == 5      # what the completions test counts for this prompt
    assert body["max_model_len"] == 256
    assert len(body["token_strs"]) == 5 and body["token_strs"][0] == "The"
    comp = _post(api_server, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 1}).json()
    assert comp["usage"]["prompt_tokens"] == body["count"]
    back = _post(api_server, "/detokenize", {"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "The capital of France is"}
    assert _post(api_server, "/tokenize", {"prompt": "hi"}).json()["token_strs"] is None


def test_tokenize_messages_counts_the_chat_prompt_tools_included(api_server: ServerProcess) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    plain = _post(api_server, "/tokenize", {"messages": messages}).json()
    chat = _post(api_server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}).json()
    assert plain["count"] == chat["usage"]["prompt_tokens"]
    with_tools = _post(api_server, "/tokenize", {"messages": messages, "tools": TOOLS}).json()
    chat_tools = _post(api_server, "/v1/chat/completions", {"messages": messages, "tools": TOOLS,
                                                            "tool_choice": "none", "max_tokens": 1}).json()
    assert with_tools["count"] == chat_tools["usage"]["prompt_tokens"] > plain["count"]
    text = _post(api_server, "/detokenize", {"tokens": with_tools["tokens"]}).json()["prompt"]
    assert '"name": "get_weather"' in text and "<tools>" in text   # the template ignores tools: Hermes text
    no_gen = _post(api_server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert no_gen["count"] < plain["count"]


@pytest.mark.parametrize("path,body,param", [
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, "tokens.0"),   # pydantic type errors name the element
    ("/tokenize", {}, "messages"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "y"}], "tools": [{"type": "function"}]},
     "tools[0].function"),
    ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
])
def test_bad_tokenize_requests_are_400s_naming_the_field(api_server: ServerProcess, path: str, body: dict,
                                                         param: str) -> None:
    r = _post(api_server, path, body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param
    assert httpx.get(api_server.base_url + "/ping", timeout=10).status_code == 200


def test_version_ping_and_the_api_key(api_server: ServerProcess) -> None:
    assert _post(api_server, "/tokenize", {"prompt": "x"}, headers={}).status_code == 401
    assert _post(api_server, "/detokenize", {"tokens": [1]}, headers={}).status_code == 401
    v = httpx.get(api_server.base_url + "/version", timeout=10)
    assert v.status_code == 200 and v.json() == {"version": version("pagedmodel")}
    assert httpx.get(api_server.base_url + "/ping", timeout=10).json() == {"status": "ok"}
    assert httpx.post(api_server.base_url + "/ping", timeout=10).status_code == 200


def test_vllm_metrics_cache_config_phases_iteration_tokens_and_params(api_server: ServerProcess) -> None:
    before = api_server.metrics()
    r = _post(api_server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 7, "n": 2,
                                              "ignore_eos": True})
    assert r.status_code == 200, r.text
    after = api_server.metrics()

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    info = [k for k in after if k.startswith("vllm:cache_config_info{")]
    assert len(info) == 1 and after[info[0]] == 1.0
    import torch

    from pagedmodel.server.engine.device import pick_dtype
    auto = str(pick_dtype("auto", None, torch.device("cpu"))).removeprefix("torch.")   # bf16 on AMX/AVX512-BF16
    # the CPU's default --block-size, as the server was started without one
    assert 'block_size="128"' in info[0] and 'num_gpu_blocks="' in info[0] and f'cache_dtype="{auto}"' in info[0]
    assert grew("vllm:request_prefill_time_seconds_count") == 1
    assert grew("vllm:request_decode_time_seconds_count") == 1
    assert grew("vllm:request_decode_time_seconds_sum") > 0
    # inference = prefill + decode of the one request; its time per output token = decode / (7 - 1)
    assert grew("vllm:request_inference_time_seconds_count") == 1
    phases = grew("vllm:request_prefill_time_seconds_sum") + grew("vllm:request_decode_time_seconds_sum")
    assert abs(grew("vllm:request_inference_time_seconds_sum") - phases) < 1e-6
    assert grew("vllm:request_time_per_output_token_seconds_count") == 1
    assert abs(grew("vllm:request_time_per_output_token_seconds_sum")
               - grew("vllm:request_decode_time_seconds_sum") / 6) < 1e-6
    assert after["vllm:prompt_tokens_cached_total"] == after["vllm:prefix_cache_hits_total"]
    # 4 prompt tokens once, then 2 samples x 7 tokens: at least 7 steps, 18 tokens in all
    assert grew("vllm:iteration_tokens_total_count") >= 7
    assert grew("vllm:iteration_tokens_total_sum") == 4 + 14
    assert grew("vllm:request_params_n_count") == 1 and grew("vllm:request_params_n_sum") == 2
    assert grew('vllm:request_params_n_bucket{le="1.0",model_name="tiny-smol"}') == 0
    assert grew('vllm:request_params_n_bucket{le="2.0",model_name="tiny-smol"}') == 1
    assert grew("vllm:request_params_max_tokens_sum") == 7


# A template that reads `tools` (Qwen2.5-like): HF's apply_chat_template(tools=...) renders them itself.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}"
    "\n</tools><|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tools_template_server(server_model_dir, tmp_path_factory):
    import json
    import shutil

    model = tmp_path_factory.mktemp("tools-template") / "model"
    shutil.copytree(server_model_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOLS_TEMPLATE}))
    srv = ServerProcess(model, model.parent / "server.log", "--max-model-len", "256", "--kv-cache-memory",
                        str(8 << 20), "--served-model-name", MODEL, api_key=API_KEY)
    try:
        yield srv.wait_ready(), model
    finally:
        srv.stop()


def test_tokenize_with_tools_is_hfs_render_when_the_template_reads_tools(tools_template_server) -> None:
    """vLLM's /tokenize is HF's apply_chat_template(tools=...); ours is too whenever the template renders
    tools itself (a template that ignores them gets them as Hermes text instead: the test above)."""
    from transformers import AutoTokenizer

    srv, model = tools_template_server
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    ours = _post(srv, "/tokenize", {"messages": messages, "tools": TOOLS}).json()
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    hf = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "get_weather" in hf
    assert ours["tokens"] == tokenizer(hf, add_special_tokens=False)["input_ids"]

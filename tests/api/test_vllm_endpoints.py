"""vLLM's extra endpoints: /invocations (SageMaker), /tokenizer_info and /load behind their flags."""
from __future__ import annotations

import threading

import httpx
import pytest

from pagedmodel.server.api.vllm_endpoints import invocation_kind, tokenizer_info
from pagedmodel.server.api.errors import APIError
from support import assert_openai_error, wait_until

from .conftest import API_KEY, VLLM_KEY, VLLM_MODEL, ServerProcess

AUTH = {"Authorization": f"Bearer {VLLM_KEY}"}


def test_invocations_serves_chat_and_completions_bodies(api_server: ServerProcess) -> None:
    url = api_server.base_url + "/invocations"
    chat = httpx.post(url, headers=api_server.headers, timeout=60,
                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    completion = httpx.post(url, headers=api_server.headers, timeout=60, json={"prompt": "Hi", "max_tokens": 3})
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    streamed = httpx.post(url, headers=api_server.headers, timeout=60,
                          json={"prompt": "Hi", "max_tokens": 3, "stream": True})
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")


def test_invocations_refuses_what_neither_endpoint_takes(api_server: ServerProcess) -> None:
    url = api_server.base_url + "/invocations"
    r = httpx.post(url, headers=api_server.headers, timeout=30, json={"input": "embed me"})
    assert "messages" in assert_openai_error(r.status_code, r.content, 400)["message"]
    # a body of the right shape is checked as that endpoint checks it
    r = httpx.post(url, headers=api_server.headers, timeout=30, json={"prompt": "Hi", "max_tokens": -1})
    assert_openai_error(r.status_code, r.content, 400, "max_tokens")
    assert httpx.post(url, json={"prompt": "Hi"}, timeout=30).status_code == 401   # behind the API key


def test_invocation_kind() -> None:
    assert invocation_kind({"messages": [], "prompt": "x"}) == "chat"   # chat first, as vLLM tries it first
    assert invocation_kind({"prompt": [1, 2]}) == "completions"
    with pytest.raises(APIError):
        invocation_kind({"model": "m"})


def test_tokenizer_info_only_with_its_flag(api_server: ServerProcess, vllm_server: ServerProcess) -> None:
    r = httpx.get(api_server.base_url + "/tokenizer_info", headers=api_server.headers, timeout=10)
    assert_openai_error(r.status_code, r.content, 404)
    info = httpx.get(vllm_server.base_url + "/tokenizer_info", headers=AUTH, timeout=10).json()
    assert isinstance(info["tokenizer_class"], str) and info["tokenizer_class"]
    assert "<|im_start|>" in info["chat_template"]
    assert isinstance(info["model_max_length"], int)
    decoder = info["added_tokens_decoder"]
    assert decoder and all(isinstance(tok["content"], str) for tok in decoder.values())


def test_tokenizer_info_leaves_out_what_json_cannot_carry() -> None:
    class Tok:
        init_kwargs = {"model_max_length": 8, "handle": object(), "names": ["a", object()]}
        chat_template = None
    assert tokenizer_info(Tok()) == {"model_max_length": 8, "names": ["a"], "tokenizer_class": "Tok"}


def test_load_counts_requests_in_progress(vllm_server: ServerProcess, api_server: ServerProcess) -> None:
    load_url = vllm_server.base_url + "/load"
    assert httpx.get(load_url, headers=AUTH, timeout=10).json() == {"server_load": 0}
    seen: list[int] = []

    def stream_slowly() -> None:
        body = {"model": VLLM_MODEL, "prompt": "Count", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", vllm_server.base_url + "/v1/completions", json=body, headers=AUTH,
                          timeout=120) as r:
            for _ in r.iter_lines():
                if not seen:   # the stream has begun: the load is 1 while it runs
                    seen.append(httpx.get(load_url, headers=AUTH, timeout=10).json()["server_load"])
    worker = threading.Thread(target=stream_slowly)
    worker.start()
    worker.join(120)
    assert seen == [1]
    assert wait_until(lambda: httpx.get(load_url, headers=AUTH, timeout=10).json()["server_load"] == 0, timeout=10)
    # without --enable-server-load-tracking, /load is there and stays 0 (as in vLLM)
    r = httpx.get(api_server.base_url + "/load", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
    assert r.json() == {"server_load": 0}


def test_chat_batch_answers_each_conversation_as_its_own_chat(api_server: ServerProcess) -> None:
    """vLLM's /v1/chat/completions/batch: choice i is what /v1/chat/completions answers conversation i."""
    conversations = [[{"role": "user", "content": "Name a colour."}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to three."}]]
    common = {"max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 2, "ignore_eos": True}
    r = httpx.post(api_server.base_url + "/v1/chat/completions/batch", headers=api_server.headers, timeout=60,
                   json={"messages": conversations, **common})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and [c["index"] for c in body["choices"]] == [0, 1]
    prompt_tokens = 0
    for conversation, choice in zip(conversations, body["choices"]):
        single = httpx.post(api_server.base_url + "/v1/chat/completions", headers=api_server.headers, timeout=60,
                            json={"messages": conversation, **common}).json()
        assert choice["message"] == single["choices"][0]["message"]
        assert choice["logprobs"] == single["choices"][0]["logprobs"]
        prompt_tokens += single["usage"]["prompt_tokens"]
    assert body["usage"]["prompt_tokens"] == prompt_tokens and body["usage"]["completion_tokens"] == 12


@pytest.mark.parametrize("extra, param", [
    ({"stream": True}, "stream"),
    ({"n": 2}, "n"),
    ({"use_beam_search": True, "n": 1, "best_of": 2}, "use_beam_search"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tools"),
    ({"messages": []}, "messages"),
    ({"messages": [[]]}, "messages.0"),
    ({"messages": [[{"role": "user", "content": "hi"}]], "temperature": -1}, "temperature"),
])
def test_chat_batch_refuses_what_it_cannot_answer(api_server: ServerProcess, extra: dict, param: str) -> None:
    body = {"messages": [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]], "max_tokens": 2,
            **extra}
    r = httpx.post(api_server.base_url + "/v1/chat/completions/batch", headers=api_server.headers, timeout=60,
                   json=body)
    assert_openai_error(r.status_code, r.text, 400, param=param)

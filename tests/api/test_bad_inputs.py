"""Malformed and hostile requests: each gets the right 4xx and an OpenAI error body, and the server survives."""
from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from .conftest import ServerProcess

MODEL = "tiny-smol"
C = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def comp(**kw: Any) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 2, **kw}).encode()


def chat(**kw: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": USER, "max_tokens": 2, **kw}).encode()


# (id, method, path, body, content-type, status, param the error must name or None for "don't care")
CASES: list[tuple[str, str, str, bytes | None, str | None, int, str | None]] = [
    ("invalid-json", "POST", C, b'{"model": "tiny-smol", "prompt": ', "application/json", 400, None),
    ("trailing-garbage", "POST", C, comp() + b"}}", "application/json", 400, None),
    ("non-utf8-bytes", "POST", C, b'{"prompt": "\xff\xfe\xfa"}', "application/json", 400, None),
    ("wrong-content-type", "POST", C, comp(), "text/plain", 415, None),
    ("form-content-type", "POST", C, b"prompt=hello", "application/x-www-form-urlencoded", 415, None),
    ("json-array-body", "POST", C, b"[1, 2, 3]", "application/json", 400, None),
    ("empty-body", "POST", C, b"", "application/json", 400, None),
    ("nan-constant", "POST", C, b'{"prompt": "x", "temperature": NaN}', "application/json", 400, None),
    ("deeply-nested", "POST", C, b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", "application/json", 400, None),
    ("missing-prompt", "POST", C, json.dumps({"model": MODEL}).encode(), None, 400, "prompt"),
    ("prompt-wrong-type", "POST", C, comp(prompt=12), None, 400, "prompt"),
    ("empty-prompt", "POST", C, comp(prompt=""), None, 400, "prompt"),
    ("empty-prompt-list", "POST", C, comp(prompt=[]), None, 400, "prompt"),
    ("too-many-prompts", "POST", C, comp(prompt=["a"] * 100), None, 400, "prompt"),
    ("max-tokens-string", "POST", C, comp(max_tokens="16"), None, 400, "max_tokens"),
    ("max-tokens-negative", "POST", C, comp(max_tokens=-5), None, 400, "max_tokens"),
    ("max-tokens-zero", "POST", C, comp(max_tokens=0), None, 400, "max_tokens"),
    ("max-tokens-huge", "POST", C, comp(max_tokens=10**12), None, 400, "max_tokens"),
    ("temperature-negative", "POST", C, comp(temperature=-0.5), None, 400, "temperature"),
    ("temperature-string", "POST", C, comp(temperature="hot"), None, 400, "temperature"),
    ("top-p-zero", "POST", C, comp(top_p=0), None, 400, "top_p"),
    ("top-p-above-one", "POST", C, comp(top_p=1.5), None, 400, "top_p"),
    ("top-k-negative", "POST", C, comp(top_k=-5), None, 400, "top_k"),
    ("min-p-above-one", "POST", C, comp(min_p=2), None, 400, "min_p"),
    ("presence-penalty-out-of-range", "POST", C, comp(presence_penalty=5), None, 400, "presence_penalty"),
    ("repetition-penalty-zero", "POST", C, comp(repetition_penalty=0), None, 400, "repetition_penalty"),
    ("n-zero", "POST", C, comp(n=0), None, 400, "n"),
    ("n-beyond-limit", "POST", C, comp(n=1000, temperature=1.0), None, 400, "n"),
    ("n-bool", "POST", C, comp(n=True), None, 400, "n"),
    ("best-of-below-n", "POST", C, comp(n=3, best_of=2, temperature=1.0), None, 400, "best_of"),
    ("greedy-with-n2", "POST", C, comp(n=2, temperature=0), None, 400, "n"),
    ("seed-beyond-int64", "POST", C, comp(seed=2**63), None, 400, "seed"),   # negative int64 seeds are fine
    ("seed-float", "POST", C, comp(seed=1.5), None, 400, "seed"),
    ("stream-not-a-boolean", "POST", C, comp(stream="maybe"), None, 400, "stream"),   # "true"/"yes" coerce
    ("stream-options-without-stream", "POST", C, comp(stream_options={"include_usage": True}), None, 400,
     "stream_options"),
    ("logprobs-too-many", "POST", C, comp(logprobs=100), None, 400, "logprobs"),
    ("echo-with-logprobs-too-many", "POST", C, comp(echo=True, logprobs=21), None, 400, "logprobs"),
    ("enormous-stop-list", "POST", C, comp(stop=[f"s{i}" for i in range(5000)]), None, 400, "stop"),
    ("stop-string-too-long", "POST", C, comp(stop=["x" * 10000]), None, 400, "stop"),
    ("stop-wrong-type", "POST", C, comp(stop=[1, 2]), None, 400, "stop.0"),
    ("stop-token-ids-negative", "POST", C, comp(stop_token_ids=[-3]), None, 400, "stop_token_ids"),
    ("stop-token-ids-out-of-vocab", "POST", C, comp(stop_token_ids=[10**9]), None, 400, "stop_token_ids"),
    ("logit-bias-not-a-token-id", "POST", C, comp(logit_bias={"hello": 100}), None, 400, "logit_bias"),
    ("logit-bias-out-of-vocab", "POST", C, comp(logit_bias={"49152": 1}), None, 400, "logit_bias"),
    ("token-id-out-of-vocab", "POST", C, comp(prompt=[1, 2, 49152]), None, 400, "prompt"),
    ("token-id-negative", "POST", C, comp(prompt=[5, -1]), None, 400, "prompt"),
    ("prompt-over-max-model-len", "POST", C, comp(prompt=[100] * 300), None, 400, "prompt"),
    ("prompt-plus-max-tokens-over-len", "POST", C, comp(prompt=[100] * 250, max_tokens=10), None, 400, "max_tokens"),
    ("lone-surrogate-prompt", "POST", C, b'{"prompt": "abc \\ud800 def", "max_tokens": 2}', "application/json", 400,
     "prompt"),
    ("unknown-model", "POST", C, comp(model="gpt-4"), None, 404, "model"),
    ("unknown-model-chat", "POST", CHAT, chat(model="no-such-model"), None, 404, "model"),
    ("chat-missing-messages", "POST", CHAT, json.dumps({"model": MODEL}).encode(), None, 400, "messages"),
    ("chat-empty-messages", "POST", CHAT, chat(messages=[]), None, 400, "messages"),
    ("chat-role-not-a-string", "POST", CHAT, chat(messages=[{"role": 7, "content": "hi"}]), None, 400,
     "messages.0.role"),
    ("chat-content-wrong-type", "POST", CHAT, chat(messages=[{"role": "user", "content": 42}]), None, 400,
     "messages.0.content"),
    ("chat-messages-not-a-list", "POST", CHAT, chat(messages="hi"), None, 400, "messages"),
    ("chat-image-part", "POST", CHAT,
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]),
     None, 400, "messages.0.content.0"),   # the message names the tags served
    ("chat-top-logprobs-without-logprobs", "POST", CHAT, chat(top_logprobs=3), None, 400, "top_logprobs"),
    ("chat-max-completion-tokens-huge", "POST", CHAT, chat(max_completion_tokens=100000), None, 400, "max_tokens"),
    ("chat-tool-bad-name", "POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "f g"}}]), None, 400,
     "tools[0].function.name"),
    ("chat-tools-auto-not-enabled", "POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]),
     None, 400, "tool_choice"),
    ("chat-response-format-type", "POST", CHAT, chat(response_format={"type": "yaml"}), None, 400,
     "response_format"),
    ("body-too-large", "POST", C, b'{"prompt": "' + b"a" * (33 << 20) + b'"}', None, 413, None),
    ("get-on-post-endpoint", "GET", C, None, None, 405, None),
    ("unknown-path", "POST", "/v1/engines/davinci/completions", comp(), None, 404, None),
]


def test_matrix_is_large_enough() -> None:
    assert len(CASES) >= 25
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name,method,path,body,ctype,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_openai_error(api_server: ServerProcess, name: str, method: str, path: str,
                                       body: bytes | None, ctype: str | None, status: int, param: str | None) -> None:
    headers = dict(api_server.headers)
    headers["Content-Type"] = ctype or "application/json"
    r = httpx.request(method, api_server.base_url + path, content=body, headers=headers, timeout=30)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    assert "Traceback" not in r.text and 'File "' not in r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and len(err["message"]) > 5
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err


def test_chunked_body_over_the_limit_is_cut_off_with_413(api_server: ServerProcess) -> None:
    """No Content-Length to check up front: the limit applies while the body streams in."""
    def body():
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"a" * (1 << 20)
        yield b'"}'
    r = httpx.post(api_server.base_url + C, content=body(), timeout=60,
                   headers={**api_server.headers, "Content-Type": "application/json"})
    assert r.status_code == 413
    assert "exceeds the limit" in r.json()["error"]["message"]


def test_context_length_error_states_limit_and_length(api_server: ServerProcess) -> None:
    r = httpx.post(api_server.base_url + C, content=comp(prompt=[100] * 300), headers=api_server.headers)
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "256" in msg and "300" in msg
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_server_is_healthy_and_holds_no_blocks_after_the_matrix(api_server: ServerProcess) -> None:
    for _, method, path, body, ctype, _, _ in CASES:   # the whole matrix again, back to back
        httpx.request(method, api_server.base_url + path, content=body,
                      headers={**api_server.headers, "Content-Type": ctype or "application/json"}, timeout=30)
    assert httpx.get(api_server.base_url + "/health").status_code == 200
    r = httpx.post(api_server.base_url + C, headers=api_server.headers,
                   json={"model": MODEL, "prompt": "still alive", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    m = api_server.metrics()
    assert m['vllm:num_requests_running{model_name="tiny-smol"}'] == 0
    assert m['vllm:num_requests_waiting{model_name="tiny-smol"}'] == 0
    assert m['pagedmodel:kv_cache_blocks_free{model_name="tiny-smol"}'] == m[
        'pagedmodel:kv_cache_blocks_total{model_name="tiny-smol"}'] > 0

"""`serve --skip-tokenizer-init --load-format dummy` (vLLM's token-in/token-out server): a model directory with
its config alone serves token ids through the official SDK, text is "", logprobs name tokens ``token_id:N``,
and what needs text (text prompts, chat, stop strings, structured outputs, /tokenize) is a 400 that says why."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from .conftest import ServerProcess

PROMPT = [1, 504, 3458, 282, 4649, 314, 30]


@pytest.fixture(scope="module")
def ids_server(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    config_only = tmp_path_factory.mktemp("config-only")   # no weights and no tokenizer files
    shutil.copy(server_model_dir / "config.json", config_only / "config.json")
    log = tmp_path_factory.mktemp("ids_server") / "server.log"
    srv = ServerProcess(config_only, log, "--max-model-len", "256", "--kv-cache-memory", str(8 << 20),
                        "--skip-tokenizer-init", "--load-format", "dummy", "--served-model-name", "m")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def sdk(ids_server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=ids_server.base_url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c


def test_token_ids_in_token_ids_out(sdk):
    c = sdk.completions.create(model="m", prompt=PROMPT, max_tokens=6, temperature=0, echo=True, logprobs=2,
                               extra_body={"return_token_ids": True, "ignore_eos": True, "prompt_logprobs": 1})
    choice = c.choices[0]
    assert choice.text == "" and choice.prompt_token_ids == PROMPT and len(choice.token_ids) == 6
    assert c.usage.prompt_tokens == len(PROMPT) and c.usage.completion_tokens == 6
    # no tokenizer names a token: each is token_id:N, the sampled one among its top 2 or beside them
    assert choice.logprobs.tokens[len(PROMPT):] == [f"token_id:{t}" for t in choice.token_ids]
    top = choice.logprobs.top_logprobs[-1]
    assert 2 <= len(top) <= 3 and all(k.startswith("token_id:") for k in top)
    prompt_logprobs = choice.model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(PROMPT)
    assert all(e[str(PROMPT[i])]["decoded_token"] == f"token_id:{PROMPT[i]}"
               for i, e in enumerate(prompt_logprobs) if e is not None)


def test_streamed_token_ids_are_the_same(sdk):
    kw = dict(model="m", prompt=PROMPT, max_tokens=5, temperature=0, extra_body={"return_token_ids": True,
                                                                                 "ignore_eos": True})
    whole = sdk.completions.create(**kw).choices[0].token_ids
    chunks = list(sdk.completions.create(stream=True, **kw))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ""
    assert [t for ch in chunks if ch.choices for t in (ch.choices[0].token_ids or [])] == whole
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("body,param", [
    ({"prompt": "Hello"}, "prompt"),
    ({"prompt": PROMPT, "stop": ["."]}, "stop"),
    ({"prompt": PROMPT, "structured_outputs": {"regex": "[ab]+"}}, "structured_outputs"),
], ids=["text-prompt", "stop-strings", "structured-outputs"])
def test_what_needs_text_is_refused(ids_server, body, param):
    r = httpx.post(ids_server.base_url + "/v1/completions", json={"model": "m", "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "--skip-tokenizer-init" in err["message"] and err["param"] == param


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("/tokenize", {"prompt": "Hi"}),
    ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("/detokenize", {"tokens": PROMPT}),
])
def test_endpoints_that_need_the_tokenizer_say_so(ids_server, path, body):
    r = httpx.post(ids_server.base_url + path, json={"model": "m", **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert "--skip-tokenizer-init" in r.json()["error"]["message"]
    # refused requests held nothing: the engine still serves one that fits the whole cache's budget
    ok = httpx.post(ids_server.base_url + "/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 2},
                    timeout=60)
    assert ok.status_code == 200

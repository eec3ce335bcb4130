"""A vLLM `serve` command line runs here: each flag is implemented, accepted with one "no effect" log line,
or refused with a message (docs/vllm_compat.md); VLLM_API_KEY guards like --api-key."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from pagedmodel.server.api.serve import api_key_from
from pagedmodel.server.api.vllm_flags import check_vllm_flags
from support import assert_openai_error

from .conftest import VLLM_KEY, VLLM_MODEL, ServerProcess

AUTH = {"Authorization": f"Bearer {VLLM_KEY}"}
MODEL = VLLM_MODEL
VOCAB = 49152   # SmolLM2's tokenizer, which the tiny test model uses
NO_EFFECT_FLAGS = ("--show-hidden-metrics-for-version", "--max-cpu-loras", "--[no-]enable-chunked-prefill",
                   "--disable-frontend-multiprocessing", "--structured-outputs-config.backend",
                   "--[no-]async-scheduling")


def test_a_vllm_command_line_starts_and_logs_one_line_per_flag_without_effect(vllm_server: ServerProcess) -> None:
    log = vllm_server.log()
    for flag in NO_EFFECT_FLAGS:
        assert sum(1 for line in log.splitlines() if f"{flag} " in line and "has no effect here" in line) == 1, flag
    # the implemented ones do not claim to have no effect
    for flag in ("--root-path", "--enable-request-id-headers", "--return-tokens-as-token-ids", "--runner"):
        assert not any(flag in line and "no effect" in line for line in log.splitlines()), flag


def test_vllm_api_key_env_guards_the_server(vllm_server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    r = httpx.post(vllm_server.base_url + "/v1/completions", json=body, timeout=30)
    assert_openai_error(r.status_code, r.content, 401)
    assert httpx.post(vllm_server.base_url + "/v1/completions", json=body, headers=AUTH, timeout=30).status_code == 200


def test_api_key_precedence() -> None:
    assert api_key_from(None, {"VLLM_API_KEY": "v"}) == "v"
    assert api_key_from(None, {"VLLM_API_KEY": "v", "PAGEDMODEL_API_KEY": "p"}) == "p"
    assert api_key_from("flag", {"VLLM_API_KEY": "v"}) == "flag"
    assert api_key_from(None, {"VLLM_API_KEY": ""}) is None


def test_request_id_header_echoes_the_clients_or_makes_one(vllm_server: ServerProcess) -> None:
    url = vllm_server.base_url
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    mine = httpx.post(url + "/v1/completions", json=body, headers={**AUTH, "X-Request-Id": "trace-42"}, timeout=30)
    assert mine.status_code == 200 and mine.headers.get_list("x-request-id") == ["trace-42"]
    own = httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=30)
    assert own.headers["x-request-id"] == own.json()["id"]        # the endpoint's own id when none was sent
    for r in (httpx.get(url + "/health", timeout=10), httpx.get(url + "/v1/models", timeout=10)):   # 200 and 401
        assert len(r.headers.get_list("x-request-id")) == 1 and len(r.headers["x-request-id"]) >= 16
    assert httpx.get(url + "/health", headers={"X-Request-Id": "abc"}, timeout=10).headers["x-request-id"] == "abc"


def test_root_path_is_the_apps_prefix(vllm_server: ServerProcess) -> None:
    doc = httpx.get(vllm_server.base_url + "/openapi.json", headers=AUTH, timeout=10).json()
    assert doc["servers"] == [{"url": "/proxy"}]
    # as in vLLM, the routes answer with the proxy's prefix and without it (a proxy may or may not strip it)
    for prefix in ("", "/proxy"):
        r = httpx.get(vllm_server.base_url + prefix + "/v1/models", headers=AUTH, timeout=10)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL, prefix
        assert httpx.get(vllm_server.base_url + prefix + "/v1/models", timeout=10).status_code == 401


def test_prompt_tokens_details_and_tokens_as_ids_by_flag(vllm_server: ServerProcess) -> None:
    with openai.OpenAI(base_url=vllm_server.base_url + "/v1", api_key=VLLM_KEY, max_retries=0) as client:
        r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, temperature=0, logprobs=1)
        assert r.usage.prompt_tokens_details is not None and r.usage.prompt_tokens_details.cached_tokens == 0
        # a prompt of more than one 128-token block, twice: the second finds its first block cached
        long_prompt = [100 + i for i in range(150)]
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2)
        again = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2)
        assert again.usage.prompt_tokens_details.cached_tokens == 128
        assert all(t.startswith("token_id:") for t in r.choices[0].logprobs.tokens)
        # the request's own choice wins over the flag
        r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, temperature=0, logprobs=1,
                                      extra_body={"return_tokens_as_token_ids": False})
        assert not any(t.startswith("token_id:") for t in r.choices[0].logprobs.tokens)


def test_max_logprobs_up_to_the_vocabulary(vllm_server: ServerProcess) -> None:
    url = vllm_server.base_url + "/v1/chat/completions"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "logprobs": True}
    r = httpx.post(url, json={**body, "top_logprobs": 100}, headers=AUTH, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 100
    # -1: the whole vocabulary (151936 was capped at it)
    r = httpx.post(url, json={**body, "top_logprobs": -1}, headers=AUTH, timeout=120)
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == VOCAB


@pytest.mark.parametrize("args,message", [
    (["--runner", "pooling"], "--runner pooling is not served"),
    (["--load-format", "tensorizer"], "--load-format tensorizer is not served"),
    # without a tokenizer there is no text: flags that read or write it are refused with it, at start
    (["--skip-tokenizer-init", "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser",
      "qwen3"], "--enable-auto-tool-choice, --reasoning-parser need the tokenizer, so cannot go with "
                "--skip-tokenizer-init"),
    (["--max-logprobs", "-5"], "--max-logprobs"),
    (["other-model"], "the model is named twice, differently"),
    # a parser that would change answers is never ignored: vLLM's other names and typos alike
    (["--reasoning-parser", "mistral"], "--reasoning-parser mistral: vLLM's reasoning parser 'mistral' is not served "
                                         "here; served: deepseek_r1, qwen3"),
    (["--reasoning-parser", "qwen"], "--reasoning-parser qwen: reasoning parser 'qwen' is not served here"),
    # --reasoning-config: vLLM's keys only, strings only, and a parser it names is checked like the flag's
    (["--reasoning-config", '{"reasoning_start": "<think>"}'], "--reasoning-config: unknown key(s) reasoning_start"),
    (["--reasoning-config", '{"reasoning_end_str": 3}'], "--reasoning-config: reasoning_end_str must be a string"),
    (["--reasoning-config", "<think>"], "--reasoning-config is not valid JSON"),
    (["--reasoning-config", '{"reasoning_parser": "mistral"}'],
     "--reasoning-config reasoning_parser: vLLM's reasoning parser 'mistral' is not served here"),
    (["--watermark-config", '{"algorithm": "gumbel"}'], '--watermark-config needs "key"'),
    (["--watermark-config", '{"key": 42, "seed": 1}'], "--watermark-config: unknown field(s) 'seed'"),
    (["--watermark-config", '{"key": 42, "algorithm": "dual_key_gumbel"}'], "'dual_key_gumbel' is not served"),
])
def test_flags_that_would_change_results_are_refused(server_model_dir: Path, args: list[str], message: str) -> None:
    r = subprocess.run([sys.executable, "-m", "pagedmodel.cli", "serve", "--model", str(server_model_dir),
                        "--device", "cpu", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_no_effect_notes_only_for_flags_given() -> None:
    import argparse

    from pagedmodel.server.api.serve import add_arguments
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert check_vllm_flags(parser.parse_args([])) == []
    assert check_vllm_flags(parser.parse_args(["--structured-outputs-config.backend", "xgrammar"])) == []
    for name in ("qwen3", "deepseek_r1"):   # implemented: no note
        assert check_vllm_flags(parser.parse_args(["--reasoning-parser", name])) == []
    notes = check_vllm_flags(parser.parse_args(["--enable-chunked-prefill", "--max-cpu-loras", "4"]))
    assert len(notes) == 2 and all("has no effect here" in n for n in notes)
    assert parser.parse_args(["--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert parser.parse_args(["--enable-prefix-caching"]).enable_prefix_caching is True


def test_force_include_usage_puts_usage_on_every_chunk(vllm_server: ServerProcess, api_server: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True, "ignore_eos": True}
    r = httpx.post(vllm_server.base_url + "/v1/chat/completions", headers=AUTH, timeout=60,
                   json={"model": MODEL, **body})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert chunks and all(c["usage"] is not None for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    plain = httpx.post(api_server.base_url + "/v1/chat/completions", headers=api_server.headers, timeout=60,
                       json={"model": "tiny-smol", **body})
    assert all(json.loads(line[6:]).get("usage") is None for line in plain.text.splitlines()
               if line.startswith("data: {"))

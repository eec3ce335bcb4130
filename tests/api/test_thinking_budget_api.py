"""thinking_token_budget over HTTP: a live `pagedmodel serve --reasoning-parser qwen3 --reasoning-config ...` of
the tiny random model (SmolLM2's tokenizer: <think> and </think> are three tokens each). A prompt that ends
inside thinking makes the budget observable: exactly `budget` thinking tokens, then the forced </think>, in
completions and chat, whole and streamed; a bad budget is a 400 naming the field."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from support import assert_openai_error

from .conftest import API_KEY, ServerProcess

MODEL = "thinker"
CONFIG = {"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}


@pytest.fixture(scope="module")
def thinking_server(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("thinking_server") / "server.log"
    srv = ServerProcess(server_model_dir, log, "--max-model-len", "512", "--kv-cache-memory", str(16 << 20),
                        "--served-model-name", MODEL, "--reasoning-parser", "qwen3",
                        "--reasoning-config", json.dumps(CONFIG), "--no-async-scheduling")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def markers(server_model_dir: Path) -> tuple[list[int], list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(server_model_dir))
    return (tok.encode("<think>", add_special_tokens=False), tok.encode("</think>", add_special_tokens=False))


@pytest.fixture()
def client(thinking_server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=thinking_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def thinking_span(ids: list[int], start: list[int], end: list[int]) -> int | None:
    """vLLM's test's measure: tokens between the last start marker and the first end marker after it."""
    last = max((i for i in range(len(ids) - len(start) + 1) if ids[i:i + len(start)] == start), default=None)
    if last is None:
        return None
    after = last + len(start)
    return next((j - after for j in range(after, len(ids) - len(end) + 1) if ids[j:j + len(end)] == end),
                len(ids) - after)


PROMPT = "Question: what is two and two?\n<think>"   # ends inside thinking ("\n<think>" keeps the marker's tokens)


@pytest.mark.parametrize("budget", [0, 5])
def test_a_completion_thinks_exactly_the_budget_then_gets_the_end_marker(client: openai.OpenAI, markers,
                                                                         budget: int) -> None:
    start, end = markers
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=budget + 6, temperature=0,
                                  extra_body={"thinking_token_budget": budget, "return_token_ids": True,
                                              "ignore_eos": True})
    ids = r.choices[0].token_ids   # type: ignore[attr-defined]
    assert ids[budget:budget + len(end)] == end
    assert thinking_span(r.choices[0].prompt_token_ids + ids, start, end) == budget   # type: ignore[attr-defined]
    assert r.choices[0].text.count("</think>") >= 1
    # the same request streamed: the same tokens
    chunks = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=budget + 6, temperature=0, stream=True,
                                       extra_body={"thinking_token_budget": budget, "return_token_ids": True,
                                                   "ignore_eos": True})
    assert [t for c in chunks for t in (c.choices[0].token_ids or [])] == ids   # type: ignore[attr-defined]


def test_without_a_budget_the_model_thinks_on(client: openai.OpenAI, markers) -> None:
    start, end = markers
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                  extra_body={"return_token_ids": True, "ignore_eos": True,
                                              "thinking_token_budget": -1})
    choice = r.choices[0]
    assert thinking_span(choice.prompt_token_ids + choice.token_ids, start, end) == 12   # type: ignore[attr-defined]


def _chat_kw(budget: int) -> dict:
    # the template renders the assistant turn up to "<think>\n": generation continues inside thinking
    return dict(model=MODEL, max_tokens=budget + 8, temperature=0,
                messages=[{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "<think>"}],
                extra_body={"thinking_token_budget": budget, "return_token_ids": True, "ignore_eos": True,
                            "add_generation_prompt": False, "continue_final_message": True})


def test_a_chat_answer_splits_at_the_forced_end_marker(client: openai.OpenAI, markers) -> None:
    start, end = markers
    r = client.chat.completions.create(**_chat_kw(4))
    ids = r.prompt_token_ids + r.choices[0].token_ids   # type: ignore[attr-defined]
    assert thinking_span(ids, start, end) == 4
    msg = r.choices[0].message
    reasoning = msg.reasoning   # type: ignore[attr-defined]
    assert reasoning and msg.content and "</think>" not in msg.content + reasoning
    chunks = list(client.chat.completions.create(**_chat_kw(4), stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == msg.reasoning   # type: ignore[attr-defined]
    assert "".join(d.content or "" for d in deltas) == msg.content


@pytest.mark.parametrize("value", [-2, 1.5, "5", True])
def test_a_bad_budget_is_a_400_naming_the_field(thinking_server: ServerProcess, value: object) -> None:
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = httpx.post(thinking_server.base_url + path, json={"model": MODEL, **body, "thinking_token_budget": value},
                       timeout=30)
        assert_openai_error(r.status_code, r.content, 400, "thinking_token_budget")


def test_a_budget_on_a_server_without_markers_is_a_400(api_server: ServerProcess) -> None:
    r = httpx.post(api_server.base_url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": "tiny-smol", "prompt": "hi", "thinking_token_budget": 3}, timeout=30)
    err = assert_openai_error(r.status_code, r.content, 400, "thinking_token_budget")
    assert "--reasoning-parser or --reasoning-config" in err["message"]

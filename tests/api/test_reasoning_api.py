"""--reasoning-parser over HTTP, through the openai SDK: a live `pagedmodel serve --reasoning-parser qwen3` of
the tiny random model, whose output a one-option structured-outputs `choice` makes known. Its tokenizer has no
<think> token, so every marker reaches the parser in several tokens, split across stream deltas.

vLLM 0.33 names the field `reasoning` (older vLLM: `reasoning_content`); the SDK keeps it as an extra field."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from .conftest import API_KEY, ServerProcess

MODEL = "thinker"
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
THOUGHT, ANSWER = "Two and two make four.", "It is 4."
FORCED = f"<think>{THOUGHT}</think>{ANSWER}"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def reasoning_server(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("reasoning_server") / "server.log"
    srv = ServerProcess(server_model_dir, log, "--max-model-len", "1024", "--kv-cache-memory", str(16 << 20),
                        "--served-model-name", MODEL, "--reasoning-parser", "qwen3",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture()
def client(reasoning_server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=reasoning_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _forced(text: str, **extra: object) -> dict:
    return {"structured_outputs": {"choice": [text]}, **extra}


def _stream(client: openai.OpenAI, **kw: object) -> tuple[str, str, list]:
    kw = {"max_tokens": 150, **kw}
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, temperature=0, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    return reasoning, content, chunks


def test_a_whole_answer_has_reasoning_apart_from_content(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=150, temperature=0,
                                       extra_body=_forced(FORCED))
    msg = r.choices[0].message
    assert (msg.reasoning, msg.content) == (THOUGHT, ANSWER)   # type: ignore[attr-defined]
    assert r.choices[0].finish_reason == "stop"
    # vLLM's usage with a reasoning parser: the thinking's share of the completion tokens
    assert 0 < r.usage.completion_tokens_details.reasoning_tokens < r.usage.completion_tokens


def test_streamed_deltas_carry_reasoning_then_content_and_never_a_marker(client: openai.OpenAI) -> None:
    reasoning, content, chunks = _stream(client, stream_options={"include_usage": True}, extra_body=_forced(FORCED))
    assert (reasoning, content) == (THOUGHT, ANSWER)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    kinds = ["r" if getattr(d, "reasoning", None) else "c"
             for d in deltas if getattr(d, "reasoning", None) or d.content]
    assert len(kinds) > 2 and kinds == sorted(kinds, reverse=True)   # all reasoning deltas, then content ones
    for d in deltas:
        assert not set((getattr(d, "reasoning", None) or "") + (d.content or "")) & set("<>/")
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens > 0


def test_include_reasoning_false_drops_the_reasoning_and_what_spells_it(client: openai.OpenAI) -> None:
    body = _forced(FORCED, include_reasoning=False, return_token_ids=True)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=150, temperature=0, logprobs=True,
                                       extra_body=body)
    choice = r.choices[0]
    assert getattr(choice.message, "reasoning", None) is None and choice.message.content == ANSWER
    assert choice.logprobs is None and getattr(choice, "token_ids", None) is None
    assert r.usage.completion_tokens_details.reasoning_tokens > 0   # still counted, as in vLLM
    reasoning, content, chunks = _stream(client, logprobs=True, extra_body=body)
    assert (reasoning, content) == ("", ANSWER)
    assert all(c.choices[0].logprobs is None for c in chunks if c.choices)


def test_output_without_an_end_marker_is_all_reasoning(client: openai.OpenAI, api_server: ServerProcess) -> None:
    """Unconstrained, the random model writes no </think>: to qwen3's rule it was cut off while thinking. The
    same greedy request to the server without a parser returns that text as content."""
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    plain = httpx.post(api_server.base_url + "/v1/chat/completions", json={"model": "tiny-smol", **body},
                       headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60).json()["choices"][0]["message"]
    assert plain["reasoning"] is None and plain["content"]   # without --reasoning-parser nothing is split off
    msg = client.chat.completions.create(model=MODEL, **body).choices[0].message
    assert (msg.reasoning, msg.content) == (plain["content"], None)   # type: ignore[attr-defined]
    reasoning, content, _ = _stream(client, max_tokens=8)
    assert (reasoning, content) == (plain["content"], "")


def test_enable_thinking_false_makes_the_whole_output_content(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=150, temperature=0,
                                       extra_body=_forced(FORCED, chat_template_kwargs={"enable_thinking": False}))
    assert getattr(r.choices[0].message, "reasoning", None) is None and r.choices[0].message.content == FORCED


@pytest.mark.parametrize("text", [f"<think>I should look it up.</think>{CALL}", f"<think>I should look it up.{CALL}"],
                         ids=["end_marker", "tool_call_ends_thinking"])
def test_the_tool_parser_reads_only_the_content(client: openai.OpenAI, text: str) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=150, temperature=0, tools=[WEATHER],
                                       tool_choice="auto", extra_body=_forced(text))
    choice = r.choices[0]
    assert choice.message.reasoning == "I should look it up."   # type: ignore[attr-defined]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    with client.chat.completions.stream(model=MODEL, messages=MESSAGES, max_tokens=150, temperature=0, tools=[WEATHER],
                                        tool_choice="auto", extra_body=_forced(text)) as stream:
        chunks = [e.chunk for e in stream if e.type == "chunk"]
        final = stream.get_final_completion()
    assert "".join(getattr(c.choices[0].delta, "reasoning", None) or "" for c in chunks if c.choices) \
        == "I should look it up."
    assert final.choices[0].finish_reason == "tool_calls"
    assert final.choices[0].message.tool_calls[0].function.arguments == '{"city": "Paris"}'


def test_required_tool_choice_is_still_calls(client: openai.OpenAI) -> None:
    """tool_choice required constrains the output to calls from the first token: that output is the answer."""
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=150, temperature=0, tools=[WEATHER],
                                       tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason in ("tool_calls", "length") and getattr(choice.message, "reasoning", None) is None
    if choice.finish_reason == "tool_calls":
        assert choice.message.tool_calls[0].function.name == "get_weather"

"""Tool calling through the openai SDK against a live `pagedmodel serve` of the real SmolLM2-135M-Instruct:
`required` and named choices give valid calls every time (structured outputs constrain them), streamed
calls reassemble, multi-turn tool messages render, bad tools are 400s naming the field.

`auto` is served (the hermes parser is unit tested in test_tool_parsers.py), but the 135M model does
not write `<tool_call>` blocks on its own, so no test here claims it calls a tool by itself.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from .conftest import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search_flights", "description": "Find flights between two airports on a date",
    "parameters": {"type": "object", "properties": {
        "origin": {"type": "string", "pattern": "^[A-Z]{3}$"}, "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "passengers": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["origin", "destination", "passengers"], "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "current_time", "description": "The time now"}}
# held-out prompts and tool sets: none of them is in the prompt rendering or the parser tests
CASES = [
    ("Is it raining in Lisbon right now?", [WEATHER, ADD]),
    ("What is 17 plus 25?", [WEATHER, ADD]),
    ("I need to fly from Boston to Denver with my two kids.", [SEARCH, NOW]),
    ("What time is it?", [NOW, WEATHER]),
    ("How hot is it in Cairo, in fahrenheit?", [WEATHER]),
    ("Book me something from JFK to LAX for one person.", [SEARCH, ADD, WEATHER]),
]


@pytest.fixture(scope="module")
def tool_server(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("tool_server") / "server.log"
    srv = ServerProcess(smollm2_dir, log, "--max-model-len", "2048", "--served-model-name", MODEL,
                        "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture()
def client(tool_server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=tool_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300) as c:
        yield c


def _check_call(call: object, tools: list[dict]) -> None:
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")   # type: ignore[attr-defined]
    fn = call.function   # type: ignore[attr-defined]
    assert fn.name in by_name, fn.name
    jsonschema.validate(json.loads(fn.arguments), by_name[fn.name].get("parameters", {"type": "object"}))


def test_required_returns_a_valid_call_every_time(client: openai.OpenAI) -> None:
    def ask(i: int) -> tuple[list[dict], object]:
        prompt, tools = CASES[i % len(CASES)]
        # greedy for each case, then three sampled (seeded): validity must not depend on luck. One call each
        # (parallel_tool_calls false); the last request allows parallel calls, which a 135M model repeats
        # until max_tokens: the calls it finished are kept.
        parallel = i == len(CASES) + 3
        sampling = {"temperature": 0} if i < len(CASES) else {"temperature": 1.0, "seed": i}
        return tools, client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                     tools=tools, tool_choice="required", parallel_tool_calls=parallel,
                                                     max_tokens=60 if parallel else 100, **sampling)

    with ThreadPoolExecutor(5) as pool:
        results = list(pool.map(ask, range(len(CASES) + 4)))
    for i, (tools, r) in enumerate(results):
        choice = r.choices[0]   # type: ignore[attr-defined]
        if i < len(CASES) + 3:
            assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, (i, choice)
        else:
            assert choice.finish_reason in ("tool_calls", "length"), (i, choice)
        assert choice.message.content is None and choice.message.tool_calls
        for call in choice.message.tool_calls:
            _check_call(call, tools)


def test_named_function_is_called_with_valid_arguments(client: openai.OpenAI) -> None:
    for prompt, tools in CASES[:3]:
        name = tools[-1]["function"]["name"]   # not always the function the prompt is about
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], tools=tools,
                                           tool_choice={"type": "function", "function": {"name": name}},
                                           temperature=0, max_tokens=150)
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == name and r.choices[0].finish_reason == "tool_calls"
        _check_call(call, tools)


def test_streamed_calls_reassemble_in_the_sdk(client: openai.OpenAI) -> None:
    prompt, tools = CASES[2]
    with client.chat.completions.stream(model=MODEL, messages=[{"role": "user", "content": prompt}], tools=tools,
                                        tool_choice="required", parallel_tool_calls=False, temperature=0,
                                        max_tokens=150) as stream:
        chunks = [e.chunk for e in stream if e.type == "chunk"]
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    for call in final.choices[0].message.tool_calls:
        _check_call(call, tools)
    pieces = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(pieces) > 2, "arguments arrive in pieces"
    firsts = {}
    for p in pieces:
        if p.index not in firsts:
            firsts[p.index] = p
            assert p.id and p.type == "function" and p.function.name, "a call's first delta names it"
        else:
            assert p.id is None and p.function.name is None and p.function.arguments
    assert all(not (c.choices and c.choices[0].delta.content) for c in chunks[1:]), "no content besides calls"
    named = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], tools=tools,
                                           tool_choice={"type": "function", "function": {"name": "search_flights"}},
                                           temperature=0, max_tokens=150, stream=True)
    args = "".join(tc.function.arguments or "" for c in named if c.choices
                   for tc in (c.choices[0].delta.tool_calls or []))
    jsonschema.validate(json.loads(args), SEARCH["function"]["parameters"])


def test_multi_turn_tool_messages_are_rendered(client: openai.OpenAI, tool_server: ServerProcess) -> None:
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": -3, "sky": "snow"}'}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                       temperature=0, max_tokens=30)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason in ("stop", "length")
    text = httpx.post(tool_server.base_url + "/detokenize", timeout=30, json={"tokens": httpx.post(
        tool_server.base_url + "/tokenize", json={"messages": messages, "tools": [WEATHER]}, timeout=30).json()["tokens"]}
    ).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>' in text
    assert '<tool_response>\n{"temperature": -3, "sky": "snow"}\n</tool_response>' in text
    assert r.usage.prompt_tokens == len(httpx.post(tool_server.base_url + "/tokenize", timeout=30, json={
        "messages": messages, "tools": [WEATHER]}).json()["tokens"])


def test_auto_is_served_with_the_parser(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                       tools=[WEATHER], tool_choice="auto", temperature=0, max_tokens=20)
    m = r.choices[0].message
    assert m.tool_calls or m.content
    assert "<tool_call>" not in (m.content or "") or not m.tool_calls


@pytest.mark.parametrize("kwargs,param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                        "required": "a"}}}]},
     "tools[1].function.parameters"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                         "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_bad_tool_requests_are_400s_naming_the_field(client: openai.OpenAI, tool_server: ServerProcess,
                                                     kwargs: dict, param: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **kwargs}
    r = httpx.post(tool_server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    ok = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")   # the server stays up
    metrics = tool_server.metrics()
    assert metrics.get("pagedmodel:kv_cache_blocks_total", 0) - metrics.get("pagedmodel:kv_cache_blocks_free", 0) == 0


def test_auto_tool_choice_flag_needs_a_parser() -> None:
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "pagedmodel.cli", "serve", "--device", "cpu",
                        "--enable-auto-tool-choice"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--enable-auto-tool-choice requires --tool-call-parser" in r.stderr


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_cut_by_max_tokens_is_no_call(client: openai.OpenAI, tool_choice) -> None:
    """vLLM's (and OpenAI's): max_tokens too small for the forced call's JSON gives no tool_calls and empty
    content, with finish_reason length; a plain answer has no tool_calls key at all."""
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                       tools=[WEATHER], tool_choice=tool_choice, max_tokens=2, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None and choice.message.content == ""
    plain = client.chat.completions.with_raw_response.create(model=MODEL, max_tokens=3,
                                                             messages=[{"role": "user", "content": "Hi"}])
    assert "tool_calls" not in json.loads(plain.text)["choices"][0]["message"]

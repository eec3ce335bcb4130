"""The router passes vLLM's serving surface and tool calling through unchanged: /tokenize, /detokenize,
/version and streamed tool calls through a real `pagedmodel router` equal what the engine answers
directly; the `prefix` strategy keys chat requests with tools on their canonical tool definitions."""
from __future__ import annotations

import json

import httpx

from pagedmodel.server.router.request import prompt_key
from pagedmodel.server.router.strategies import PrefixAffinity
from pagedmodel.server.router.upstreams import UpstreamView
# the same real router in front of a real tiny engine (this module gets its own instance)
from test_engine_through_router import engine_and_router  # noqa: F401

PICK = {"type": "function", "function": {"name": "pick", "description": "Pick a color",
                                         "parameters": {"type": "object", "required": ["color"],
                                                        "additionalProperties": False,
                                                        "properties": {"color": {"enum": ["red", "green"]}}}}}
NAMED = {"type": "function", "function": {"name": "pick"}}


def test_tokenize_detokenize_version_pass_through(engine_and_router: tuple[str, str]) -> None:
    engine, router = engine_and_router
    for body in ({"prompt": "Hello there", "return_token_strs": True},
                 {"messages": [{"role": "user", "content": "hi"}], "tools": [PICK]}):
        direct = httpx.post(engine + "/tokenize", json=body, timeout=30)
        routed = httpx.post(router + "/tokenize", json=body, timeout=30)
        assert routed.status_code == direct.status_code == 200 and routed.json() == direct.json()
    tokens = direct.json()["tokens"]
    assert httpx.post(router + "/detokenize", json={"tokens": tokens}, timeout=30).json() == \
        httpx.post(engine + "/detokenize", json={"tokens": tokens}, timeout=30).json()
    bad = httpx.post(router + "/detokenize", json={"tokens": [10**9]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.get(router + "/version", timeout=30).json() == httpx.get(engine + "/version", timeout=30).json()
    assert httpx.get(router + "/ping", timeout=30).status_code == 200


def _stream(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_streamed_tool_calls_pass_through_unchanged(engine_and_router: tuple[str, str]) -> None:
    engine, router = engine_and_router
    body = {"messages": [{"role": "user", "content": "Pick a color."}], "tools": [PICK], "tool_choice": NAMED,
            "temperature": 0, "max_tokens": 40}

    def shape(chunks: list[dict]) -> list[dict]:
        """The deltas and finish reasons, without the per-request ids."""
        out = []
        for c in chunks:
            for ch in c["choices"]:
                delta = dict(ch["delta"])
                for tc in delta.get("tool_calls", []):
                    assert "id" not in tc or tc["id"].startswith("chatcmpl-tool-")
                    tc.pop("id", None)
                out.append({"delta": delta, "finish_reason": ch["finish_reason"]})
        return out

    direct, routed = shape(_stream(engine, body)), shape(_stream(router, body))
    assert routed == direct
    args = "".join(tc["function"].get("arguments", "") for d in routed for tc in d["delta"].get("tool_calls", []))
    assert json.loads(args)["color"] in ("red", "green")
    assert routed[-1]["finish_reason"] == "tool_calls"
    bad = httpx.post(router + "/v1/chat/completions", timeout=30,
                     json={**body, "tools": [{"type": "function", "function": {"name": "no spaces"}}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools[0].function.name"


def test_prefix_key_includes_tools_canonically() -> None:
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    reordered = {"function": {"parameters": PICK["function"]["parameters"], "description": "Pick a color",
                              "name": "pick"}, "type": "function"}
    key = prompt_key({"messages": msgs, "tools": [PICK]})
    assert key == prompt_key({"messages": msgs, "tools": [reordered]})   # key order does not matter
    assert key.startswith("system:S\ntools:") and key.endswith("\nuser:U")   # where the engine renders them
    assert prompt_key({"messages": msgs[1:], "tools": [PICK]}).startswith("tools:")
    other = prompt_key({"messages": msgs, "tools": [{"type": "function", "function": {"name": "other"}}]})
    assert other != key and prompt_key({"messages": msgs}) == "system:S\nuser:U"


def test_prefix_strategy_sends_the_same_tools_request_to_one_replica() -> None:
    ups = [UpstreamView(f"http://10.0.0.{i}:8000") for i in range(4)]
    tools = [{"type": "function", "function": {"name": f"tool_{j}", "description": f"Does thing number {j}",
                                               "parameters": {"type": "object"}}} for j in range(4)]
    assert len(prompt_key({"messages": [], "tools": tools})) > PrefixAffinity().prefix_chars
    pa = PrefixAffinity()
    same = {pa.pick(ups, prompt_key({"messages": [{"role": "user", "content": f"q{i}"}], "tools": tools})).url
            for i in range(20)}
    assert len(same) == 1   # the tool definitions lead the key: one replica holds their cached prefix
    spread = {pa.pick(ups, prompt_key({"messages": [{"role": "user", "content": "q"}],
                                        "tools": [{"type": "function", "function": {"name": f"t{i}"}}]})).url
              for i in range(40)}
    assert len(spread) > 1   # different tools may go elsewhere

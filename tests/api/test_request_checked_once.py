"""A request is checked once: the handler checks its prompt against its parameters before it submits it,
and the engine takes the checked prompt as it is (input_processor.ProcessedPrompt); its grammar compiles once."""
from __future__ import annotations

from pathlib import Path

import httpx

from .conftest import InProcessServer

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_each_prompt_is_checked_once_and_each_grammar_compiled_once(server_model_dir: Path) -> None:
    with InProcessServer(server_model_dir) as srv:
        inputs, grammars = srv.engine.input_processor, srv.engine.grammars
        checks: list[int] = []
        compiles: list[object] = []
        check, compile_key = inputs.check_prompt, grammars._compile
        inputs.check_prompt = lambda ids, *a, **kw: (checks.append(len(ids)), check(ids, *a, **kw))[1]
        grammars._compile = lambda key: (compiles.append(key), compile_key(key))[1]
        body = {"model": srv.engine.model_name, "max_tokens": 3}
        r = httpx.post(srv.base_url + "/v1/completions", json={**body, "prompt": ["one two", "three four five"]},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert len(checks) == 2   # one per prompt, in the handler; none again in the engine
        checks.clear()
        r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=60, json={
            **body, "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}})
        assert r.status_code == 200, r.text
        assert len(checks) == 1 and len(compiles) == 1

"""Structured outputs over HTTP with the real openai SDK and SmolLM2: response_format (json_schema via
``parse()``, json_object), vLLM's ``structured_outputs`` and ``guided_*`` fields, streaming, and 400s that
name the field and leave the server serving with every KV block back."""
from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from .conftest import InProcessServer, parse_metrics


class City(BaseModel):
    name: str = Field(max_length=16)
    country: str = Field(max_length=16)


class Pet(BaseModel):
    kind: Literal["dog", "cat", "bird"]
    legs: int = Field(ge=0, le=8)


class Meeting(BaseModel):
    title: str = Field(max_length=16)
    attendees: list[str] = Field(max_length=3)
    online: bool


@pytest.fixture(scope="module")
def server(smollm2_dir):
    with InProcessServer(smollm2_dir, max_model_len=512, kv_cache_memory=64 << 20, enforce_eager=True) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=300) as c:
        yield c


def post(server: InProcessServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json={"temperature": 0, **body}, timeout=300)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_sdk_parse_returns_the_pydantic_object(client):
    cases = [(City, "Name a large city and its country."), (Pet, "Describe a pet."),
             (Meeting, "Plan a short team meeting.")]
    for model, prompt in cases:
        completion = client.beta.chat.completions.parse(model=_served(client), messages=user(prompt),
                                                        response_format=model, temperature=0, max_tokens=80)
        message = completion.choices[0].message
        assert isinstance(message.parsed, model), message.content
        assert completion.choices[0].finish_reason == "stop"


def _served(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_completions_forms(server):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"]}
    forms = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}},
         lambda t: jsonschema.validate(json.loads(t), schema)),
        ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict) or _fail(t)),
        ({"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}},
         lambda t: re.fullmatch("[a-z]{3}-[0-9]{2}", t) or _fail(t)),
        ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right") or _fail(t)),
        ({"guided_json": json.dumps(schema)}, lambda t: jsonschema.validate(json.loads(t), schema)),
        ({"guided_regex": "[0-9]{3}"}, lambda t: re.fullmatch("[0-9]{3}", t) or _fail(t)),
        ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down") or _fail(t)),
        ({"guided_grammar": 'root ::= "A" [0-9] "B"'}, lambda t: re.fullmatch("A[0-9]B", t) or _fail(t)),
    ]
    for body, check in forms:
        r = post(server, "/v1/completions", {"prompt": "Some data, in JSON:", "max_tokens": 40, **body})
        assert r.status_code == 200, (body, r.text)
        choice = r.json()["choices"][0]
        check(choice["text"])
        assert choice["finish_reason"] == "stop", (body, choice)


def _fail(text: str) -> bool:
    raise AssertionError(f"output does not match: {text!r}")


def test_chat_forms_and_n(client):
    r = client.chat.completions.create(model=_served(client), messages=user("Left or right?"), temperature=0,
                                       max_tokens=10, extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert r.choices[0].message.content in ("left", "right")
    r = client.chat.completions.create(model=_served(client), messages=user("Describe a car."), max_tokens=60,
                                       response_format={"type": "json_object"}, temperature=0)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.chat.completions.create(model=_served(client), messages=user("Pick a number."), n=3, temperature=1.0,
                                       seed=3, max_tokens=10, extra_body={"guided_regex": "[1-9][0-9]?"})
    assert len(r.choices) == 3 and all(re.fullmatch("[1-9][0-9]?", c.message.content) for c in r.choices)


def test_streaming(client):
    schema = Pet.model_json_schema()
    stream = client.chat.completions.create(
        model=_served(client), messages=user("Describe a pet."), temperature=0, max_tokens=40, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    Pet.model_validate_json(text)
    stream = client.completions.create(model=_served(client), prompt="Direction:", max_tokens=10, temperature=0,
                                       stream=True, extra_body={"guided_choice": ["north", "south"]})
    assert "".join(c.choices[0].text for c in stream if c.choices) in ("north", "south")


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"guided_regex": "a(b"}, "guided_regex"),
    ("/v1/completions", {"structured_outputs": {"grammar": "root ::= nope"}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"pattern": "a"}}, "structured_outputs"),
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                    "schema": {"type": "wat"}}}},
     "response_format"),
    ("/v1/completions", {"response_format": {"type": "yaml"}}, "response_format"),
    ("/v1/completions", {"guided_json": "{not json"}, "guided_json"),
    ("/v1/completions", {"guided_regex": "b", "guided_choice": ["a"]}, "guided_choice"),
    ("/v1/completions", {"guided_choice": ["a"], "use_beam_search": True, "n": 2}, "guided_choice"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ("/v1/chat/completions", {"guided_grammar": "root ::= "}, "guided_grammar"),
])
def test_bad_specs_are_400s_naming_the_field(server, path, body, param):
    base = {"prompt": "hi"} if path == "/v1/completions" else {"messages": user("hi")}
    r = post(server, path, {**base, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_after_the_errors_the_server_serves_and_holds_no_blocks(server):
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 4, "guided_choice": ["ok"]})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
    metrics = parse_metrics(httpx.get(server.base_url + "/metrics", timeout=30).text)
    assert metrics["pagedmodel:kv_cache_blocks_free"] == metrics["pagedmodel:kv_cache_blocks_total"]

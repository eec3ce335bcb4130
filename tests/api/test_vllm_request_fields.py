"""vLLM's request fields and their answers (docs/vllm_compat.md): the openai SDK where it has the field,
its extra_body or httpx where it does not."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from support import assert_openai_error

from .conftest import ServerProcess

MODEL = "tiny-smol"
USER = [{"role": "user", "content": "Name three colours."}]


def _post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json={"model": MODEL, **body}, headers=server.headers, timeout=60)


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_logprobs_zero_gives_the_sampled_tokens_logprob(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.top_logprobs) == 4
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top == {token: chosen}


def test_completion_top_logprobs_hold_the_sampled_token_too(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=1.5, logprobs=1, seed=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    for token, top in zip(lp.tokens, lp.top_logprobs):
        assert token in top and 1 <= len(top) <= 2   # vLLM's: the sampled token, then the most likely one


def test_booleans_sent_as_strings_are_coerced(api_server: ServerProcess) -> None:
    r = _post(api_server, "/v1/chat/completions", {"messages": USER, "max_tokens": 2, "logprobs": "true",
                                                    "stream": "false", "ignore_eos": "1"})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["content"]) == 2
    r = _post(api_server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "echo": "True"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("Hi")


@pytest.mark.parametrize("top,message", [(-1, "--max-logprobs"), (-2, "or -1")])
def test_top_logprobs_minus_one_is_the_vocabulary_within_max_logprobs(api_server: ServerProcess, top: int,
                                                                     message: str) -> None:
    # this server keeps the default --max-logprobs (20); test_vllm_flags.py serves -1 under a vocabulary-wide one
    r = _post(api_server, "/v1/chat/completions", {"messages": USER, "max_tokens": 1, "logprobs": True,
                                                    "top_logprobs": top})
    assert message in assert_openai_error(r.status_code, r.content, 400, "top_logprobs")["message"]


def test_negative_seeds_are_taken_and_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt="Once", max_tokens=8, temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text
    assert sample(-7) == sample(-7)
    assert sample(-2**63) == sample(-2**63)   # int64's least
    assert len({sample(-7), sample(-8), sample(7)}) > 1


@pytest.mark.parametrize("seed, kind", [(2**63, "less_than_equal"), (-2**63 - 1, "greater_than_equal")])
def test_seeds_beyond_int64_are_400s_naming_the_bound(client: openai.OpenAI, seed: int, kind: str) -> None:
    # vLLM's messages carry pydantic's error type, and its clients (and tests) match on it
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], seed=seed)
    assert kind in err.value.message and err.value.body["param"] == "seed"


def test_logit_bias_forces_and_bans_tokens(client: openai.OpenAI) -> None:
    def token_ids(**kw: object) -> list[int]:
        r = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True}, **kw)
        return r.choices[0].model_extra["token_ids"]
    greedy = token_ids()
    assert token_ids(logit_bias={"1000": 100}) == [1000] * 5
    assert token_ids(logit_bias={str(greedy[0]): -100})[0] != greedy[0]
    # sampled too, in the chat endpoint
    chat = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=3, temperature=1.0, seed=1,
                                          logit_bias={"1000": 100}, extra_body={"return_token_ids": True})
    assert chat.choices[0].model_extra["token_ids"] == [1000] * 3


def test_return_token_ids_in_completions(client: openai.OpenAI, api_server: ServerProcess) -> None:
    r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=5, temperature=0,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = r.choices[0].model_extra
    assert choice["prompt_token_ids"] == [19556, 905] and len(choice["token_ids"]) == 5
    plain = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=5, temperature=0)
    assert plain.choices[0].model_extra["token_ids"] is None and plain.choices[0].model_extra["prompt_token_ids"] is None
    stream = _post(api_server, "/v1/completions", {"prompt": "Hello world", "max_tokens": 5, "temperature": 0,
                                                   "ignore_eos": True, "stream": True, "return_token_ids": True})
    chunks = [c["choices"][0] for c in _events(stream.text)]
    assert chunks[0]["prompt_token_ids"] == [19556, 905] and all(c["prompt_token_ids"] is None for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]


def test_return_token_ids_in_chat(client: openai.OpenAI, api_server: ServerProcess) -> None:
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, temperature=0,
                                       extra_body={"return_token_ids": True, "ignore_eos": True})
    prompt_ids, token_ids = r.model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"]
    assert len(prompt_ids) == r.usage.prompt_tokens and len(token_ids) == 5
    stream = _post(api_server, "/v1/chat/completions", {"messages": USER, "max_tokens": 5, "temperature": 0,
                                                        "ignore_eos": True, "stream": True, "return_token_ids": True})
    events = _events(stream.text)
    assert events[0]["prompt_token_ids"] == prompt_ids and all("prompt_token_ids" not in e for e in events[1:])
    assert [t for e in events for c in e["choices"] for t in c.get("token_ids", [])] == token_ids


def test_return_tokens_as_token_ids_names_tokens_by_id(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0, logprobs=2,
                                  extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True,
                                              "ignore_eos": True})
    lp, ids = r.choices[0].logprobs, r.choices[0].model_extra["token_ids"]
    assert lp.tokens == [f"token_id:{t}" for t in ids]
    assert all(k.startswith("token_id:") for top in lp.top_logprobs for k in top)
    chat = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=3, temperature=0, logprobs=True,
                                          top_logprobs=2, extra_body={"return_tokens_as_token_ids": True,
                                                                      "return_token_ids": True})
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in chat.choices[0].model_extra["token_ids"]]
    assert all(t.token.startswith("token_id:") for c in content for t in c.top_logprobs)


def test_chat_echo_prepends_the_continued_message(client: openai.OpenAI, api_server: ServerProcess) -> None:
    messages = [*USER, {"role": "assistant", "content": "Red, green and"}]
    kw = {"add_generation_prompt": False, "continue_final_message": True, "echo": True}
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0, extra_body=kw)
    assert r.choices[0].message.content.startswith("Red, green and")
    stream = _post(api_server, "/v1/chat/completions", {"messages": messages, "max_tokens": 3, "temperature": 0,
                                                        "stream": True, **kw})
    text = "".join(c["delta"].get("content") or "" for e in _events(stream.text) for c in e["choices"])
    assert text == r.choices[0].message.content
    # the answer's role is the assistant's: a last user message is not echoed
    plain = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=3, temperature=0,
                                           extra_body={"echo": True})
    assert not plain.choices[0].message.content.startswith(USER[0]["content"])


def test_custom_roles_reach_the_chat_template(api_server: ServerProcess) -> None:
    messages = [{"role": "narrator", "content": "A quiet evening."}, *USER]
    r = _post(api_server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "return_token_ids": True})
    assert r.status_code == 200, r.text
    prompt = _post(api_server, "/detokenize", {"tokens": r.json()["prompt_token_ids"]}).json()["prompt"]
    assert "<|im_start|>narrator\nA quiet evening." in prompt


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "Hi"}),
    ("/v1/chat/completions", {"messages": USER}),
])
def test_continuous_usage_stats_on_every_chunk(api_server: ServerProcess, path: str, body: dict) -> None:
    base = {**body, "max_tokens": 4, "ignore_eos": True, "stream": True}
    events = _events(_post(api_server, path, {**base, "stream_options": {"include_usage": True,
                                                                         "continuous_usage_stats": True}}).text)
    *chunks, last = events
    assert all(e["usage"] is not None and e["usage"]["total_tokens"] == e["usage"]["prompt_tokens"]
               + e["usage"]["completion_tokens"] for e in chunks)
    counts = [e["usage"]["completion_tokens"] for e in chunks]
    assert counts == sorted(counts) and counts[-1] == 4
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
    # continuous_usage_stats counts only with include_usage, as in vLLM
    events = _events(_post(api_server, path, {**base, "stream_options": {"continuous_usage_stats": True}}).text)
    assert all(e["usage"] is None for e in events)


def test_named_tool_call_has_empty_content(client: openai.OpenAI) -> None:
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "blue"]}},
        "required": ["colour"], "additionalProperties": False}}}
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=[tool], max_tokens=30, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "pick"}})
    message = r.choices[0].message
    assert message.content == "" and message.tool_calls[0].function.name == "pick"


def test_required_tool_choice_keeps_the_tools_defs(client: openai.OpenAI) -> None:
    tool = {"type": "function", "function": {"name": "paint", "parameters": {
        "type": "object", "properties": {"colour": {"$ref": "#/$defs/Colour"}}, "required": ["colour"],
        "additionalProperties": False,
        "$defs": {"Colour": {"type": "string", "enum": ["red", "blue"]}}}}}
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=[tool], tool_choice="required",
                                       max_tokens=40, temperature=0, parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "paint" and json.loads(call.function.arguments)["colour"] in ("red", "blue")


def test_tools_defining_one_name_differently_are_refused(api_server: ServerProcess) -> None:
    def tool(name: str, colours: list[str]) -> dict:
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {"c": {"$ref": "#/$defs/C"}}, "$defs": {"C": {"enum": colours}}}}}
    r = _post(api_server, "/v1/chat/completions", {"messages": USER, "tool_choice": "required",
                                                   "tools": [tool("a", ["red"]), tool("b", ["blue"])]})
    assert "$defs/C" in assert_openai_error(r.status_code, r.content, 400, "tools")["message"]


def _check_prompt_logprobs(scored: list, prompt_ids: list[int], top_n: int) -> None:
    """vLLM's layout: None for the first token, then {id: {logprob, rank, decoded_token}} holding the prompt
    token (with its rank) and the top_n most likely (ranks 1..top_n)."""
    assert len(scored) == len(prompt_ids) and scored[0] is None
    for token, entry in zip(prompt_ids[1:], scored[1:]):
        entry = {int(k): v for k, v in entry.items()}
        mine = entry[token]
        assert mine["rank"] >= 1 and isinstance(mine["decoded_token"], str)
        others = sorted((v for t, v in entry.items() if t != token), key=lambda v: v["rank"])
        assert len(entry) == (top_n if mine["rank"] <= top_n else top_n + 1)
        ranked = sorted(entry.values(), key=lambda v: -v["logprob"])
        assert [v["rank"] for v in ranked][:top_n] == list(range(1, top_n + 1))
        assert all(a["logprob"] >= b["logprob"] for a, b in zip(others, others[1:]))


def test_prompt_logprobs_in_completions_match_the_echoed_ones(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 2, "return_token_ids": True})
    choice = r.choices[0]
    prompt_ids = choice.model_extra["prompt_token_ids"]
    _check_prompt_logprobs(choice.model_extra["prompt_logprobs"], prompt_ids, 2)
    # the same numbers as echo + logprobs gives for the prompt's tokens (that path is checked against HF)
    echoed = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=1,
                                       temperature=0, echo=True, logprobs=2).choices[0].logprobs
    mine = [entry[str(t)]["logprob"] for t, entry in zip(prompt_ids[1:], choice.model_extra["prompt_logprobs"][1:])]
    assert mine == pytest.approx(echoed.token_logprobs[1:len(prompt_ids)], abs=1e-5)
    plain = client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert plain.choices[0].model_extra.get("prompt_logprobs") is None


def test_prompt_logprobs_in_chat(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2,
                                       extra_body={"prompt_logprobs": 1, "return_token_ids": True})
    _check_prompt_logprobs(r.model_extra["prompt_logprobs"], r.model_extra["prompt_token_ids"], 1)
    # vLLM's: chat echo with top_logprobs scores the prompt with as many alternatives
    echo = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, logprobs=True, top_logprobs=3,
                                          extra_body={"echo": True, "return_token_ids": True})
    _check_prompt_logprobs(echo.model_extra["prompt_logprobs"], echo.model_extra["prompt_token_ids"], 3)


@pytest.mark.parametrize("path, body, fragment", [
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": -2}, "non-negative integer or -1"),
    ("/v1/chat/completions", {"messages": USER, "prompt_logprobs": -2}, "non-negative integer or -1"),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 1, "stream": True}, "not available when stream"),
    ("/v1/chat/completions", {"messages": USER, "prompt_logprobs": -1, "stream": True}, "not available when stream"),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": -1}, "--max-logprobs"),
    ("/v1/chat/completions", {"messages": USER, "prompt_logprobs": 21}, "--max-logprobs"),
])
def test_bad_prompt_logprobs_are_400(api_server: ServerProcess, path: str, body: dict, fragment: str) -> None:
    r = _post(api_server, path, {"max_tokens": 1, **body})
    err = assert_openai_error(r.status_code, r.text, 400, param="prompt_logprobs")
    assert fragment in err["message"], err


def test_allowed_token_ids_restrict_every_draw(client: openai.OpenAI) -> None:
    for temperature in (0, 1.5):
        r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=temperature, seed=1,
                                      extra_body={"allowed_token_ids": [42, 77], "ignore_eos": True,
                                                  "return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"] and set(r.choices[0].model_extra["token_ids"]) <= {42, 77}
    chat = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=3, temperature=0,
                                          extra_body={"allowed_token_ids": [42], "ignore_eos": True,
                                                      "return_token_ids": True})
    assert chat.choices[0].model_extra["token_ids"] == [42, 42, 42]


def test_logprob_token_ids_report_the_named_tokens_and_the_sampled_one(client: openai.OpenAI) -> None:
    named = [100, 1000, 5000]
    chat = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, temperature=0, logprobs=True,
                                          top_logprobs=5, extra_body={"logprob_token_ids": named,
                                                                      "allowed_token_ids": [42],
                                                                      "return_tokens_as_token_ids": True})
    entry = chat.choices[0].logprobs.content[0]
    assert entry.token == "token_id:42"
    assert {t.token for t in entry.top_logprobs} == {f"token_id:{t}" for t in [*named, 42]}
    # each named logprob is the model's own: the logprob token 1000 gets when it is the one drawn
    forced = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, temperature=0, logprobs=True,
                                            extra_body={"allowed_token_ids": [1000]})
    reported = {t.token: t.logprob for t in entry.top_logprobs}
    assert reported["token_id:1000"] == pytest.approx(forced.choices[0].logprobs.content[0].logprob, abs=1e-4)
    comp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0, logprobs=5,
                                     extra_body={"logprob_token_ids": [100], "return_tokens_as_token_ids": True})
    lp = comp.choices[0].logprobs
    for token, top in zip(lp.tokens, lp.top_logprobs):
        assert set(top) == {token, "token_id:100"}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": USER, "logprob_token_ids": [1]}, "logprob_token_ids"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 1, "logprob_token_ids": [10 ** 6]}, "logprob_token_ids"),
    ("/v1/completions", {"prompt": "Hi", "echo": True, "max_tokens": 0, "logprobs": 1, "logprob_token_ids": [1]},
     "logprob_token_ids"),
    ("/v1/completions", {"prompt": "Hi", "allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/chat/completions", {"messages": USER, "allowed_token_ids": [10 ** 6]}, "allowed_token_ids"),
])
def test_bad_token_id_lists_are_400(api_server: ServerProcess, path: str, body: dict, param: str) -> None:
    r = _post(api_server, path, {"max_tokens": 1, **body})
    assert_openai_error(r.status_code, r.text, 400, param=param)


def test_logit_bias_names_every_key_that_is_not_a_token_id(api_server: ServerProcess) -> None:
    r = _post(api_server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1,
                                               "logit_bias": {"bad1": 1, "5": 2, "bad2": 3, "-1": 4}})
    err = assert_openai_error(r.status_code, r.text, 400, param="logit_bias")
    assert all(key in err["message"] for key in ("'bad1'", "'bad2'", "'-1'")) and "'5'" not in err["message"]


def test_kv_transfer_prompt_token_ids_replace_the_rendered_messages(client: openai.OpenAI,
                                                                    api_server: ServerProcess) -> None:
    """vLLM's decode side of a disaggregated prefill: the forwarded ids are the prompt, verbatim."""
    first = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, temperature=0,
                                           extra_body={"return_token_ids": True, "ignore_eos": True})
    ids = first.model_extra["prompt_token_ids"]
    other = [{"role": "user", "content": "Something else entirely, and longer than that."}]
    reused = client.chat.completions.create(model=MODEL, messages=other, max_tokens=4, temperature=0,
                                            extra_body={"kv_transfer_params": {"prompt_token_ids": ids},
                                                        "return_token_ids": True, "ignore_eos": True})
    assert reused.model_extra["prompt_token_ids"] == ids
    assert reused.choices[0].message.content == first.choices[0].message.content
    for bad in ([], ["a"], [10 ** 7]):
        r = _post(api_server, "/v1/chat/completions", {"messages": USER, "max_tokens": 1,
                                                      "kv_transfer_params": {"prompt_token_ids": bad}})
        assert_openai_error(r.status_code, r.text, 400, param="kv_transfer_params.prompt_token_ids")


def test_truncate_prompt_tokens_keeps_the_side_asked_for(client: openai.OpenAI, api_server: ServerProcess) -> None:
    ids = list(range(100, 108))
    for side, kept in ((None, ids[-4:]), ("left", ids[-4:]), ("right", ids[:4])):
        extra = {"return_token_ids": True, "truncate_prompt_tokens": 4,
                 **({"truncation_side": side} if side else {})}
        r = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, extra_body=extra)
        assert r.choices[0].model_extra["prompt_token_ids"] == kept and r.usage.prompt_tokens == 4
    # echo gives back what is left of the prompt: the same answer as sending that part alone
    echo = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, echo=True, temperature=0,
                                     extra_body={"truncate_prompt_tokens": 2})
    alone = client.completions.create(model=MODEL, prompt=ids[-2:], max_tokens=1, echo=True, temperature=0)
    assert echo.choices[0].text == alone.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1,
                                          extra_body={"truncate_prompt_tokens": 3, "return_token_ids": True})
    assert len(chat.model_extra["prompt_token_ids"]) == 3
    for bad in (0, -2, 10 ** 6):
        r = _post(api_server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "truncate_prompt_tokens": bad})
        assert_openai_error(r.status_code, r.text, 400, param="truncate_prompt_tokens")


def test_watermarking_field_is_taken_and_checked(api_server: ServerProcess) -> None:
    """vLLM's per-request switch: true/false (lax, like its other booleans) are served; on a server without
    --watermark-config true only logs that the answer is not watermarked; anything else is a 400."""
    for value in (False, True, "false"):
        r = _post(api_server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "watermarking": value})
        assert r.status_code == 200, r.text
    r = _post(api_server, "/v1/chat/completions", {"messages": USER, "max_tokens": 2, "watermarking": "maybe"})
    assert r.status_code == 400 and "watermarking" in r.text, r.text

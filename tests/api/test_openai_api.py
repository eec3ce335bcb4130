"""The OpenAI SDK against a live `pagedmodel serve`: completions and chat, streamed and not."""
from __future__ import annotations

import httpx
import openai
import pytest

from support import wait_until

from .conftest import API_KEY, ServerProcess

MODEL = "tiny-smol"


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].owned_by == "pagedmodel"
    assert models[0].max_model_len == 256


def test_completion_respects_max_tokens_and_reports_usage(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=7,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    (choice,) = r.choices
    assert choice.finish_reason == "length" and choice.text
    assert r.usage.completion_tokens == 7
    assert r.usage.prompt_tokens == 5      # SmolLM2's tokenizer: 5 tokens, no BOS for completions
    assert r.usage.total_tokens == 12


def test_greedy_is_deterministic_and_token_prompts_match_text_prompts(client: openai.OpenAI) -> None:
    a = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=6, temperature=0)
    b = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=6, temperature=0)
    ids = client.completions.create(model=MODEL, prompt=[19556, 905], max_tokens=6, temperature=0)
    assert a.choices[0].text == b.choices[0].text
    assert ids.usage.prompt_tokens == 2
    tok_text = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=1, temperature=0, echo=True)
    assert tok_text.choices[0].text.startswith("Hello world")


def test_fixed_seed_reproduces_text_and_different_seeds_differ(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0,
              extra_body={"ignore_eos": True})
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    c = client.completions.create(seed=99, **kw).choices[0].text
    assert a == b
    assert a != c   # a random 49k-vocab model: 12 identical draws by chance is impossible in practice


def test_n2_returns_two_distinct_indexed_samples(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, n=2, temperature=1.0,
                                  seed=7, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text != r.choices[1].text
    assert r.usage.completion_tokens == 16
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=4, temperature=1.0)
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_multiple_prompts_get_consecutive_choice_indices(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=["one two", "three four five"], max_tokens=3, n=2,
                                  temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 2 + 3
    assert r.usage.completion_tokens == 12


def test_stop_string_truncates_and_is_reported(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt="The story begins", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    # Stop on a piece of the greedy continuation: the reply must end right before it.
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), f"continuation too short to pick a stop string from: {full!r}"
    r = client.completions.create(model=MODEL, prompt="The story begins", max_tokens=12, temperature=0,
                                  stop=[stop], extra_body={"ignore_eos": True})
    (choice,) = r.choices
    assert choice.finish_reason == "stop"
    assert choice.model_extra.get("stop_reason") == stop
    assert choice.text == full[:full.index(stop)]
    assert stop not in choice.text


def test_logprobs_in_completion(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    for chosen_lp, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen_lp <= 0 and len(top) == 3
        # greedy: the chosen token is the most likely one
        assert chosen_lp == pytest.approx(max(top.values()), abs=1e-4)


def test_chat_completion_uses_the_chat_template(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                                                               {"role": "user", "content": "Hi there"}],
                                       max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("length", "stop")
    # <|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n
    assert r.usage.prompt_tokens == 19
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.bytes == list(t.token.encode()) for t in content)


def test_streamed_completion_matches_unstreamed_and_ends_with_usage(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt="Streaming test", max_tokens=9, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert len({c.id for c in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert all(c.usage is None for c in chunks[:-1])


def test_streamed_chat_ends_its_last_piece_with_the_finish_reason(client: openai.OpenAI) -> None:
    """vLLM's: the last token's text and finish_reason come in one chunk (clients read content there)."""
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=6, temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True}))
    last = chunks[-1].choices[0]
    assert last.finish_reason == "length" and last.delta.content


def test_streamed_chat_deltas_open_with_role_and_close_with_finish(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "Tell me something"}]
    whole = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in body) == whole.choices[0].message.content
    assert body[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_raw_sse_wire_format(api_server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 2, "stream": True, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", api_server.base_url + "/v1/completions", json=body, headers=api_server.headers,
                      timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert raw.endswith("data: [DONE]\n\n")


def test_api_key_is_required_on_v1_but_not_on_health_and_metrics(api_server: ServerProcess) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(api_server.base_url + "/v1/completions", json={"model": MODEL, "prompt": "x"},
                       headers=headers)
        assert r.status_code == 401, headers
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(api_server.base_url + "/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=api_server.base_url + "/v1", api_key="nope", max_retries=0).models.list()
    assert httpx.get(api_server.base_url + "/health").status_code == 200
    assert httpx.get(api_server.base_url + "/metrics").status_code == 200


def test_request_log_has_one_line_per_request(api_server: ServerProcess, client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="log me", max_tokens=2, temperature=0)
    # The line is written once the body is fully sent, which can trail the client's read slightly.
    lines = wait_until(lambda: [ln for ln in api_server.log().splitlines() if r.id in ln], timeout=5)
    assert len(lines) == 1
    assert "POST /v1/completions 200" in lines[0] and "completion_tokens=2" in lines[0]
    # the request id is also a response header, so a log line can be matched to a client's request
    raw = httpx.post(api_server.base_url + "/v1/chat/completions", headers=api_server.headers,
                     json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
    assert raw.headers["x-request-id"] == raw.json()["id"]
    assert wait_until(lambda: any(raw.json()["id"] in ln and "POST /v1/chat/completions 200" in ln
                                  for ln in api_server.log().splitlines()), timeout=5)


def test_request_log_notes_streams_cut_by_the_client(api_server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": "cut me", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", api_server.base_url + "/v1/completions", json=body, headers=api_server.headers,
                      timeout=30) as r:
        request_id = r.headers["x-request-id"]
        lines = r.iter_lines()
        next(lines)
    logged = wait_until(lambda: [ln for ln in api_server.log().splitlines() if request_id in ln], timeout=5)
    assert len(logged) == 1, api_server.log()[-2000:]
    assert "POST /v1/completions 200" in logged[0] and logged[0].endswith("(client disconnected)")


def test_beam_search_returns_n_distinct_deterministic_beams(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt="The best way to", max_tokens=5, n=2,
              extra_body={"use_beam_search": True, "best_of": 3, "ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert a.choices[0].text != a.choices[1].text
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 10


def test_streamed_stop_string_and_n2_match_unstreamed(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt="A long road", max_tokens=14, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 2]
    kw = dict(model=MODEL, prompt="A long road", max_tokens=14, temperature=0, stop=[stop],
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0]
    chunks = [c for c in client.completions.create(stream=True, **kw) if c.choices]
    # the stop string (or a prefix of it) is never streamed, then taken back
    assert "".join(c.choices[0].text for c in chunks) == whole.text == full[:full.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop" == whole.finish_reason

    kw2 = dict(model=MODEL, prompt="Two paths", max_tokens=6, n=2, temperature=1.0, seed=42,
               extra_body={"ignore_eos": True})
    unstreamed = client.completions.create(**kw2)
    texts = {0: "", 1: ""}
    finishes = {}
    for c in client.completions.create(stream=True, **kw2):
        for ch in c.choices:
            texts[ch.index] += ch.text
            if ch.finish_reason:
                assert ch.index not in finishes, "one finish chunk per choice"
                finishes[ch.index] = ch.finish_reason
    assert texts == {c.index: c.text for c in unstreamed.choices}
    assert finishes == {0: "length", 1: "length"}


def test_echo_with_logprobs_scores_the_prompt_too(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt="Hello world, how are you", max_tokens=3, temperature=0, echo=True, logprobs=2)
    full = client.completions.create(**kw).choices[0]
    lp = full.logprobs
    prompt_len = client.completions.create(model=MODEL, prompt=kw["prompt"], max_tokens=1).usage.prompt_tokens
    assert full.text.startswith("Hello world, how are you")
    assert len(lp.tokens) == len(lp.token_logprobs) == prompt_len + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None   # nothing scores the first token
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) >= 1 for t in lp.top_logprobs[1:])
    streamed_lps: list = []
    text = ""
    for ev in client.completions.create(stream=True, **kw):
        ch = ev.choices[0]
        text += ch.text
        if ch.logprobs:
            streamed_lps += ch.logprobs.token_logprobs
    assert text == full.text
    assert streamed_lps[0] is None
    assert streamed_lps[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)

"""Prompt embeddings over HTTP (--enable-prompt-embeds), through the real openai SDK as vLLM's clients send
them: completions' ``prompt_embeds`` (base64 of torch.save) and chat's ``prompt_embeds`` content parts.
The model's own embeddings of a text must answer exactly as the text does."""
from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Iterator

import openai
import pytest
import torch

from .conftest import ServerProcess

TEXT = "Hello, my name is"


@pytest.fixture(scope="module")
def embeds_server(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("embeds_server") / "server.log"
    srv = ServerProcess(server_model_dir, log, "--max-model-len", "256", "--kv-cache-memory", str(8 << 20),
                        "--dtype", "float32", "--enable-prompt-embeds", "--served-model-name", "m")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def sdk(embeds_server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=embeds_server.base_url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def embed(server_model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(server_model_dir), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(server_model_dir))

    def embed_text(text: str) -> tuple[list[int], torch.Tensor]:
        ids = tok(text, add_special_tokens=False).input_ids
        with torch.inference_mode():
            return ids, model.get_input_embeddings()(torch.tensor(ids)).clone()
    return embed_text


def b64(tensor: torch.Tensor) -> str:
    buf = io.BytesIO()
    torch.save(tensor, buf)
    return base64.b64encode(buf.getvalue()).decode()


def greedy(**kw) -> dict:
    return dict(model="m", max_tokens=6, temperature=0.0, logprobs=2, **kw)


def answer(choice) -> tuple[str, list[float]]:
    return choice.text, choice.logprobs.token_logprobs


def same(a: tuple[str, list[float]], b: tuple[str, list[float]]) -> bool:
    """Same text and logprobs (to float noise: a batch's composition moves the last bits)."""
    return a[0] == b[0] and len(a[1]) == len(b[1]) and all(abs(x - y) < 2e-3 for x, y in zip(a[1], b[1]))


def test_completion_from_embeddings_equals_the_text(sdk, embed):
    ids, rows = embed(TEXT)
    by_ids = sdk.completions.create(prompt=ids, **greedy())
    by_embeds = sdk.completions.create(prompt=None, **greedy(extra_body={"prompt_embeds": b64(rows)}))
    assert same(answer(by_embeds.choices[0]), answer(by_ids.choices[0]))
    assert by_embeds.usage.prompt_tokens == len(ids)
    # bf16 on the wire is cast to the model's dtype (float32 here): a close answer, not necessarily equal
    cast = sdk.completions.create(prompt=None, **greedy(extra_body={"prompt_embeds": b64(rows.bfloat16())}))
    assert len(cast.choices[0].logprobs.tokens) == 6


def test_embeddings_are_answered_before_text_prompts_and_stream_the_same(sdk, embed):
    ids_a, rows_a = embed(TEXT)
    ids_b, rows_b = embed("What is an LLM?")
    mixed = sdk.completions.create(prompt="This is a prompt",
                                   **greedy(extra_body={"prompt_embeds": [b64(rows_a), b64(rows_b)]}))
    assert [c.index for c in mixed.choices] == [0, 1, 2]
    expected = [answer(sdk.completions.create(prompt=p, **greedy()).choices[0])
                for p in (ids_a, ids_b, "This is a prompt")]
    assert all(same(answer(c), e) for c, e in zip(mixed.choices, expected, strict=True))
    stream = sdk.completions.create(prompt=None, stream=True, **greedy(extra_body={"prompt_embeds": b64(rows_a)}))
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected[0][0]
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]


def test_chat_part_equals_the_same_text(sdk, embed):
    _, rows = embed(TEXT)
    kw = dict(model="m", max_tokens=8, temperature=0.0, logprobs=True)
    text = sdk.chat.completions.create(messages=[{"role": "user", "content": TEXT}], **kw)
    parts = sdk.chat.completions.create(
        messages=[{"role": "user", "content": [{"type": "prompt_embeds", "data": b64(rows)}]}], **kw)
    assert parts.choices[0].message.content == text.choices[0].message.content
    assert same(("", [t.logprob for t in parts.choices[0].logprobs.content]),
                ("", [t.logprob for t in text.choices[0].logprobs.content]))
    assert parts.usage.prompt_tokens == text.usage.prompt_tokens


def test_chat_parts_between_text_in_several_messages(sdk, embed):
    _, hello = embed(" Hello")
    _, world = embed(" world")
    kw = dict(model="m", max_tokens=8, temperature=0.0, logprobs=True)
    text = sdk.chat.completions.create(messages=[{"role": "system", "content": "Be brief. Hello"},
                                                 {"role": "user", "content": "Say world and more"}], **kw)
    parts = sdk.chat.completions.create(messages=[
        {"role": "system", "content": [{"type": "text", "text": "Be brief."},
                                       {"type": "prompt_embeds", "data": b64(hello)}]},
        {"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "prompt_embeds", "data": b64(world)},
                                     {"type": "text", "text": " and more"}]}], **kw)
    assert parts.choices[0].message.content == text.choices[0].message.content
    assert same(("", [t.logprob for t in parts.choices[0].logprobs.content]),
                ("", [t.logprob for t in text.choices[0].logprobs.content]))
    streamed = sdk.chat.completions.create(messages=[
        {"role": "user", "content": [{"type": "prompt_embeds", "data": b64(hello)}]}], stream=True, **kw)
    whole = sdk.chat.completions.create(messages=[
        {"role": "user", "content": [{"type": "prompt_embeds", "data": b64(hello)}]}], **kw)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == whole.choices[0].message.content


@pytest.mark.parametrize("body, message", [
    ({"prompt_embeds": "not base64!!"}, "not valid base64"),
    ({"prompt_embeds": base64.b64encode(b"not a tensor file").decode()}, "could not be loaded as a torch tensor"),
    ({"prompt_embeds": b64(torch.zeros(3, 7))}, "hidden size 7"),
    ({"prompt_embeds": b64(torch.zeros(3, 64, dtype=torch.int64))}, "floating point"),
    ({"prompt_embeds": b64({"a": torch.zeros(2, 64)})}, "one tensor"),
    ({"prompt_embeds": b64(torch.zeros(3, 64)), "prompt_logprobs": True}, "not compatible"),
    ({"prompt_embeds": b64(torch.zeros(3, 64)), "echo": True}, "echo"),
    ({"prompt_embeds": []}, "Either prompt or prompt_embeds must be provided and non-empty."),
])
def test_bad_completion_embeddings_are_400s(sdk, body, message):
    with pytest.raises(openai.BadRequestError) as err:
        sdk.completions.create(model="m", prompt=None, max_tokens=2, extra_body=body)
    assert message in err.value.message


def test_empty_embeddings_list_beside_a_prompt_is_no_prompt(sdk):
    out = sdk.completions.create(model="m", prompt="Hello", max_tokens=2, extra_body={"prompt_embeds": []})
    assert len(out.choices) == 1


@pytest.mark.parametrize("part, message", [
    ({"type": "prompt_embeds"}, "data"),
    ({"type": "prompt_embeds", "data": "not_valid_base64!!"}, "not valid base64"),
])
def test_bad_chat_parts_are_400s(sdk, part, message):
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [part]}])
    assert message in err.value.message


def test_refused_without_the_flag(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny-smol", prompt=None, max_tokens=2,
                                  extra_body={"prompt_embeds": b64(torch.zeros(3, 64))})
    assert "--enable-prompt-embeds" in err.value.message

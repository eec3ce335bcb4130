"""The one prompt validation (engine and HTTP server): accepted forms, refusals, their params and messages."""
from __future__ import annotations

import pytest

from pagedmodel.server.engine.input_processor import (CONTEXT_LENGTH_EXCEEDED, InputProcessor, InvalidRequestError,
                                                      encode_prompt)
from pagedmodel.server.engine.sampling_params import SamplingParams


class _Encoded:
    def __init__(self, ids: list[int]):
        self.input_ids = ids


class WordTokenizer:
    """"t5 t6" -> [5, 6]; any other word fails as a real tokenizer's internal error would."""

    def __call__(self, text: str) -> _Encoded:
        return _Encoded([int(w.removeprefix("t")) for w in text.split()])


@pytest.fixture
def inputs() -> InputProcessor:
    # 64-token context, 100-token vocabulary, 10 blocks of 8 tokens
    return InputProcessor(WordTokenizer(), vocab_size=100, max_model_len=64, num_kv_blocks=10, block_size=8)


@pytest.mark.parametrize("prompt,text,ids,salt", [
    ("t5 t6", "t5 t6", [5, 6], None),
    ([5, 6], None, [5, 6], None),
    ({"prompt": "t7"}, "t7", [7], None),
    ({"prompt_token_ids": [1, 2, 3]}, None, [1, 2, 3], None),
    ({"prompt_token_ids": [1, 2], "cache_salt": "tenant-a"}, None, [1, 2], "tenant-a"),
    ({"prompt": "t4", "cache_salt": "b"}, "t4", [4], "b"),
])
def test_prompt_forms(inputs, prompt, text, ids, salt):
    out = inputs.process(prompt, SamplingParams())
    assert (out.text, out.token_ids, out.cache_salt) == (text, ids, salt)


@pytest.mark.parametrize("prompt,params,param,message", [
    ([], SamplingParams(), "prompt", "prompt must not be empty"),
    ("", SamplingParams(), "prompt", "prompt must not be empty"),
    ([3, 100], SamplingParams(), "prompt", r"token id 100 is out of vocabulary: ids are in \[0, 100\)"),
    ([3, -1], SamplingParams(), "prompt", r"token id -1 is out of vocabulary"),
    ([3, "x"], SamplingParams(), "prompt", "token ids must be integers, got 'x'"),
    ([3, True], SamplingParams(), "prompt", "token ids must be integers, got True"),
    ([1] * 70, SamplingParams(), "prompt", "maximum context length is 64 tokens, but the prompt has 70 tokens"),
    ([1] * 64, SamplingParams(max_tokens=1), "prompt", "has 64: no room left to generate"),
    ([1] * 40, SamplingParams(max_tokens=40), "max_tokens", "max_tokens is 40, 80 in total"),
    ([1] * 4, SamplingParams(stop_token_ids=[100]), "stop_token_ids", "outside the vocabulary"),
    ([1] * 4, SamplingParams(n=2, temperature=1, max_tokens=40), "max_tokens",
     "2 sequences of up to 44 tokens cannot fit in the KV cache"),
    ({"prompt_token_ids": [1], "prompt": "t1"}, SamplingParams(), "prompt", "exactly one of"),
    ({}, SamplingParams(), "prompt", "exactly one of"),
    ({"prompt": "t1", "images": []}, SamplingParams(), "prompt", r"unknown prompt field\(s\) \['images'\]"),
    ({"prompt": [1, 2]}, SamplingParams(), "prompt", "'prompt' must be a string"),
    ({"prompt_token_ids": "t1"}, SamplingParams(), "prompt", "'prompt_token_ids' must be a list"),
    ({"prompt": "t1", "cache_salt": ""}, SamplingParams(), "cache_salt", "non-empty string"),
    ({"prompt": "t1", "cache_salt": 3}, SamplingParams(), "cache_salt", "non-empty string"),
    (12, SamplingParams(), "prompt", "a prompt is a string, a list of token ids, or a dict"),
    ("t1 hello", SamplingParams(), "prompt", "prompt could not be tokenized: ValueError"),
    ("t1 \ud800", SamplingParams(), "prompt", "unpaired UTF-16 surrogate"),
])
def test_refusals_name_their_param(inputs, prompt, params, param, message):
    with pytest.raises(InvalidRequestError, match=message) as err:
        inputs.process(prompt, params)
    assert err.value.param == param


def test_context_errors_carry_the_openai_code(inputs):
    for ids, params in (([1] * 70, SamplingParams()), ([1] * 40, SamplingParams(max_tokens=40))):
        with pytest.raises(InvalidRequestError) as err:
            inputs.check_prompt(ids, params)
        assert err.value.code == CONTEXT_LENGTH_EXCEEDED
    with pytest.raises(InvalidRequestError) as err:
        inputs.check_prompt([], SamplingParams())
    assert err.value.code is None


def test_check_prompt_names_the_api_field(inputs):
    with pytest.raises(InvalidRequestError) as err:
        inputs.check_prompt([], SamplingParams(), param="messages")
    assert err.value.param == "messages"


def test_cache_salt_argument_and_dict_salt_do_not_both_apply(inputs):
    assert inputs.process([1, 2], SamplingParams(), cache_salt="s").cache_salt == "s"
    with pytest.raises(InvalidRequestError, match="given twice") as err:
        inputs.process({"prompt_token_ids": [1], "cache_salt": "a"}, SamplingParams(), cache_salt="b")
    assert err.value.param == "cache_salt"


def test_encode_prompt_takes_any_tokenizer():
    assert encode_prompt(WordTokenizer(), "t9 t8") == [9, 8]
    with pytest.raises(InvalidRequestError) as err:
        encode_prompt(WordTokenizer(), "nope", param="messages")
    assert err.value.param == "messages"

"""Stop conditions: EOS, stop token ids, stop strings (excluded from text), max_tokens, max_model_len."""
from __future__ import annotations

import pytest

from pagedmodel.server.engine.args import EngineArgs
from pagedmodel.server.engine.llm_engine import InvalidRequestError, LLMEngine
from pagedmodel.server.engine.llm import LLM
from pagedmodel.server.engine.sampling_params import SamplingParams

PROMPT = list(range(3, 23))


@pytest.fixture(scope="module")
def llm(wordlevel_llama_dir):
    return LLM(str(wordlevel_llama_dir), device="cpu", block_size=8, max_model_len=64)


@pytest.fixture(scope="module")
def free_run(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 30
    return out


def test_stop_token_id(llm, free_run):
    target = free_run.token_ids[5]
    first = free_run.token_ids.index(target)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[target]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == target
    assert out.token_ids == free_run.token_ids[:first + 1]


def test_stop_string_is_cut_from_text(llm, free_run):
    words = free_run.text.split()
    stop = words[6]
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text
    assert free_run.text.startswith(out.text)
    kept = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, stop=[stop],
                                                 include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text.endswith(stop)


def test_eos_stops_unless_ignored(llm, free_run):
    eos = llm.engine.eos_token_ids   # one set: the sampler's (min_tokens) and the stop checker's
    saved = set(eos)
    eos.clear()
    eos.add(free_run.token_ids[3])
    try:
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30))[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason is None
        assert out.token_ids == free_run.token_ids[:free_run.token_ids.index(free_run.token_ids[3]) + 1]
        late = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, min_tokens=10))[0].outputs[0]
        assert len(late.token_ids) >= 10
        ignored = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
        assert ignored.finish_reason == "length"
    finally:
        eos.clear()
        eos.update(saved)


def test_max_tokens_and_max_model_len(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 7
    long_prompt = list(range(3, 3 + 60))
    out = llm.generate([long_prompt], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4   # 60 + 4 = max_model_len 64


@pytest.mark.parametrize("prompt,params,param", [
    (list(range(3, 3 + 64)), SamplingParams(max_tokens=1), "prompt"),
    (list(range(3, 40)), SamplingParams(max_tokens=40), "max_tokens"),
    ([], SamplingParams(), "prompt"),
    ([3, 4, 100000], SamplingParams(), "prompt"),
    ([3, -1], SamplingParams(), "prompt"),
])
def test_invalid_requests_are_refused_and_hold_nothing(llm, prompt, params, param):
    engine: LLMEngine = llm.engine
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("bad", prompt, params)
    assert err.value.param == param
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks


def test_too_long_prompt_message_states_limit_and_length(llm):
    with pytest.raises(InvalidRequestError, match=r"64 tokens.*70 tokens"):
        llm.engine.add_request("long", list(range(3, 73)), SamplingParams())


def test_kv_cache_smaller_than_max_model_len_is_a_config_error(wordlevel_llama_dir):
    from pagedmodel.server.engine.args import ConfigError

    with pytest.raises(ConfigError, match="fewer than --max-model-len"):
        LLMEngine(EngineArgs(model=str(wordlevel_llama_dir), device="cpu", block_size=8, max_model_len=256,
                             num_gpu_blocks_override=4))

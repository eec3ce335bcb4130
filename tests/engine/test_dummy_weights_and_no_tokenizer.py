"""vLLM's --load-format dummy (random weights from config.json alone) and --skip-tokenizer-init (token ids in,
token ids out): each serves what it can and refuses, with a message, what it cannot."""
from __future__ import annotations

import shutil

import pytest
import torch

from pagedmodel.server.engine.args import ConfigError, EngineArgs
from pagedmodel.server.engine.input_processor import InvalidRequestError
from pagedmodel.server.engine.llm import LLM
from pagedmodel.server.engine.model_store import ModelNotAvailableError
from pagedmodel.server.engine.models.loader import DUMMY_WEIGHT_RANGE
from pagedmodel.server.engine.sampling_params import SamplingParams
from pagedmodel.server.engine.structured_outputs_params import StructuredOutputsParams

PROMPT = [1, 504, 3458, 282, 4649, 314]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SMALL = {"device": "cpu", "dtype": "float32", "block_size": 8, "max_model_len": 128}


@pytest.fixture(scope="module")
def config_only_dir(tmp_path_factory, tiny_llama_dir):
    """The tiny model's config and tokenizer without its weights (vLLM's test downloads no *.safetensors)."""
    out = tmp_path_factory.mktemp("config-only")
    for f in tiny_llama_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    return out


def test_dummy_weights_need_only_the_config(config_only_dir):
    with pytest.raises(ModelNotAvailableError, match="no \\*.safetensors weights"):
        LLM(str(config_only_dir), **SMALL)
    llm = LLM(str(config_only_dir), load_format="dummy", **SMALL)
    params = list(llm.engine.model.parameters())
    assert params and all(p.abs().max() <= DUMMY_WEIGHT_RANGE for p in params)
    assert all(p.std() > DUMMY_WEIGHT_RANGE / 4 for p in params)   # drawn, not left at ones or zeros
    out = llm.generate([PROMPT], GREEDY)[0].outputs[0]
    assert len(out.token_ids) == 8 and out.text   # a real tokenizer still decodes the noise
    # the same --seed gives the same weights, so the same tokens; another seed other weights
    assert LLM(str(config_only_dir), load_format="dummy", **SMALL).generate([PROMPT], GREEDY)[0].outputs[0].token_ids \
        == out.token_ids
    other = LLM(str(config_only_dir), load_format="dummy", seed=1, **SMALL)
    assert not torch.equal(next(other.engine.model.parameters()), params[0])


def test_an_unknown_load_format_is_refused():
    with pytest.raises(ConfigError, match="--load-format tensorizer is not served"):
        EngineArgs(load_format="tensorizer")


@pytest.fixture(scope="module")
def tokenizer_free(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), skip_tokenizer_init=True, **SMALL)


def test_without_a_tokenizer_token_ids_give_the_same_tokens_and_no_text(tiny_llama_dir, tokenizer_free):
    assert tokenizer_free.engine.tokenizer is None
    expected = LLM(str(tiny_llama_dir), **SMALL).generate([PROMPT], GREEDY)[0].outputs[0]
    got = tokenizer_free.generate([PROMPT], GREEDY)[0].outputs[0]
    assert got.token_ids == expected.token_ids and expected.text
    assert got.text == ""
    # EOS still ends a sequence: the ids come from config.json (eos_token_id 2) without the tokenizer
    assert 2 in tokenizer_free.engine.eos_token_ids
    beams = tokenizer_free.generate([PROMPT], SamplingParams(n=2, use_beam_search=True, temperature=0,
                                                             max_tokens=4, ignore_eos=True))[0].outputs
    assert len(beams) == 2 and all(b.text == "" and len(b.token_ids) == 4 for b in beams)


@pytest.mark.parametrize("prompt,params,param", [
    ("Hello", GREEDY, "prompt"),
    ({"prompt": "Hello"}, GREEDY, "prompt"),
    (PROMPT, SamplingParams(max_tokens=4, stop=["."]), "stop"),
    (PROMPT, SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[ab]+")),
     "structured_outputs"),
], ids=["text", "text-dict", "stop-strings", "structured-outputs"])
def test_without_a_tokenizer_what_needs_text_is_refused_and_holds_nothing(tokenizer_free, prompt, params, param):
    engine = tokenizer_free.engine
    free = engine.scheduler.block_manager.num_free_blocks
    with pytest.raises(InvalidRequestError, match="--skip-tokenizer-init") as err:
        engine.add_request("r", prompt, params)
    assert err.value.param == param
    assert "r" not in engine.requests and engine.scheduler.block_manager.num_free_blocks == free


def test_a_reasoning_config_needs_the_tokenizer(tiny_llama_dir):
    with pytest.raises(ConfigError, match="cannot go with --skip-tokenizer-init"):
        LLM(str(tiny_llama_dir), skip_tokenizer_init=True,
            reasoning_config={"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}, **SMALL)


def test_the_generate_cli_refuses_to_run_without_a_tokenizer():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "pagedmodel.cli", "generate", "Hi", "--skip-tokenizer-init"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "needs the tokenizer: drop --skip-tokenizer-init" in r.stderr, r.stderr

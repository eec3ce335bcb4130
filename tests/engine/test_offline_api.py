"""vLLM's offline conventions: prompt forms accepted by LLM.generate, and cache_salt isolating the prefix cache."""
from __future__ import annotations

import pytest

from pagedmodel.server.engine.input_processor import InvalidRequestError
from pagedmodel.server.engine.llm import LLM
from pagedmodel.server.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = list(range(3, 3 + 10))
SALTED = list(range(200, 240))   # five full blocks of 8, used by no other test


@pytest.fixture(scope="module")
def llm(wordlevel_llama_dir):
    return LLM(str(wordlevel_llama_dir), device="cpu", block_size=8, max_model_len=128, enable_prefix_caching=True)


def test_tokens_prompt_dict(llm):
    (out,) = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, ignore_eos=True))
    assert out.finished and out.prompt_token_ids == [1, 2, 3] and len(out.outputs[0].token_ids) == 4


def test_every_prompt_form_gives_the_same_greedy_tokens(llm):
    text = " ".join(f"t{i}" for i in PROMPT)
    ids = list(llm.tokenizer(text).input_ids)
    forms = [text, ids, {"prompt": text}, {"prompt_token_ids": ids}]
    outs = llm.generate(forms, GREEDY)
    assert [o.prompt_token_ids for o in outs] == [ids] * 4
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert [o.prompt for o in outs] == [text, None, text, None]
    single = [llm.generate(form, GREEDY)[0].outputs[0].token_ids for form in forms]   # one prompt, not a list
    assert single == [outs[0].outputs[0].token_ids] * 4


def test_a_bad_prompt_in_a_list_leaves_nothing_behind(llm):
    with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
        llm.generate([[5, 6], {"prompt_token_ids": "t5"}], GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_cache_salt_isolates_prefix_cache_blocks(llm):
    def cached(prompt) -> int:
        return llm.generate([prompt], GREEDY)[0].num_cached_tokens

    assert cached({"prompt_token_ids": SALTED, "cache_salt": "tenant-a"}) == 0
    # same tokens, another salt or none: no block is shared with tenant a's
    assert cached({"prompt_token_ids": SALTED, "cache_salt": "tenant-b"}) == 0
    assert cached(SALTED) == 0
    # the same salt (and no salt, the second time) reuses its own blocks: 4 full blocks (the last token is computed)
    assert cached({"prompt_token_ids": SALTED, "cache_salt": "tenant-a"}) == 32
    assert cached({"prompt_token_ids": SALTED, "cache_salt": "tenant-b"}) == 32
    assert cached(SALTED) == 32

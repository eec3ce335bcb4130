"""Prompt logprobs (for echo + logprobs): each prompt token scored by the model given the tokens before it,
equal to HF's forward pass, also when the prompt is chunked across steps or shares a cached prefix."""
from __future__ import annotations

import math

import torch

from pagedmodel.server.engine.llm import LLM
from pagedmodel.server.engine.sampling_params import SamplingParams

PROMPT = list(range(10, 47))


def hf_prompt_logprobs(model_dir, prompt):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def test_prompt_logprobs_match_hf_across_chunks_and_cache(wordlevel_llama_dir):
    ref = hf_prompt_logprobs(wordlevel_llama_dir, PROMPT)
    # an 8-token budget computes the prompt in five chunks; prefix caching is on and the same prompt ran before
    llm = LLM(str(wordlevel_llama_dir), device="cpu", dtype="float32", block_size=8, max_model_len=128,
              max_num_batched_tokens=8, enable_prefix_caching=True)
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2))
    bm = llm.engine.scheduler.block_manager
    hits_before = bm.prefix_hits
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))[0]
    assert bm.prefix_hits == hits_before, "cached blocks have no logits: no prefix reuse"
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(PROMPT) and lps[0] is None
    assert len(out.prompt_token_ranks) == len(PROMPT) and out.prompt_token_ranks[0] is None
    for p in range(1, len(PROMPT)):
        entry = lps[p]
        token = PROMPT[p]
        assert math.isclose(entry[token], float(ref[p - 1, token]), abs_tol=1e-4), p
        top3 = torch.topk(ref[p - 1], 3).indices.tolist()
        assert set(top3) <= set(entry), p
        # the token's rank in HF's distribution (1 = the most likely); a random model ranks most tokens low
        assert out.prompt_token_ranks[p] == 1 + int((ref[p - 1] > ref[p - 1, token]).sum()), p
    assert max(out.prompt_token_ranks[1:]) > 3, "some prompt token outside the top 3 needs its own rank"
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2))[0]
    assert plain.prompt_logprobs is None


def test_one_token_prompt_has_only_the_unscored_entry(wordlevel_llama_dir):
    llm = LLM(str(wordlevel_llama_dir), device="cpu", block_size=8, max_model_len=128)
    out = llm.generate([[5]], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    assert out.prompt_logprobs == [None]

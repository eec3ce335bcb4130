"""The engine gives the same greedy tokens with the Triton backend (interpreter) as with torch.

A tiny random Llama (GQA, head_dim 16; untied lm_head, so the next token depends on context
rather than echoing the embedding of the last one), 8-token blocks and an 8-token step
budget: prompts are split into chunked prefills that share steps with other sequences'
decodes, prefix caching makes later prompts start from cached blocks, and a seeded ``n=2``
request forks a sequence (copy-on-write of its partly filled last block goes through
``copy_blocks``). Beyond equal tokens, the chosen tokens' logprobs must agree closely: equal
argmaxes alone could hide a small attention error.
"""
from __future__ import annotations

import math

import pytest

from pagedmodel.kernels.backend import BACKEND_ENV
from pagedmodel.server.engine.llm import LLM
from pagedmodel.server.engine.sampling_params import SamplingParams
from tiny_models import make_tiny_model_dir

PROMPTS = [
    "The capital of France is",
    "The capital of France is a city that",
    "Hi",
    "One two three four five six seven eight nine ten eleven",
]
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def untied_llama_dir(tmp_path_factory, smollm2_dir):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama-untied"), "llama",
                               tokenizer_dir=smollm2_dir, tie_word_embeddings=False)


def _generate(model_dir, backend: str, monkeypatch) -> list[list[tuple[list[int], list[float]]]]:
    monkeypatch.setenv(BACKEND_ENV, backend)
    llm = LLM(model=str(model_dir), device="cpu", dtype="float32", block_size=8, max_model_len=64,
              num_gpu_blocks_override=96, max_num_batched_tokens=8, enable_prefix_caching=True)
    assert llm.engine.backend.name == backend
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    # greedy n > 1 is refused (identical samples); seeded sampling forks deterministically, and
    # the backends' probabilities differ by ~1e-6, far from flipping a draw
    forked = SamplingParams(temperature=0.7, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True, n=2, logprobs=0)
    outputs = llm.generate(PROMPTS, [greedy, greedy, forked, greedy])
    return [[(list(c.token_ids), [lp[t] for lp, t in zip(c.logprobs, c.token_ids)]) for c in out.outputs]
            for out in outputs]


def test_triton_backend_matches_torch_greedy_tokens(untied_llama_dir, monkeypatch):
    reference = _generate(untied_llama_dir, "torch", monkeypatch)
    candidate = _generate(untied_llama_dir, "triton", monkeypatch)
    assert [len(out) for out in reference] == [1, 1, 2, 1]
    assert all(len(tokens) == MAX_TOKENS for out in reference for tokens, _ in out)
    assert [[tokens for tokens, _ in out] for out in candidate] == [[tokens for tokens, _ in out] for out in reference]
    for ref_out, cand_out in zip(reference, candidate):
        for (_, ref_lps), (_, cand_lps) in zip(ref_out, cand_out):
            assert all(math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4) for a, b in zip(ref_lps, cand_lps))

"""Decode through captured graphs with the Triton backend (interpreter) gives eager's greedy tokens.

The CPU stand-in for CUDA graphs (``PAGEDMODEL_CUDA_GRAPHS=emulate``) replays each captured decode
forward from the runner's static buffers, so the Triton kernels run exactly as a replay feeds them:
padded batches, max-model-len-wide block tables, host lengths fixed at capture. The torch-backend
tests (and the hand-made cache checks) are tests/engine/test_cuda_graph_runner.py; tiny shapes
here because the interpreter is slow.
"""
from __future__ import annotations

import math

import pytest

from pagedmodel.kernels.backend import BACKEND_ENV
from pagedmodel.server.engine.cuda_graph_runner import GRAPHS_ENV
from pagedmodel.server.engine.llm import LLM
from pagedmodel.server.engine.sampling_params import SamplingParams
from tiny_models import make_tiny_model_dir

PROMPTS = ["The capital of France is", "Hi", "One two three four five six seven", "a b", "Once upon a time"]
MAX_TOKENS = [10, 8, 6, 5, 3]   # the decode batch shrinks 5 -> 4 -> 3 -> 2 -> 1: graphs of 8, 4, 2 and 1 rows


@pytest.fixture(scope="module")
def untied_llama_dir(tmp_path_factory, smollm2_dir):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama-graphs-triton"), "llama",
                               tokenizer_dir=smollm2_dir, tie_word_embeddings=False)


def _generate(model_dir, graphs: str, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "triton")
    monkeypatch.setenv(GRAPHS_ENV, graphs)
    llm = LLM(model=str(model_dir), device="cpu", dtype="float32", block_size=8, max_model_len=48, max_num_seqs=8,
              num_gpu_blocks_override=64, max_num_batched_tokens=16)
    assert llm.engine.backend.name == "triton"
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=0) for m in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params)
    tokens = [(list(o.outputs[0].token_ids), [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
              for o in outs]
    return tokens, llm.engine.runner.graph_runner


def test_triton_graph_decode_matches_eager(untied_llama_dir, monkeypatch):
    reference, none = _generate(untied_llama_dir, "off", monkeypatch)
    assert none is None
    candidate, runner = _generate(untied_llama_dir, "emulate", monkeypatch)
    assert [len(t) for t, _ in reference] == MAX_TOKENS
    assert [t for t, _ in candidate] == [t for t, _ in reference]
    for (_, ref_lps), (_, cand_lps) in zip(reference, candidate):
        assert all(math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4) for a, b in zip(ref_lps, cand_lps))
    assert set(runner.stats.replays) == {8, 4, 2, 1}, runner.stats
    assert runner.stats.eager_steps["not a pure decode step"] >= 1

"""``--torch-compile``: the forward through one inductor graph gives the eager engine's tokens on every
kind of step; ``--enforce-eager`` wins; a compile that fails leaves the engine serving eagerly."""
from __future__ import annotations

import argparse
import shutil

import pytest
import torch

from pagedmodel.kernels.attention_metadata import AttentionMetadata
from pagedmodel.kernels.backend import TORCH_BACKEND
from pagedmodel.kernels.forward_attention import forward_attention, forward_context
from pagedmodel.server.engine import compiled_forward
from pagedmodel.server.engine.args import EngineArgs
from pagedmodel.server.engine.llm import LLM
from pagedmodel.server.engine.sampling_params import SamplingParams

# a long prompt among short ones, a 24-token step budget: prefill chunks, decode rows and both in one step
PROMPTS = ["Hello", "The capital of France is", "one two three " * 14, "def fib(n):"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ENGINE = dict(device="cpu", dtype="float32", max_model_len=256, max_num_batched_tokens=24, max_num_seqs=8,
              kv_cache_memory=8 << 20)


def tokens(llm: LLM) -> list[list[int]]:
    """The batch's tokens, then one prompt's alone (its decode steps have a single row)."""
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY) + llm.generate(PROMPTS[1:2], GREEDY)]


@pytest.fixture(scope="module")
def eager_tokens(tiny_llama_dir) -> list[list[int]]:
    return tokens(LLM(str(tiny_llama_dir), **ENGINE))


def test_compiled_engine_gives_the_eager_tokens(tiny_llama_dir, eager_tokens):
    llm = LLM(str(tiny_llama_dir), torch_compile=True, **ENGINE)
    runner = llm.engine.runner
    assert runner.compiled is not None, runner.compile_error
    assert runner.compiled.compile_seconds > 0
    calls = []
    real_call = compiled_forward.CompiledForward.__call__

    def counting(self, *args, **kwargs):
        calls.append(args[0].shape[0])
        return real_call(self, *args, **kwargs)

    compiled_forward.CompiledForward.__call__ = counting
    try:
        assert tokens(llm) == eager_tokens
    finally:
        compiled_forward.CompiledForward.__call__ = real_call
    assert runner.compiled is not None and runner.compile_error is None
    # every step went through the graph: single-token decode steps and multi-row prefill/mixed ones
    assert 1 in calls and 4 in calls and max(calls) == 24


def test_a_second_compiled_engine_with_other_weights_gives_its_own_tokens(tiny_llama_dir, eager_tokens, tmp_path):
    """Frozen weights are constants of the graph, and dynamo may reuse a graph for a second model of the
    same shapes in one process: the second engine must still compute with its own weights."""
    from safetensors.torch import load_file, save_file

    other = tmp_path / "other"
    shutil.copytree(tiny_llama_dir, other)
    for f in other.glob("*.safetensors"):
        save_file({k: v if "norm" in k else v * 1.5 for k, v in load_file(f).items()}, f)
    first = LLM(str(tiny_llama_dir), torch_compile=True, **ENGINE)
    second = LLM(str(other), torch_compile=True, **ENGINE)
    assert first.engine.runner.compiled is not None and second.engine.runner.compiled is not None
    compiled = tokens(second)
    second.engine.runner.compiled = None
    assert compiled == tokens(second) != eager_tokens


def test_enforce_eager_wins_over_torch_compile(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("--enforce-eager must not compile"))
    llm = LLM(str(tiny_llama_dir), torch_compile=True, enforce_eager=True, **ENGINE)
    assert llm.engine.runner.compiled is None


def _failing_compile(*args, **kwargs):
    def compiled(*a, **k):
        raise RuntimeError("inductor: C++ compile failed (simulated)")
    return compiled


def test_a_failed_compile_serves_eagerly(tiny_llama_dir, eager_tokens, monkeypatch, caplog):
    monkeypatch.setattr(torch, "compile", _failing_compile)
    llm = LLM(str(tiny_llama_dir), torch_compile=True, **ENGINE)
    runner = llm.engine.runner
    assert runner.compiled is None
    assert "simulated" in runner.compile_error
    assert "every step runs eagerly" in caplog.text
    assert tokens(llm) == eager_tokens


def test_a_step_whose_recompile_fails_reruns_eagerly_and_later_steps_stay_eager(tiny_llama_dir, eager_tokens,
                                                                                 monkeypatch):
    llm = LLM(str(tiny_llama_dir), **ENGINE)
    runner = llm.engine.runner
    failing = compiled_forward.CompiledForward(runner.model)
    failing._compiled = _failing_compile()
    runner.compiled = failing
    assert tokens(llm) == eager_tokens
    assert runner.compiled is None and "simulated" in runner.compile_error


def test_the_attention_op_needs_a_forward_context():
    q = torch.zeros(1, 2, 4)
    with pytest.raises(RuntimeError, match="outside forward_context"):
        forward_attention(q, q[:, :1], q[:, :1], 0, 0.5)


def test_the_attention_op_reads_the_step_from_its_context():
    """The op is the backend's write + attention for the layer it names, and nothing else."""
    torch.manual_seed(0)
    caches = [torch.zeros(2, 4, 16, 1, 8) for _ in range(2)]
    q, k, v = torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    meta = AttentionMetadata.build([3], [3], [[2]], [32, 33, 34])
    with forward_context(meta, TORCH_BACKEND, caches):
        out = forward_attention(q, k, v, 1, 8 ** -0.5)
    assert torch.equal(caches[1][0, 2, :3], k) and torch.equal(caches[1][1, 2, :3], v)
    assert not caches[0].any()
    expected_cache = torch.zeros(2, 4, 16, 1, 8)
    TORCH_BACKEND.write_kv(k, v, expected_cache, meta.slot_mapping)
    torch.testing.assert_close(out, TORCH_BACKEND.paged_attention(q, expected_cache, meta, 8 ** -0.5))


def test_the_flag_parses():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args(["--torch-compile"])).torch_compile is True
    assert EngineArgs.from_cli_args(parser.parse_args([])).torch_compile is False

"""Iteration-level batching: arrivals join at the next step; finished requests free blocks at once."""
from __future__ import annotations

from pagedmodel.server.engine.args import EngineArgs
from pagedmodel.server.engine.llm_engine import LLMEngine
from pagedmodel.server.engine.sampling_params import SamplingParams

GREEDY = dict(temperature=0, ignore_eos=True)


def make_engine(model_dir, **kw) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(model_dir), device="cpu", block_size=8, max_model_len=128, **kw))


def test_request_arriving_mid_run_joins_at_the_next_step(wordlevel_llama_dir):
    engine = make_engine(wordlevel_llama_dir)
    engine.add_request("a", list(range(3, 20)), SamplingParams(max_tokens=30, **GREEDY))
    engine.add_request("b", list(range(30, 40)), SamplingParams(max_tokens=30, **GREEDY))
    for _ in range(3):
        engine.step()
    a, b = engine.requests["a"], engine.requests["b"]
    assert a.seqs[0].num_output_tokens == 3 and b.seqs[0].num_output_tokens == 3
    engine.add_request("c", list(range(50, 62)), SamplingParams(max_tokens=5, **GREEDY))
    outs = {o.request_id: o for o in engine.step()}
    # the very next step computed c's whole prompt and sampled its first token, beside a and b's decodes
    assert set(outs) == {"a", "b", "c"}
    assert len(outs["c"].outputs[0].token_ids) == 1
    assert engine.requests["c"].seqs[0].num_computed_tokens == 12
    assert len(outs["a"].outputs[0].token_ids) == 4


def test_finished_request_frees_its_blocks_in_the_step_it_finishes(wordlevel_llama_dir):
    # 8 blocks of 8 tokens: request a (40 prompt + 20 output = 60 tokens -> 8 blocks) fills the cache
    engine = make_engine(wordlevel_llama_dir, num_gpu_blocks_override=16, max_num_seqs=4)
    engine.add_request("a", list(range(3, 43)), SamplingParams(max_tokens=20, **GREEDY))
    engine.add_request("b", list(range(100, 200)), SamplingParams(max_tokens=20, **GREEDY))  # 15 blocks: must wait
    finished_at = None
    step = 0
    while finished_at is None:
        outs = engine.step()
        step += 1
        assert "b" not in {o.request_id for o in outs}, "b cannot fit while a holds its blocks"
        if any(o.request_id == "a" and o.finished for o in outs):
            finished_at = step
            # freed the moment a finished: the whole pool is free again before the next step
            assert engine.scheduler.block_manager.num_free_blocks == 16
    outs = {o.request_id: o for o in engine.step()}
    assert "b" in outs and len(outs["b"].outputs[0].token_ids) == 1, "b must start in the very next step"
    engine.abort_request("b")
    assert engine.scheduler.block_manager.num_free_blocks == 16


def test_abort_frees_blocks_immediately(wordlevel_llama_dir):
    engine = make_engine(wordlevel_llama_dir)
    engine.add_request("x", list(range(3, 60)), SamplingParams(max_tokens=50, **GREEDY))
    engine.step()
    assert engine.scheduler.block_manager.num_free_blocks < engine.scheduler.block_manager.num_blocks
    engine.abort_request("x")
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks
    assert not engine.has_unfinished_requests()
    assert engine.step() == []

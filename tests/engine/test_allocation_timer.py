"""Block allocation timing: every BlockManager.allocate() call lands in the cumulative histogram the
engine's stats carry (pagedmodel:kv_block_allocation_seconds)."""
from __future__ import annotations

from pagedmodel.metrics_contract import ALLOCATION_BUCKETS
from pagedmodel.server.engine.allocation_timer import AllocationTimer
from pagedmodel.server.engine.block_manager import BlockManager
from pagedmodel.server.engine.sequence import Sequence


def test_buckets_are_cumulative_and_an_edge_value_lands_in_its_own_bucket():
    timer = AllocationTimer((0.1, 1.0))
    for seconds in (0.05, 0.1, 0.5, 2.0):
        timer.observe(seconds)
    assert timer.cumulative_buckets() == (2, 3, 4)   # <= 0.1, <= 1.0, +Inf
    assert timer.count == 4 and abs(timer.seconds_sum - 2.65) < 1e-9


def test_each_allocate_call_is_timed_success_or_not():
    bm = BlockManager(num_blocks=2, block_size=4)
    assert bm.allocation_timer.cumulative_buckets() == (0,) * (len(ALLOCATION_BUCKETS) + 1)
    assert bm.allocate(Sequence(list(range(8)), 8), 8)
    assert not bm.allocate(Sequence(list(range(8)), 8), 8)   # no blocks left: refused, still timed
    buckets = bm.allocation_timer.cumulative_buckets()
    assert len(buckets) == len(ALLOCATION_BUCKETS) + 1 and buckets[-1] == 2
    assert list(buckets) == sorted(buckets)
    assert bm.allocation_timer.seconds_sum > 0


def test_engine_stats_carry_the_histogram(wordlevel_llama_dir):
    from pagedmodel.server.engine.llm import LLM
    from pagedmodel.server.engine.sampling_params import SamplingParams

    llm = LLM(str(wordlevel_llama_dir), device="cpu", block_size=8, max_model_len=64)
    before = llm.engine.stats()
    assert before.block_allocation_buckets[-1] == 0 and before.block_allocation_seconds_sum == 0.0
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    after = llm.engine.stats()
    assert after.block_allocation_buckets[-1] >= 3   # one allocation per step at least
    assert after.block_allocation_seconds_sum > 0

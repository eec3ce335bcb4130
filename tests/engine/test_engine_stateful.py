"""A hypothesis state machine driving the real LLMEngine (input processing, scheduler, block manager,
sampler, beam search, output processing) through ``step()``, with the model runner replaced by one that
returns fixed logits. Requests are added (n > 1, best_of, beam search, shared prompt prefixes), aborted
at any point and stepped in any interleaving on a KV cache small enough to force preemption by swap
and by recompute. After every rule: the block manager's invariants hold, every computed token sits in
the slot its block table names (the fake runner replays swaps, copies and writes on a slot record, as
tests/engine/sim.py does), finished and aborted requests are gone from the engine, and once nothing is
left every block is free again."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from pagedmodel.server.engine.args import EngineArgs
from pagedmodel.server.engine.input_processor import InvalidRequestError
from pagedmodel.server.engine.llm_engine import LLMEngine
from pagedmodel.server.engine.step_types import ModelRunnerOutput
from pagedmodel.server.engine.sampling_params import SamplingParams
from pagedmodel.server.engine.step_types import SchedulerOutput

BS = 8
NUM_BLOCKS = 16
NUM_CPU_BLOCKS = 10   # about: swap space is given in GiB (4 KiB a block for the tiny llama at fp32)
ROWS = 8                                    # distinct fixed logit rows, chosen by the last token


class FixedLogitsRunner:
    """Stands in for ModelRunner: performs the step's block moves and writes on a per-slot record of token
    ids, and answers fixed logits (row = last token mod ROWS), so sampling is real but the model is not."""

    def __init__(self, vocab: int, eos: int, num_cpu_blocks: int):
        gen = torch.Generator().manual_seed(0)
        self.table = torch.randn(ROWS, vocab, generator=gen) * 4
        self.table[:, 3:40] += 8.0          # keep samples among a few ids: repeated prefixes, real stop checks
        self.table[0, eos] += 30.0          # one row ends sequences with EOS
        self.device: list[list[int | None]] = [[None] * BS for _ in range(NUM_BLOCKS)]
        self.cpu: list[list[int | None]] = [[None] * BS for _ in range(num_cpu_blocks)]

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for d, c in sched.blocks_to_swap_out:
            self.cpu[c] = list(self.device[d])
        for c, d in sched.blocks_to_swap_in:
            self.device[d] = list(self.cpu[c])
        for s, d in sched.blocks_to_copy:
            self.device[d] = list(self.device[s])
        for s in sched.scheduled:
            for p in range(s.start, s.start + s.num_new_tokens):
                self.device[s.block_ids[p // BS]][p % BS] = s.seq.token_ids[p]
        sampled = [s for s in sched.scheduled if s.samples]
        rows = torch.tensor([s.seq.token_ids[-1] % ROWS for s in sampled], dtype=torch.long)
        return ModelRunnerOutput(sampled, self.table[rows].clone() if sampled else self.table[:0].clone())


_ENGINES: dict[tuple[bool, str], tuple[LLMEngine, FixedLogitsRunner]] = {}


def engine_for(model_dir: Path, caching: bool, mode: str) -> tuple[LLMEngine, FixedLogitsRunner]:
    """One engine per configuration for the whole module (building one per example would dominate)."""
    key = (caching, mode)
    if key not in _ENGINES:
        engine = LLMEngine(EngineArgs(model=str(model_dir), device="cpu", block_size=BS, num_gpu_blocks_override=NUM_BLOCKS,
                                      swap_space=NUM_CPU_BLOCKS * 4096 / 2**30, max_num_seqs=4,
                                      max_num_batched_tokens=24, max_model_len=64, enable_prefix_caching=caching,
                                      preemption_mode=mode, enforce_eager=True))
        assert engine.scheduler.block_manager.num_blocks == NUM_BLOCKS and engine.worker.num_cpu_blocks > 0
        runner = FixedLogitsRunner(engine.vocab_size, min(engine.eos_token_ids), engine.worker.num_cpu_blocks)
        engine.runner = runner   # type: ignore[assignment]
        _ENGINES[key] = (engine, runner)
    return _ENGINES[key]


class EngineMachine(RuleBasedStateMachine):
    model_dir: Path

    @initialize(caching=st.booleans(), mode=st.sampled_from(["swap", "recompute"]))
    def setup(self, caching: bool, mode: str) -> None:
        self.engine, self.runner = engine_for(self.model_dir, caching, mode)
        assert not self.engine.has_unfinished_requests()
        self.bm = self.engine.scheduler.block_manager
        self.live: set[str] = set()
        self.next_id = 0
        self.finished = 0

    @rule(family=st.integers(0, 2), length=st.integers(1, 20), max_tokens=st.integers(1, 24),
          kind=st.sampled_from(["greedy", "sample", "n", "best_of", "beam"]), ignore_eos=st.booleans(),
          priority=st.integers(0, 2))
    def add(self, family: int, length: int, max_tokens: int, kind: str, ignore_eos: bool, priority: int) -> None:
        # Prompts of one family share their leading tokens: prefix-cache hits and copy-on-write forks.
        prompt = [100 + family * 50 + i for i in range(length)]
        kw: dict = {"max_tokens": max_tokens, "ignore_eos": ignore_eos, "seed": self.next_id}
        kw.update({"greedy": {"temperature": 0.0}, "sample": {"temperature": 1.0},
                   "n": {"temperature": 1.0, "n": 3}, "best_of": {"temperature": 1.0, "n": 1, "best_of": 3},
                   "beam": {"use_beam_search": True, "best_of": 2, "temperature": 0.0}}[kind])
        rid = f"r{self.next_id}"
        self.next_id += 1
        try:
            self.engine.add_request(rid, prompt, SamplingParams(**kw), priority=priority)
        except InvalidRequestError:   # can never fit this cache: refused, holding nothing
            assert rid not in self.engine.requests
            return
        self.live.add(rid)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.engine.abort_request(rid)
        self.live.discard(rid)
        assert rid not in self.engine.requests

    @rule(times=st.integers(1, 4))
    def step(self, times: int) -> None:
        for _ in range(times):
            for out in self.engine.step():
                if out.finished:
                    self.live.discard(out.request_id)
                    self.finished += 1
                    assert out.request_id not in self.engine.requests

    @invariant()
    def pool_is_consistent(self) -> None:
        if not hasattr(self, "bm"):
            return
        self.bm.check_invariants()
        assert set(self.engine.requests) == self.live
        for rid in self.live:
            for seq in self.engine.requests[rid].unfinished_seqs():
                if self.bm.has_table(seq):
                    table = self.bm.block_ids(seq)
                    for p in range(seq.num_computed_tokens):
                        assert self.runner.device[table[p // BS]][p % BS] == seq.token_ids[p], \
                            f"{rid} seq {seq.index}: slot of token {p} holds the wrong token"
                elif seq.seq_id in self.bm.cpu_tables:
                    table = [b.block_id for b in self.bm.cpu_tables[seq.seq_id]]
                    for p in range(seq.num_computed_tokens):
                        assert self.runner.cpu[table[p // BS]][p % BS] == seq.token_ids[p]
        for block in self.bm.pool.cached_blocks().values():
            assert tuple(self.runner.device[block.block_id]) == block.token_ids

    def teardown(self) -> None:
        if not hasattr(self, "engine"):
            return
        for rid in list(self.live):
            self.engine.abort_request(rid)
        self.engine.step()
        assert not self.engine.has_unfinished_requests()
        assert self.bm.num_free_blocks == NUM_BLOCKS, "blocks leaked once every request ended"
        self.bm.check_invariants()


def test_engine_steps_keep_the_pool_consistent(tiny_llama_dir: Path) -> None:
    EngineMachine.model_dir = tiny_llama_dir
    run_state_machine_as_test(EngineMachine, settings=settings(
        max_examples=30, stateful_step_count=40, deadline=None, database=None, derandomize=True,
        suppress_health_check=list(HealthCheck)))


def test_the_machine_reaches_preemption_swap_and_forks(tiny_llama_dir: Path) -> None:
    """The interleavings above only mean something if they reach the hard paths: one fixed run must."""
    engine, _ = engine_for(tiny_llama_dir, True, "swap")
    before = engine.stats()
    for i in range(6):
        engine.add_request(f"load{i}", [100 + i] * 10, SamplingParams(temperature=1.0, n=3, max_tokens=20,
                                                                      ignore_eos=True, seed=i))
    while engine.has_unfinished_requests():
        engine.step()
    after = engine.stats()
    assert after.num_preemptions_total > before.num_preemptions_total
    assert after.num_swap_outs_total > before.num_swap_outs_total
    assert engine.scheduler.block_manager.num_free_blocks == NUM_BLOCKS


@pytest.fixture(autouse=True, scope="module")
def _drop_engines():
    yield
    _ENGINES.clear()

"""Drives the engine's real Scheduler, Sampler and update_from_output without a model. The stand-in for
the model runner replays what the KV cache would hold: it performs the scheduled swaps and copies on a
per-slot record of token ids and writes the scheduled tokens into the slots their block ids (from the
scheduler's output) name; the sampler then draws from random logits, so bookkeeping can be checked
against content."""
from __future__ import annotations

import random

import torch

from pagedmodel.server.engine.step_types import ModelRunnerOutput
from pagedmodel.server.engine.outputs import RequestMetrics
from pagedmodel.server.engine.sampler import Sampler
from pagedmodel.server.engine.sampling_params import SamplingParams
from pagedmodel.server.engine.scheduler import Scheduler
from pagedmodel.server.engine.step_types import SchedulerOutput
from pagedmodel.server.engine.sequence import SequenceGroup
from pagedmodel.server.engine.stop_checker import StopChecker

VOCAB = 1000


class WordTokenizer:
    """Token ``i`` is the word ``ti``: enough for the stop checker's incremental detokenization."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f" t{i}" for i in ids)


class Sim:
    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, budget: int,
                 prefix_caching: bool = False, seed: int = 0, num_cpu_blocks: int = 0,
                 preemption_mode: str | None = None):
        self.sched = Scheduler(num_blocks, block_size, max_num_seqs, budget,
                               StopChecker(WordTokenizer(), set(), max_model_len=1 << 30),
                               enable_prefix_caching=prefix_caching, num_cpu_blocks=num_cpu_blocks,
                               preemption_mode=preemption_mode)
        self.bm = self.sched.block_manager
        self.sampler = Sampler(torch.device("cpu"), set())
        self.rng = random.Random(seed)
        self.logits_gen = torch.Generator().manual_seed(seed)
        self.groups: dict[str, SequenceGroup] = {}
        self.steps = 0
        self.block_size = block_size
        self.device = [[None] * block_size for _ in range(num_blocks)]   # token id held by each slot
        self.cpu = [[None] * block_size for _ in range(num_cpu_blocks)]
        self.preempted = self.swapped_out = self.swapped_in = self.forks = 0

    def add(self, rid: str, prompt: list[int], max_tokens: int, n: int = 1) -> SequenceGroup:
        params = SamplingParams(max_tokens=max_tokens, n=n, temperature=1.0 if n > 1 else 0.0, ignore_eos=True)
        g = SequenceGroup(rid, None, prompt, params, RequestMetrics(0.0), seed=self.rng.getrandbits(32))
        self.groups[rid] = g
        self.sched.add(g)
        return g

    def abort(self, rid: str) -> None:
        g = self.groups.pop(rid, None)
        if g is not None:
            self.sched.abort(g)   # its sampling state goes with it

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule(now=float(self.steps))
        self.steps += 1
        self.preempted += len(out.preempted)
        self.swapped_out += len(out.swapped_out)
        self.swapped_in += len(out.swapped_in)
        if out.is_empty:
            return out
        sampled = self._run_model(out)
        sizes = {g.request_id: len(g.seqs) for g in self.groups.values()}
        update = self.sched.update_from_output(out, self.sampler.sample(sampled))
        for g in update.touched.values():
            self.forks += len(g.seqs) - sizes[g.request_id]
            if g.is_finished:
                self.groups.pop(g.request_id, None)
        return out

    def _run_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """What the model runner does to the cache, on the slot record; random logits for the samplers."""
        for d, c in out.blocks_to_swap_out:
            self.cpu[c] = list(self.device[d])
        for c, d in out.blocks_to_swap_in:
            self.device[d] = list(self.cpu[c])
        for s, d in out.blocks_to_copy:
            self.device[d] = list(self.device[s])
        bs = self.block_size
        for s in out.scheduled:
            for p in range(s.start, s.start + s.num_new_tokens):
                self.device[s.block_ids[p // bs]][p % bs] = s.seq.token_ids[p]
        sampled = [s for s in out.scheduled if s.samples]
        return ModelRunnerOutput(sampled, torch.randn(len(sampled), VOCAB, generator=self.logits_gen))

    def check(self) -> None:
        """Bookkeeping invariants, plus: every computed token sits in the slot its block table names, and
        every prefix-cache entry holds exactly the tokens it is filed under."""
        self.bm.check_invariants()
        bs = self.block_size
        for g in self.groups.values():
            for seq in g.unfinished_seqs():
                if self.bm.has_table(seq):
                    table = self.bm.block_ids(seq)
                    assert len(table) * bs >= seq.num_computed_tokens
                    for p in range(seq.num_computed_tokens):
                        assert self.device[table[p // bs]][p % bs] == seq.token_ids[p], \
                            f"{g.request_id} seq {seq.index}: slot of token {p} holds the wrong token"
                elif seq.seq_id in self.bm.cpu_tables:
                    table = [b.block_id for b in self.bm.cpu_tables[seq.seq_id]]
                    for p in range(seq.num_computed_tokens):
                        assert self.cpu[table[p // bs]][p % bs] == seq.token_ids[p]
        for block in self.bm.pool.cached_blocks().values():
            assert tuple(self.device[block.block_id]) == block.token_ids, f"{block!r} content differs from its hash"

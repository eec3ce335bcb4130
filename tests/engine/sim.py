"""Drives Scheduler + BlockManager without a model. A stand-in step replays what the KV cache would hold:
it performs the scheduled swaps and copies on a per-slot record of token ids, 'computes' the scheduled
tokens into their slots and appends a random token, so bookkeeping can be checked against content."""
from __future__ import annotations

import random

from pagedmodel.server.engine.block_manager import BlockManager
from pagedmodel.server.engine.outputs import RequestMetrics
from pagedmodel.server.engine.sampling_params import SamplingParams
from pagedmodel.server.engine.scheduler import Scheduler, SchedulerOutput
from pagedmodel.server.engine.sequence import SequenceGroup, SequenceStatus


class Sim:
    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, budget: int,
                 prefix_caching: bool = False, seed: int = 0, num_cpu_blocks: int = 0,
                 preemption_mode: str | None = None):
        self.bm = BlockManager(num_blocks, block_size, prefix_caching, num_cpu_blocks=num_cpu_blocks)
        self.sched = Scheduler(self.bm, max_num_seqs, budget, preemption_mode)
        self.rng = random.Random(seed)
        self.groups: dict[str, SequenceGroup] = {}
        self.max_tokens: dict[str, int] = {}
        self.steps = 0
        self.block_size = block_size
        self.device = [[None] * block_size for _ in range(num_blocks)]   # token id held by each slot
        self.cpu = [[None] * block_size for _ in range(num_cpu_blocks)]
        self.preempted = self.swapped_out = self.swapped_in = self.forks = 0

    def add(self, rid: str, prompt: list[int], max_tokens: int, n: int = 1) -> SequenceGroup:
        params = SamplingParams(max_tokens=max_tokens, n=n, temperature=1.0 if n > 1 else 0.0)
        g = SequenceGroup(rid, None, prompt, params, RequestMetrics(0.0))
        self.groups[rid] = g
        self.max_tokens[rid] = max_tokens
        self.sched.add(g)
        return g

    def abort(self, rid: str) -> None:
        g = self.groups.pop(rid, None)
        if g is not None:
            self.sched.abort(g)

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self.steps += 1
        self.preempted += len(out.preempted)
        self.swapped_out += len(out.swapped_out)
        self.swapped_in += len(out.swapped_in)
        for d, c in out.blocks_to_swap_out:
            self.cpu[c] = list(self.device[d])
        for c, d in out.blocks_to_swap_in:
            self.device[d] = list(self.cpu[c])
        for s, d in out.blocks_to_copy:
            self.device[d] = list(self.device[s])
        for group in out.admitted:
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = float(self.steps)
        bs = self.block_size
        for s in out.scheduled:
            table = self.bm.block_ids(s.seq)
            for p in range(s.start, s.start + s.num_new_tokens):
                self.device[table[p // bs]][p % bs] = s.seq.token_ids[p]
        for s in out.scheduled:
            samples = s.samples
            s.seq.num_computed_tokens += s.num_new_tokens
            self.bm.commit(s.seq)
            if samples:
                family = [s.seq]
                g = s.group
                if s.seq.num_output_tokens == 0 and len(g.seqs) < g.params.best_of:
                    for index in range(len(g.seqs), g.params.best_of):
                        child = s.seq.fork(index)
                        self.bm.fork(s.seq, child)
                        g.seqs.append(child)
                        family.append(child)
                        self.forks += 1
                for seq in family:
                    seq.append_token(self.rng.randrange(1000), 0.0, None)
                    if seq.num_output_tokens >= self.max_tokens[g.request_id]:
                        seq.status = SequenceStatus.FINISHED_LENGTH
        for g in self.sched.free_finished():
            self.groups.pop(g.request_id, None)
        return out

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

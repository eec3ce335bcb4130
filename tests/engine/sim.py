"""Drives Scheduler + BlockManager without a model: a stand-in step that 'computes' what was scheduled
and appends a random token, so scheduling and block accounting can be tested fast and exhaustively."""
from __future__ import annotations

import random

from pagedmodel.server.block_manager import BlockManager
from pagedmodel.server.outputs import RequestMetrics
from pagedmodel.server.sampling_params import SamplingParams
from pagedmodel.server.scheduler import Scheduler, SchedulerOutput
from pagedmodel.server.sequence import SequenceGroup, SequenceStatus


class Sim:
    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, budget: int,
                 prefix_caching: bool = False, seed: int = 0):
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        self.sched = Scheduler(self.bm, max_num_seqs, budget)
        self.rng = random.Random(seed)
        self.groups: dict[str, SequenceGroup] = {}
        self.max_tokens: dict[str, int] = {}
        self.steps = 0

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
        for group in out.admitted:
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = float(self.steps)
        for s in out.scheduled:
            samples = s.samples
            s.seq.num_computed_tokens += s.num_new_tokens
            self.bm.commit(s.seq)
            if samples:
                s.seq.append_token(self.rng.randrange(1000), 0.0, None)
                if s.seq.num_output_tokens >= self.max_tokens[s.group.request_id]:
                    s.seq.status = SequenceStatus.FINISHED_LENGTH
        for g in self.sched.free_finished():
            self.groups.pop(g.request_id, None)
        return out

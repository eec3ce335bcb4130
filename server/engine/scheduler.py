"""Iteration-level (continuous) batching under a token budget, with chunked prefill and preemption.

Pure Python: it decides, each step, which sequences run and how many of their tokens are computed;
it never touches tensors. Order of business every step:

1. Running requests first, in queue order (priority, then arrival). Each sequence gets its remaining
   tokens (1 for a decode, the rest of a chunked prompt) up to the step's token budget. When its next
   block cannot be had, the least urgent request not yet scheduled this step is preempted (recompute:
   blocks freed, back to the front of the waiting queue); if none is left, the request itself is.
2. If nothing was preempted, waiting requests are admitted in order while the token budget, the
   sequence limit and free blocks allow (prefix-cache hits reduce the tokens to compute); a long
   prompt is admitted with a partial chunk. FCFS: a request that does not fit blocks those behind it.

Progress is guaranteed: the most urgent request may preempt every other one, and admission rejects
(engine side) any request whose sequences could not fit the whole cache on their own.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence, SequenceGroup, SequenceStatus


@dataclass
class ScheduledSequence:
    group: SequenceGroup
    seq: Sequence
    num_new_tokens: int

    @property
    def start(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def samples(self) -> bool:
        """True when this step computes the sequence's last known token, so its logits give the next one."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu), done first
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)   # (cpu, device), done second
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)      # copy-on-write, done third
    preempted: list[SequenceGroup] = field(default_factory=list)
    swapped_out: list[SequenceGroup] = field(default_factory=list)
    swapped_in: list[SequenceGroup] = field(default_factory=list)
    admitted: list[SequenceGroup] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 preemption_mode: str | None = None):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.waiting: list[SequenceGroup] = []   # sorted by sort_key
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []   # sorted by sort_key; served before new admissions
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.num_swap_ins = 0

    # ---- queues --------------------------------------------------------------------------------
    def add(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, group, key=lambda g: g.sort_key)

    def abort(self, group: SequenceGroup) -> None:
        """Drop a request wherever it is and free its blocks now."""
        for queue in (self.waiting, self.running, self.swapped):
            if group in queue:
                queue.remove(group)
        for seq in group.seqs:
            self.bm.free(seq)
            if not seq.is_finished:
                seq.status = SequenceStatus.FINISHED_ABORTED

    def free_finished(self) -> list[SequenceGroup]:
        """Release finished sequences' blocks at once; returns the requests that finished entirely."""
        done = []
        for group in list(self.running):
            for seq in group.seqs:
                if seq.is_finished and self.bm.has_table(seq):
                    self.bm.free(seq)
            if group.is_finished:
                self.running.remove(group)
                done.append(group)
        return done

    @property
    def num_running_seqs(self) -> int:
        return sum(len(g.unfinished_seqs()) for g in self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # ---- the step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # decodes first, then running prompts' next chunks: a long prompt must not stall token streams
        by_urgency = sorted(self.running, key=lambda g: g.sort_key)
        queue = [g for g in by_urgency if _decoding(g)] + [g for g in by_urgency if not _decoding(g)]
        kept: list[SequenceGroup] = []
        while queue:
            group = queue.pop(0)
            picked: list[ScheduledSequence] = []
            preempted_self = False
            for seq in group.unfinished_seqs():
                num_new = min(seq.num_uncomputed_tokens, budget)
                if num_new <= 0:
                    continue
                while not self.bm.allocate(seq, seq.num_computed_tokens + num_new):
                    victim = max(queue, key=lambda g: g.sort_key) if queue else group
                    if victim is not group:
                        queue.remove(victim)
                    self._preempt(victim, out)
                    if victim is group:
                        preempted_self = True
                        break
                if preempted_self:
                    break
                picked.append(ScheduledSequence(group, seq, num_new))
                budget -= num_new
            if preempted_self:
                budget += sum(p.num_new_tokens for p in picked)
                continue
            kept.append(group)
            out.scheduled.extend(picked)
        self.running = kept
        if not out.preempted:
            budget = self._swap_in(out, budget)
            if not self.swapped:
                self._admit(out, budget)
        out.blocks_to_copy = self.bm.take_pending_copies()
        return out

    def _swap_in(self, out: SchedulerOutput, budget: int) -> int:
        num_seqs = self.num_running_seqs
        while self.swapped and budget > 0:
            group = self.swapped[0]
            seqs = group.unfinished_seqs()
            if num_seqs + len(seqs) > self.max_num_seqs or len(seqs) > budget:
                break
            if not self.bm.can_swap_in(seqs, watermark=bool(self.running)):
                break
            self.swapped.pop(0)
            out.blocks_to_swap_in.extend(self.bm.swap_in(seqs))
            self.num_swap_ins += 1
            out.swapped_in.append(group)
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
                num_new = min(seq.num_uncomputed_tokens, budget)
                if not self.bm.allocate(seq, seq.num_computed_tokens + num_new):
                    raise AssertionError("can_swap_in reserved a block per sequence")
                out.scheduled.append(ScheduledSequence(group, seq, num_new))
                budget -= num_new
            self.running.append(group)
            num_seqs += len(seqs)
        return budget

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        num_seqs = self.num_running_seqs
        while self.waiting and budget > 0:
            group = self.waiting[0]
            seqs = group.unfinished_seqs()
            if num_seqs + len(seqs) > self.max_num_seqs:
                break
            picked: list[ScheduledSequence] = []
            hits: list[int] = []
            fits = True
            for seq in seqs:
                cached = ([] if seq.num_computed_tokens or group.params.prompt_logprobs is not None  # cached
                          else self.bm.match_prefix(seq, group.cache_salt))                 # tokens have no logits
                num_cached = len(cached) * self.bm.block_size
                num_new = min(seq.num_tokens - max(num_cached, seq.num_computed_tokens), budget)
                if num_new <= 0:
                    # budget spent on this request's earlier samples: the rest join now and are computed
                    # in later steps (demanding them all in one step could never fit a small budget)
                    continue
                # keep a little headroom for running decodes, unless nothing runs (it could never fill)
                watermark = bool(self.running) or bool(out.admitted)
                if not self.bm.allocate(seq, max(num_cached, seq.num_computed_tokens) + num_new, cached, watermark):
                    fits = False
                    break
                if cached:
                    seq.num_computed_tokens = num_cached
                hits.append(num_cached)
                picked.append(ScheduledSequence(group, seq, num_new))
                budget -= num_new
            if not fits:
                for p in picked:  # all or nothing: undo this request's partial allocation
                    self.bm.free(p.seq)
                    p.seq.num_computed_tokens = 0
                    budget += p.num_new_tokens
                break
            self.waiting.pop(0)
            for seq, num_cached in zip(seqs, hits):
                seq.status = SequenceStatus.RUNNING
                if group.metrics.first_scheduled_time is None:  # first admission only, not re-admissions
                    self.bm.record_prefix_query(seq.num_tokens, num_cached)
                    group.num_cached_tokens = max(group.num_cached_tokens, num_cached)
            self.running.append(group)
            out.admitted.append(group)
            out.scheduled.extend(picked)
            num_seqs += len(seqs)

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        self.num_preemptions += 1
        group.metrics.num_preemptions += 1
        out.preempted.append(group)
        seqs = group.unfinished_seqs()
        # vLLM's default: swap groups of several sequences (their shared blocks would cost a lot to
        # recompute), recompute single ones; recompute whenever swap space is short
        mode = self.preemption_mode or ("swap" if len(seqs) > 1 else "recompute")
        if mode == "swap" and all(self.bm.has_table(s) for s in seqs) and self.bm.can_swap_out(seqs):
            out.blocks_to_swap_out.extend(self.bm.swap_out(seqs))
            self.num_swap_outs += 1
            for seq in seqs:
                seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, group, key=lambda g: g.sort_key)
            out.swapped_out.append(group)
            return
        # recompute: drop the KV, keep the tokens; the prompt + output so far are prefilled again later
        for seq in group.unfinished_seqs():
            self.bm.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, group, key=lambda g: g.sort_key)


def _decoding(group: SequenceGroup) -> bool:
    return all(s.num_uncomputed_tokens <= 1 for s in group.unfinished_seqs())

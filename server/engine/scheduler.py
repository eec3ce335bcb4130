"""Iteration-level (continuous) batching under a token budget, with chunked prefill and preemption,
and the one place a step's results change the requests (``update_from_output``).

Pure Python: it decides, each step, which sequences run, how many of their tokens are computed and
which KV blocks they use; it never touches tensors. It alone owns the BlockManager: the model runner
gets each sequence's block ids, copies and swaps in the SchedulerOutput. Order of business every step:

1. Running requests first, in queue order (priority, then arrival), decodes before prompt chunks. Each
   sequence gets its remaining tokens (1 for a decode, the rest of a chunked prompt) up to the step's
   token budget. When its next block cannot be had, the least urgent request not yet scheduled this
   step is preempted; if none is left, the request itself is. Preemption either swaps (the request's
   blocks move to CPU swap space, ``blocks_to_swap_out``; it waits in the swapped queue) or recomputes
   (blocks freed, tokens kept; it goes back to the front of the waiting queue and is prefilled again).
   ``--preemption-mode`` picks one; by default groups of several sequences swap (their shared blocks
   would cost a lot to recompute) and single ones recompute; swap falls back to recompute when swap
   space is short.
2. If nothing was preempted, swapped requests come back first (``blocks_to_swap_in``, in queue order,
   when their blocks plus one free block per sequence fit), then, once none is left swapped, waiting
   requests are admitted in order while the token budget, the sequence limit and free blocks allow
   (prefix-cache hits reduce the tokens to compute); a long prompt is admitted with a partial chunk.
   FCFS: a request that does not fit blocks those behind it.

After the model ran, ``update_from_output`` takes the sampler's results keyed by sequence: it marks the
step's tokens computed (committing full blocks to the prefix cache), records prompt logprobs, forks
samples (n > 1) and beams copy-on-write, appends tokens, checks stops and frees finished sequences.

Progress is guaranteed: the most urgent request may preempt every other one, and admission rejects
(input_processor.py) any request whose sequences could not fit the whole cache on their own.
"""
from __future__ import annotations

import bisect
import time

from .block_manager import BlockManager
from .lora.slots import LoRASlots
from .sequence import Sequence, SequenceGroup, SequenceStatus
from .stats import EngineStats
from .step_types import BeamDecision, SampleResult, SamplerOutput, ScheduledSequence, SchedulerOutput, StepUpdate
from .stop_checker import StopChecker


class Scheduler:
    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 stop_checker: StopChecker, *, enable_prefix_caching: bool = False, num_cpu_blocks: int = 0,
                 preemption_mode: str | None = None, num_lora_slots: int = 0):
        """``num_lora_slots``: ``--max-loras`` (0: LoRA off); requests whose adapter cannot get a slot wait."""
        self.lora_slots = LoRASlots(num_lora_slots) if num_lora_slots else None
        self._lora_holders: set[str] = set()     # requests holding a reference on their adapter's slot
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching,
                                          num_cpu_blocks=num_cpu_blocks)
        self.stop_checker = stop_checker
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.waiting: list[SequenceGroup] = []   # sorted by sort_key
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []   # sorted by sort_key; served before new admissions
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

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
        self._release_lora(group)
        for seq in group.seqs:
            self.block_manager.free(seq)
            if not seq.is_finished:
                seq.status = SequenceStatus.FINISHED_ABORTED

    def _free_finished(self) -> list[SequenceGroup]:
        """Release finished sequences' blocks at once; returns the requests that finished entirely."""
        done = []
        for group in list(self.running):
            for seq in group.seqs:
                if seq.is_finished and self.block_manager.has_table(seq):
                    self.block_manager.free(seq)
            if group.is_finished:
                self.running.remove(group)
                self._release_lora(group)
                done.append(group)
        return done

    @property
    def num_running_seqs(self) -> int:
        return sum(len(g.unfinished_seqs()) for g in self.running)

    # ---- the step ------------------------------------------------------------------------------
    def schedule(self, now: float | None = None) -> SchedulerOutput:
        """This step's sequences, each with its new-token count and block table, and the block moves."""
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
                while not self.block_manager.allocate(seq, seq.num_computed_tokens + num_new):
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
        out.blocks_to_copy = self.block_manager.take_pending_copies()
        for s in out.scheduled:
            s.block_ids = self.block_manager.block_ids(s.seq)
            if s.group.lora is not None:
                s.lora_slot = self.lora_slots.slot_of(s.group.lora.int_id)
        now = time.time() if now is None else now
        for group in out.admitted:
            if group.metrics.first_scheduled_time is None:   # first admission only, not re-admissions
                group.metrics.first_scheduled_time = now
                self.prompt_tokens_total += len(group.prompt_token_ids)
        return out

    def _swap_in(self, out: SchedulerOutput, budget: int) -> int:
        num_seqs = self.num_running_seqs
        while self.swapped and budget > 0:
            group = self.swapped[0]
            seqs = group.unfinished_seqs()
            if num_seqs + len(seqs) > self.max_num_seqs or len(seqs) > budget:
                break
            if not self.block_manager.can_swap_in(seqs, watermark=bool(self.running)):
                break
            self.swapped.pop(0)
            out.blocks_to_swap_in.extend(self.block_manager.swap_in(seqs))
            self.num_swap_ins += 1
            out.swapped_in.append(group)
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
                num_new = min(seq.num_uncomputed_tokens, budget)
                if not self.block_manager.allocate(seq, seq.num_computed_tokens + num_new):
                    raise AssertionError("can_swap_in reserved a block per sequence")
                out.scheduled.append(ScheduledSequence(group, seq, num_new))
                budget -= num_new
            self.running.append(group)
            num_seqs += len(seqs)
        return budget

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        num_seqs = self.num_running_seqs
        i = 0
        while i < len(self.waiting) and budget > 0:
            group = self.waiting[i]
            if group.lora is not None and not self.lora_slots.can_acquire(group.lora.int_id):
                i += 1          # its adapter has no slot yet: requests behind it may use resident ones
                continue
            seqs = group.unfinished_seqs()
            if num_seqs + len(seqs) > self.max_num_seqs:
                break
            picked: list[ScheduledSequence] = []
            hits: list[int] = []
            fits = True
            for seq in seqs:
                cached = ([] if seq.num_computed_tokens or group.params.prompt_logprobs is not None  # cached
                          else bm.match_prefix(seq, group.cache_salt))                 # tokens have no logits
                num_cached = len(cached) * bm.block_size
                num_new = min(seq.num_tokens - max(num_cached, seq.num_computed_tokens), budget)
                if num_new <= 0:
                    # budget spent on this request's earlier samples: the rest join now and are computed
                    # in later steps (demanding them all in one step could never fit a small budget)
                    continue
                # keep a little headroom for running decodes, unless nothing runs (it could never fill)
                watermark = bool(self.running) or bool(out.admitted)
                if not bm.allocate(seq, max(num_cached, seq.num_computed_tokens) + num_new, cached, watermark):
                    fits = False
                    break
                if cached:
                    seq.num_computed_tokens = num_cached
                hits.append(num_cached)
                picked.append(ScheduledSequence(group, seq, num_new))
                budget -= num_new
            if not fits:
                for p in picked:  # all or nothing: undo this request's partial allocation
                    bm.free(p.seq)
                    p.seq.num_computed_tokens = 0
                    budget += p.num_new_tokens
                break
            self.waiting.pop(i)
            self._acquire_lora(group, out)
            for seq, num_cached in zip(seqs, hits):
                seq.status = SequenceStatus.RUNNING
                if group.metrics.first_scheduled_time is None:  # first admission only, not re-admissions
                    bm.record_prefix_query(seq.num_tokens, num_cached)
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
        bm = self.block_manager
        if mode == "swap" and all(bm.has_table(s) for s in seqs) and bm.can_swap_out(seqs):
            out.blocks_to_swap_out.extend(bm.swap_out(seqs))
            self.num_swap_outs += 1
            for seq in seqs:
                seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, group, key=lambda g: g.sort_key)
            out.swapped_out.append(group)
            return
        # recompute: drop the KV, keep the tokens; the prompt + output so far are prefilled again later
        self._release_lora(group)
        for seq in group.unfinished_seqs():
            bm.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, group, key=lambda g: g.sort_key)


    def _acquire_lora(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        if group.lora is None:
            return
        got = self.lora_slots.acquire(group.lora.int_id)
        if got is None:
            raise AssertionError("can_acquire promised a LoRA slot")
        slot, needs_load = got
        if needs_load:
            out.lora_loads.append((slot, group.lora))
        self._lora_holders.add(group.request_id)

    def _release_lora(self, group: SequenceGroup) -> None:
        if group.request_id in self._lora_holders:
            self._lora_holders.discard(group.request_id)
            self.lora_slots.release(group.lora.int_id)

    # ---- after the model ran -------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, out: SamplerOutput) -> StepUpdate:
        """Apply one step's results (keyed by sequence) to the requests: the step's tokens become computed,
        prompt logprobs are recorded, samples and beams fork, tokens are appended, stops are checked and
        finished sequences give their blocks back."""
        update = StepUpdate()
        for s in sched.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            self.block_manager.commit(s.seq, s.group.cache_salt)
            if s.seq.seq_id in out.prompt_logprobs:
                _record_prompt_logprobs(s.group, *out.prompt_logprobs[s.seq.seq_id])
        for s in sched.scheduled:
            group = s.group
            decision = out.beams.get(group.request_id)
            if decision is not None and group.request_id not in update.touched:
                self.generation_tokens_total += self._apply_beams(group, decision)
                if decision.hypotheses is not None:
                    update.finished_beams[group.request_id] = decision
                update.touched[group.request_id] = group
            results = out.samples.get(s.seq.seq_id)
            if results:
                self._append_samples(group, s.seq, results, update)
        self._free_finished()
        return update

    def _append_samples(self, group: SequenceGroup, seq: Sequence, results: list[SampleResult],
                        update: StepUpdate) -> None:
        family = [seq]
        if len(results) > 1:   # the request's first token: its other samples fork off the shared prompt
            for index in range(len(group.seqs), group.params.best_of):
                child = seq.fork(index)
                self.block_manager.fork(seq, child)
                group.seqs.append(child)
                family.append(child)
        if len(family) != len(results):
            raise AssertionError(f"{len(results)} samples for {len(family)} sequences of {group.request_id}")
        for member, result in zip(family, results):
            member.append_token(result.token_id, result.logprob, result.top_logprobs)
            self.generation_tokens_total += 1
            self.stop_checker.after_token(group, member, result.token_id)
            update.new_token_counts[member.seq_id] = update.new_token_counts.get(member.seq_id, 0) + 1
        update.touched[group.request_id] = group

    def _apply_beams(self, group: SequenceGroup, decision: BeamDecision) -> int:
        """Carry out one beam step; returns the tokens generated (0 when the search ended)."""
        beams = group.unfinished_seqs()
        if decision.hypotheses is not None:
            for beam in beams:
                self.block_manager.free(beam)
                beam.status = SequenceStatus.FINISHED_STOPPED
            return 0
        chosen: list[tuple[Sequence, int, float]] = []
        used: set[int] = set()
        for parent, token, cum in decision.next_beams:   # fork before any parent takes its new token
            if parent.seq_id in used:
                seq = parent.fork(len(chosen))
                self.block_manager.fork(parent, seq)
            else:
                used.add(parent.seq_id)
                seq = parent
            chosen.append((seq, token, cum))
        for beam in beams:
            if beam.seq_id not in used:   # chosen by no candidate: its blocks go back now
                self.block_manager.free(beam)
                beam.status = SequenceStatus.FINISHED_ABORTED
        for index, (seq, token, cum) in enumerate(chosen):
            seq.token_ids.append(token)
            seq.cumulative_logprob = cum
            seq.index = index
        group.seqs = [seq for seq, _, _ in chosen]
        return len(chosen)

    # ---- observability -------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.running), num_waiting=len(self.waiting), num_swapped=len(self.swapped),
            kv_cache_usage=bm.usage(), cpu_cache_usage=bm.cpu_usage(),
            num_blocks_total=bm.num_blocks, num_blocks_free=bm.num_free_blocks, fragmentation=bm.fragmentation(),
            prompt_tokens_total=self.prompt_tokens_total, generation_tokens_total=self.generation_tokens_total,
            prefix_cache_queries_total=bm.prefix_queries, prefix_cache_hits_total=bm.prefix_hits,
            num_preemptions_total=self.num_preemptions, num_swap_outs_total=self.num_swap_outs,
            max_num_seqs=self.max_num_seqs, block_size=bm.block_size,
            block_allocation_buckets=bm.allocation_timer.cumulative_buckets(),
            block_allocation_seconds_sum=bm.allocation_timer.seconds_sum,
            running_lora_adapters=_lora_names(self.running + self.swapped),
            waiting_lora_adapters=_lora_names(self.waiting),
            max_lora=self.lora_slots.num_slots if self.lora_slots else 0)


def _record_prompt_logprobs(group: SequenceGroup, start: int, entries: list[dict[int, float]],
                            ranks: list[int]) -> None:
    """Entry j scores prompt token start + 1 + j; a recomputed prompt scores the same tokens again."""
    for j, (entry, rank) in enumerate(zip(entries, ranks)):
        if len(group.prompt_logprobs) == start + 1 + j:
            group.prompt_logprobs.append(entry)
            group.prompt_token_ranks.append(rank)


def _lora_names(groups: list[SequenceGroup]) -> tuple[str, ...]:
    return tuple(sorted({g.lora.name for g in groups if g.lora is not None}))


def _decoding(group: SequenceGroup) -> bool:
    return all(s.num_uncomputed_tokens <= 1 for s in group.unfinished_seqs())

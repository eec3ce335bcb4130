"""Carries out beam-search decisions on one request's sequences.

BeamSearch (beam_search.py) decides; this applies the decision: a parent chosen several times is forked
(children share its KV blocks, copy-on-write), a parent chosen by none is freed at once, and the survivors
take their new tokens. A step runs when every live beam has its next-token logits, whichever engine step
computed them (after a recompute preemption they may arrive in different steps).
"""
from __future__ import annotations

import torch

from .beam_search import BeamHypothesis, BeamSearch
from .block_manager import BlockManager
from .sequence import Sequence, SequenceGroup, SequenceStatus


class BeamGroup:
    def __init__(self, group: SequenceGroup, search: BeamSearch, block_manager: BlockManager):
        self.group = group
        self.search = search
        self.bm = block_manager
        self.pending: dict[int, torch.Tensor] = {}
        self.hypotheses: list[BeamHypothesis] | None = None

    def offer(self, seq: Sequence, logits: torch.Tensor) -> bool:
        """Record one beam's logits; True when all live beams have theirs."""
        self.pending[seq.seq_id] = logits
        return all(s.seq_id in self.pending for s in self.group.unfinished_seqs())

    def advance(self) -> int:
        """One beam step; returns how many tokens were generated (0 once the search is done)."""
        beams = self.group.unfinished_seqs()
        logprobs = torch.log_softmax(torch.stack([self.pending[s.seq_id] for s in beams]).float(), dim=-1)
        self.pending.clear()
        result = self.search.step([s.output_token_ids for s in beams], [s.cumulative_logprob for s in beams],
                                  logprobs.cpu())
        if result.done:
            self._finish(beams, self.search.finalize())
            return 0
        chosen: list[tuple[Sequence, int, float]] = []
        used: set[int] = set()
        for cand in result.next_beams:   # fork before any parent takes its new token
            parent = beams[cand.parent]
            if cand.parent in used:
                seq = parent.fork(len(chosen))
                self.bm.fork(parent, seq)
            else:
                used.add(cand.parent)
                seq = parent
            chosen.append((seq, cand.token_id, cand.cum_logprob))
        for i, beam in enumerate(beams):
            if i not in used:
                self.bm.free(beam)
                beam.status = SequenceStatus.FINISHED_ABORTED
        survivors = []
        for index, (seq, token, cum) in enumerate(chosen):
            seq.token_ids.append(token)
            seq.cumulative_logprob = cum
            seq.index = index
            survivors.append(seq)
        self.group.seqs = survivors
        return len(survivors)

    def cut_short(self) -> None:
        """End the search now (e.g. the context is full): live beams compete as they are."""
        beams = self.group.unfinished_seqs()
        hyps = self.search.finalize([s.output_token_ids for s in beams], [s.cumulative_logprob for s in beams])
        self._finish(beams, hyps)

    def _finish(self, beams: list[Sequence], hypotheses: list[BeamHypothesis]) -> None:
        for beam in beams:
            self.bm.free(beam)
            beam.status = SequenceStatus.FINISHED_STOPPED
        self.hypotheses = hypotheses

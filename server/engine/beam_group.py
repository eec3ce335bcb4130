"""Collects one beam-search request's logits and turns them into a decision for the scheduler to carry out.

BeamSearch (beam_search.py) decides from log-probabilities; this gathers them per live beam (a step runs
when every live beam has its next-token logits, whichever engine step computed them: after a recompute
preemption they may arrive in different steps) and names the decision in terms of sequences. The
scheduler's ``update_from_output`` applies it: a parent chosen several times is forked (children share
its KV blocks, copy-on-write), a parent chosen by none is freed, the survivors take their new tokens.
"""
from __future__ import annotations

import torch

from .beam_search import BeamSearch
from .sequence import Sequence, SequenceGroup
from .step_types import BeamDecision


class BeamGroup:
    def __init__(self, group: SequenceGroup, search: BeamSearch):
        self.group = group
        self.search = search
        self.pending: dict[int, torch.Tensor] = {}

    def offer(self, seq: Sequence, logits: torch.Tensor) -> bool:
        """Record one beam's logits; True when all live beams have theirs."""
        self.pending[seq.seq_id] = logits
        return all(s.seq_id in self.pending for s in self.group.unfinished_seqs())

    def decide(self) -> BeamDecision:
        """One beam step over the pending logits (call when ``offer`` returned True)."""
        beams = self.group.unfinished_seqs()
        logprobs = torch.log_softmax(torch.stack([self.pending[s.seq_id] for s in beams]).float(), dim=-1)
        self.pending.clear()
        result = self.search.step([s.output_token_ids for s in beams], [s.cumulative_logprob for s in beams],
                                  logprobs.cpu())
        if result.done:
            return BeamDecision([], self.search.finalize(), self.search.eos_token_ids)
        return BeamDecision([(beams[c.parent], c.token_id, c.cum_logprob) for c in result.next_beams])

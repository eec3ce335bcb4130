"""Turns a step's update into RequestOutputs: cumulative text and tokens per sample, finish state, timings.

The text itself grows in the stop checker (stop strings are matched on it); here it is only shaped:
streamed text holds back what may still turn out to be the start of a stop string, ``best_of > n``
requests report their best ``n`` once finished, and beam searches report their hypotheses at the end.
"""
from __future__ import annotations

from typing import Any

from .outputs import CompletionOutput, RequestOutput
from .step_types import BeamDecision, StepUpdate
from .sequence import SequenceGroup


class OutputProcessor:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def process(self, update: StepUpdate, now: float) -> list[RequestOutput]:
        """One output per request with news this step (none for a request whose result is only known at
        its end: ``best_of > n`` and beam search)."""
        outputs = []
        for group in update.touched.values():
            metrics = group.metrics
            metrics.first_token_time = metrics.first_token_time or now
            metrics.last_token_time = now
            if group.is_finished:
                metrics.finished_time = now
            if group.params.use_beam_search:
                decision = update.finished_beams.get(group.request_id)
                out = None if decision is None else self._beam_output(group, decision)
            else:
                out = self._sample_output(group, update.new_token_counts)
            if out is not None:
                outputs.append(out)
        return outputs

    def _sample_output(self, group: SequenceGroup, new_counts: dict[int, int]) -> RequestOutput | None:
        p = group.params
        finished = group.is_finished
        seqs = sorted(group.seqs, key=lambda s: s.index)
        if p.best_of > p.n:
            if not finished:
                return None  # the best n are only known at the end
            seqs = sorted(group.seqs, key=lambda s: s.cumulative_logprob, reverse=True)[:p.n]
        hold = max((len(s) for s in p.stop), default=1) - 1  # never stream what may turn out to be a stop string
        completions = []
        for i, seq in enumerate(seqs):
            text = seq.output_text
            if hold and not seq.is_finished:
                text = text[:max(0, len(text) - hold)]
            completions.append(CompletionOutput(
                index=i if p.best_of > p.n else seq.index, text=text, token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=list(seq.output_logprobs) if p.logprobs is not None else None,
                finish_reason=seq.status.finish_reason, stop_reason=seq.stop_reason))
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions, finished,
                             group.metrics, num_cached_tokens=group.num_cached_tokens,
                             prompt_logprobs=list(group.prompt_logprobs) if group.prompt_logprobs is not None else None,
                             prompt_token_ranks=list(group.prompt_token_ranks),
                             new_token_counts=[new_counts.get(s.seq_id, 0) for s in seqs])

    def _text(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        """The tokens as text; "" without a tokenizer (--skip-tokenizer-init), as in vLLM."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def _beam_output(self, group: SequenceGroup, decision: BeamDecision) -> RequestOutput:
        p = group.params
        completions = []
        for i, hyp in enumerate(decision.hypotheses[:p.n]):
            ended = bool(hyp.tokens) and hyp.tokens[-1] in decision.eos_token_ids
            completions.append(CompletionOutput(
                index=i, text=self._text(hyp.tokens, p.skip_special_tokens),
                token_ids=list(hyp.tokens), cumulative_logprob=hyp.cum_logprob,
                finish_reason="stop" if ended else "length"))
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions, True,
                             group.metrics, num_cached_tokens=group.num_cached_tokens,
                             new_token_counts=[len(c.token_ids) for c in completions])

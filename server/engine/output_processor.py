"""Turns a step's update into RequestOutputs shaped by each request's output kind, and into every touched
request's progress (what metrics count, whatever the kind).

The text itself grows in the stop checker (stop strings are matched on it); here it is only shaped:
streamed text holds back what may still turn out to be the start of a stop string, ``best_of > n``
requests report their best ``n`` once finished, and beam searches report their hypotheses at the end.
Output kinds (outputs.py): CUMULATIVE copies each sample's whole text, tokens and logprobs; DELTA hands out
only what lies beyond what its sequence was last given (``Sequence.sent_*``, written here alone);
FINAL_ONLY hands out one whole output at the end. Only CUMULATIVE copies a whole output every step.
"""
from __future__ import annotations

from typing import Any

from .outputs import CompletionOutput, RequestOutput, RequestOutputKind, RequestProgress
from .sequence import Sequence, SequenceGroup
from .step_types import BeamDecision, StepUpdate

DELTA, FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY


class OutputProcessor:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def process(self, update: StepUpdate, now: float) -> tuple[list[RequestOutput], list[RequestProgress]]:
        """The outputs due this step (none for a request whose result is only known at its end: FINAL_ONLY,
        ``best_of > n`` and beam search; none for a DELTA request with nothing new), and one progress record
        per request with news."""
        outputs, progress = [], []
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
                out = self._sample_output(group)
            if out is not None:
                outputs.append(out)
            progress.append(self._progress(group, update, out))
        return outputs, progress

    @staticmethod
    def _progress(group: SequenceGroup, update: StepUpdate, out: RequestOutput | None) -> RequestProgress:
        new_tokens = sum(update.new_token_counts.get(s.seq_id, 0) for s in group.seqs)
        if not group.is_finished:
            return RequestProgress(group.request_id, new_tokens, False, group.metrics, len(group.prompt_token_ids))
        if group.params.use_beam_search:   # the hypotheses are what the request reports
            lengths = tuple(len(o.token_ids) for o in out.outputs) if out is not None else ()
            reason = out.outputs[0].finish_reason if out is not None and out.outputs else None
        else:
            reported = OutputProcessor._reported_seqs(group)
            lengths = tuple(s.num_output_tokens for s in reported)
            reason = reported[0].status.finish_reason if reported else None
        return RequestProgress(group.request_id, new_tokens, True, group.metrics, len(group.prompt_token_ids),
                               lengths, reason)

    @staticmethod
    def _reported_seqs(group: SequenceGroup) -> list[Sequence]:
        """The samples a request reports: all n, in order; or, for best_of > n, the best n (once finished)."""
        p = group.params
        if p.best_of > p.n:
            return sorted(group.seqs, key=lambda s: s.cumulative_logprob, reverse=True)[:p.n]
        return sorted(group.seqs, key=lambda s: s.index)

    def _sample_output(self, group: SequenceGroup) -> RequestOutput | None:
        p = group.params
        finished = group.is_finished
        if not finished and (p.best_of > p.n or p.output_kind is FINAL_ONLY):
            return None  # the best n are only known at the end; FINAL_ONLY waits for it
        delta = p.output_kind is DELTA and p.best_of == p.n   # best_of > n: its one output is whole
        hold = max((len(s) for s in p.stop), default=1) - 1  # never stream what may turn out to be a stop string
        completions = []
        for i, seq in enumerate(self._reported_seqs(group)):
            text = seq.output_text
            if hold and not seq.is_finished:
                text = text[:max(0, len(text) - hold)]
            out = self._delta(seq, text, p.logprobs is not None) if delta else CompletionOutput(
                index=seq.index, text=text, token_ids=list(seq.output_token_ids),
                logprobs=list(seq.output_logprobs) if p.logprobs is not None else None)
            if out is None:
                continue
            out.index = i if p.best_of > p.n else seq.index
            out.cumulative_logprob = seq.cumulative_logprob
            out.finish_reason, out.stop_reason = seq.status.finish_reason, seq.stop_reason
            completions.append(out)
        if delta and not completions and not finished:
            return None
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions, finished,
                             group.metrics, num_cached_tokens=group.num_cached_tokens,
                             prompt_logprobs=self._prompt_logprobs(group, delta),
                             prompt_token_ranks=list(group.prompt_token_ranks))

    @staticmethod
    def _delta(seq: Sequence, text: str, with_logprobs: bool) -> CompletionOutput | None:
        """What ``seq`` has not been given yet (None: nothing, not even its end)."""
        tokens = seq.token_ids[seq.num_prompt_tokens + seq.sent_tokens:]
        new_text = text[seq.sent_text_len:]
        if not tokens and not new_text and (seq.sent_finish or not seq.is_finished):
            return None
        logprobs = seq.output_logprobs[seq.sent_tokens:] if with_logprobs else None
        # the engine holds back text that may become a stop string, so text only grows; max() guards anyway
        seq.sent_text_len = max(seq.sent_text_len, len(text))
        seq.sent_tokens += len(tokens)
        seq.sent_finish = seq.is_finished
        return CompletionOutput(index=seq.index, text=new_text, token_ids=tokens, logprobs=logprobs)

    @staticmethod
    def _prompt_logprobs(group: SequenceGroup, delta: bool) -> list[dict[int, float] | None] | None:
        if group.prompt_logprobs is None or (delta and group.prompt_logprobs_sent):
            return None
        group.prompt_logprobs_sent = True
        return list(group.prompt_logprobs)

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
                             group.metrics, num_cached_tokens=group.num_cached_tokens)

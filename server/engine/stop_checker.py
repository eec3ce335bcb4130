"""Whether a sequence is done after its newest token: EOS, stop token ids, stop strings, max_tokens, context.

Stop strings are matched on the detokenized text, so this is also where a sampled token becomes text
(incremental detokenization, detokenizer.py): the text must be up to date before it is searched.
"""
from __future__ import annotations

from typing import Any

from .detokenizer import detokenize_incrementally, flush_held_text
from .sequence import Sequence, SequenceGroup, SequenceStatus


class StopChecker:
    """``eos_token_ids`` is shared with the sampler (which bans EOS before ``min_tokens``): one set."""

    def __init__(self, tokenizer: Any, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer   # None (--skip-tokenizer-init): no text, and no stop strings to match
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def after_token(self, group: SequenceGroup, seq: Sequence, token: int) -> None:
        """Extend ``seq``'s text by its newest token and mark it finished if a stop condition holds; a finished
        sequence's text is the decode of its tokens (a stop string's cut aside)."""
        self._check(group, seq, token)
        # (a stop string cut the text itself)
        if self.tokenizer is not None and seq.is_finished and not isinstance(seq.stop_reason, str):
            flush_held_text(self.tokenizer, seq, group.params.skip_special_tokens)

    def _check(self, group: SequenceGroup, seq: Sequence, token: int) -> None:
        if self.tokenizer is not None:
            detokenize_incrementally(self.tokenizer, seq, group.params.skip_special_tokens)
        p = group.params
        # a grammar that let EOS through has ended: that stops even an ignore_eos request
        ends = not p.ignore_eos or p.structured_outputs is not None
        if ends and token in self.eos_token_ids and seq.num_output_tokens > p.min_tokens - 1:
            seq.status = SequenceStatus.FINISHED_STOPPED
            return
        if token in p.stop_token_ids:
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
            return
        if p.stop and seq.num_output_tokens >= p.min_tokens and self._stop_string(seq, p.stop,
                                                                                  p.include_stop_str_in_output):
            return
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            seq.status = SequenceStatus.FINISHED_LENGTH
        elif seq.num_tokens >= self.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH

    @staticmethod
    def _stop_string(seq: Sequence, stops: list[str], include: bool) -> bool:
        # only the tail can hold a new match: the text before it was searched at earlier tokens
        window = max(len(s) for s in stops) + 16
        tail_start = max(0, len(seq.output_text) - window)
        for stop in stops:
            at = seq.output_text.find(stop, tail_start)
            if at >= 0:
                end = at + len(stop) if include else at
                seq.output_text = seq.output_text[:end]
                seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
                return True
        return False

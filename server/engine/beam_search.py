"""Beam search decisions, one decode step at a time, with the semantics of HF transformers 5.x
``generate(num_beams=W, do_sample=False, length_penalty=L, early_stopping=E)``.

Pure logic: BeamGroup (beam_group.py) hands over each step's log-softmax rows (one per live beam), and
the scheduler's ``update_from_output`` realizes the returned decisions by forking / freeing sequences
that share KV blocks. Nothing here touches a model or a KV cache.

The semantics, per step (``g`` = number of generated tokens after this step, the new token included):

* Candidates: the top ``K = max(2, 1 + #eos) * W`` of ``cum_logprob[beam] + logprob[beam, token]`` over
  all live beams x vocabulary, in float32 (as HF accumulates). ``K`` leaves at least ``W`` non-EOS
  candidates even when every beam's best continuations are EOS.
* A candidate *finishes* when its token is an EOS id or ``g == max_new_tokens``. Only finished candidates
  ranked in the first ``W`` of the ``K`` become hypotheses; the rest of the ``K`` are spares that only
  exist so that ``W`` beams can continue.
* Hypothesis score: ``cum_logprob / g ** length_penalty`` (EOS counted in ``g``, prompt not). At most
  ``W`` hypotheses are kept, the best by score.
* The next live beams: the best ``W`` unfinished candidates.
* The request is done when: ``g == max_new_tokens`` (every top-``W`` candidate was finished above); or
  ``W`` hypotheses exist and ``early_stopping is True``; or ``W`` hypotheses exist and the best live
  beam's ``cum_logprob / h ** length_penalty`` is not above the worst hypothesis score, where ``h`` is
  ``max_new_tokens`` for ``early_stopping == "never"`` with ``length_penalty > 0`` and ``g`` otherwise.
* The result is the hypotheses ordered by score, best first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple, Sequence

import torch

EarlyStopping = bool | Literal["never"]


@dataclass(frozen=True)
class BeamCandidate:
    """One beam to continue: extend live beam ``parent`` (index into the beams passed in) by ``token_id``."""

    parent: int
    token_id: int
    cum_logprob: float


@dataclass(frozen=True)
class BeamStepResult:
    next_beams: list[BeamCandidate]   # exactly `width` beams, best first; empty when done
    done: bool                        # no more steps: call finalize()


class BeamHypothesis(NamedTuple):
    """A finished beam: generated tokens (EOS included when it ended on one), summed logprob, ranking score."""

    tokens: list[int]
    cum_logprob: float
    score: float


class BeamSearch:
    """The decisions of one beam-search request; call ``step`` once per decode step, then ``finalize``."""

    def __init__(self, width: int, length_penalty: float = 1.0, early_stopping: EarlyStopping = False,
                 eos_token_ids: Sequence[int] | set[int] = (), *, max_new_tokens: int):
        if not isinstance(width, int) or isinstance(width, bool) or width < 1:
            raise ValueError(f"beam width must be a positive integer, got {width!r}")
        if (not isinstance(length_penalty, (int, float)) or isinstance(length_penalty, bool)
                or not math.isfinite(length_penalty)):
            raise ValueError(f"length_penalty must be a finite number, got {length_penalty!r}")
        if early_stopping not in (True, False, "never") or not isinstance(early_stopping, (bool, str)):
            raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
        eos = set(eos_token_ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in eos):
            raise ValueError(f"eos_token_ids must be non-negative integers, got {sorted(eos, key=repr)!r}")
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        self.width = width
        self.length_penalty = float(length_penalty)
        self.early_stopping = early_stopping
        self.eos_token_ids = frozenset(eos)
        self.max_new_tokens = max_new_tokens
        # candidates kept per step: enough that W survive even if the W best of every beam are all EOS
        self.num_candidates = max(2, 1 + len(self.eos_token_ids)) * width
        self._hypotheses: list[BeamHypothesis] = []   # best first, at most `width`
        self._num_steps = 0
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    @property
    def num_steps(self) -> int:
        """Decode steps taken so far, i.e. the number of generated tokens of every live beam."""
        return self._num_steps

    @property
    def hypotheses(self) -> list[BeamHypothesis]:
        """Finished hypotheses so far, best first (at most ``width``)."""
        return list(self._hypotheses)

    def step(self, beam_tokens: Sequence[Sequence[int]], beam_cum_logprobs: Sequence[float],
             logprobs: torch.Tensor) -> BeamStepResult:
        """Choose the next beams from this step's ``logprobs`` ([num_beams, vocab], log-softmax).

        At the first step there is one beam (the prompt, no tokens yet); afterwards the ``width`` beams
        of the previous result, in its order, each with its generated tokens and ``cum_logprob``.
        """
        if self._done:
            raise RuntimeError("beam search is done; call finalize()")
        self._check_beams(beam_tokens, beam_cum_logprobs, expected=1 if self._num_steps == 0 else self.width)
        if not isinstance(logprobs, torch.Tensor) or logprobs.dim() != 2 or logprobs.shape[0] != len(beam_tokens):
            raise ValueError(f"logprobs must be a [{len(beam_tokens)}, vocab] tensor, "
                             f"got {getattr(logprobs, 'shape', type(logprobs).__name__)}")
        vocab = logprobs.shape[1]
        if vocab < self.num_candidates:
            raise ValueError(f"vocab size {vocab} is below the {self.num_candidates} candidates a step keeps "
                             f"(width {self.width}, {len(self.eos_token_ids)} EOS ids)")
        logprobs = logprobs.detach().to(torch.float32)
        if torch.isnan(logprobs).any():
            raise ValueError("logprobs contain NaN")

        # float32 accumulation, as HF does: the cum_logprobs handed back are float32 values, so exact
        cum = torch.tensor(list(beam_cum_logprobs), dtype=torch.float32, device=logprobs.device)
        top_scores, top_flat = torch.topk((logprobs + cum[:, None]).reshape(-1), self.num_candidates)
        scores = top_scores.tolist()
        flat = top_flat.tolist()

        generated = self._num_steps + 1
        at_limit = generated >= self.max_new_tokens
        next_beams: list[BeamCandidate] = []
        finished: list[tuple[list[int], float]] = []
        for rank, (idx, score) in enumerate(zip(flat, scores)):
            parent, token = divmod(idx, vocab)
            if at_limit or token in self.eos_token_ids:
                if rank < self.width:   # spares beyond the first W never become hypotheses
                    finished.append(([*beam_tokens[parent], token], score))
            elif len(next_beams) < self.width:
                next_beams.append(BeamCandidate(parent, token, score))
        self._num_steps = generated
        self._add_hypotheses(finished, generated)

        if not next_beams or self._should_stop(next_beams[0].cum_logprob, generated):
            self._done = True
            return BeamStepResult([], True)
        return BeamStepResult(next_beams, False)

    def finalize(self, beam_tokens: Sequence[Sequence[int]] | None = None,
                 beam_cum_logprobs: Sequence[float] | None = None) -> list[BeamHypothesis]:
        """All hypotheses, best first.

        After a step returned ``done``, call it without arguments. To end a request that is not done
        (e.g. a caller stopping it early), pass its live beams: they compete as hypotheses of their length.
        """
        if self._done:
            if beam_tokens is not None or beam_cum_logprobs is not None:
                raise ValueError("beam search is done: its live beams were already dropped or finalized")
        else:
            if beam_tokens is None or beam_cum_logprobs is None:
                raise RuntimeError("beam search is not done: pass the live beams to finalize them")
            if self._num_steps == 0:
                raise RuntimeError("beam search took no step yet: nothing to finalize")
            self._check_beams(beam_tokens, beam_cum_logprobs, expected=self.width)
            self._add_hypotheses([(list(t), float(c)) for t, c in zip(beam_tokens, beam_cum_logprobs)],
                                 self._num_steps)
            self._done = True
        return list(self._hypotheses)

    def _check_beams(self, beam_tokens: Sequence[Sequence[int]], beam_cum_logprobs: Sequence[float],
                     expected: int) -> None:
        if len(beam_tokens) != expected or len(beam_cum_logprobs) != expected:
            raise ValueError(f"step {self._num_steps} expects {expected} beams, got {len(beam_tokens)} token lists "
                             f"and {len(beam_cum_logprobs)} cum_logprobs")
        for i, tokens in enumerate(beam_tokens):
            if len(tokens) != self._num_steps:
                raise ValueError(f"beam {i} has {len(tokens)} generated tokens, expected {self._num_steps} "
                                 "(all beams advance in lockstep)")
        if any(math.isnan(c) for c in beam_cum_logprobs):
            raise ValueError("beam_cum_logprobs contain NaN")

    def _normalize(self, cum_logprobs: list[float], length: int) -> list[float]:
        # float32 tensor divided by a Python float: the same rounding as HF's scores, so ties break alike
        return (torch.tensor(cum_logprobs, dtype=torch.float32) / (length ** self.length_penalty)).tolist()

    def _add_hypotheses(self, finished: list[tuple[list[int], float]], length: int) -> None:
        if not finished:
            return
        normalized = self._normalize([c for _, c in finished], length)
        new = [BeamHypothesis(tokens, cum, score) for (tokens, cum), score in zip(finished, normalized)]
        # stable sort: on equal scores older hypotheses, then better-ranked candidates, win
        merged = sorted(self._hypotheses + new, key=lambda h: h.score, reverse=True)
        self._hypotheses = merged[: self.width]

    def _should_stop(self, best_live_cum_logprob: float, generated: int) -> bool:
        if len(self._hypotheses) < self.width:
            return False
        if self.early_stopping is True:
            return True
        # can the best live beam still beat the worst kept hypothesis? HF's optimistic estimate of its
        # final score: at its current length, or at the maximum length when a positive penalty rewards length
        length = self.max_new_tokens if self.early_stopping == "never" and self.length_penalty > 0 else generated
        best_possible = self._normalize([best_live_cum_logprob], length)[0]
        return not best_possible > self._hypotheses[-1].score

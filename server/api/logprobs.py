"""Logprobs in the OpenAI response shapes: the completions layout (parallel lists) and the chat layout
(one entry per token with its top alternatives)."""
from __future__ import annotations

import math

from .protocol import ChatChoiceLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from .serving import OpenAIServing


def finite(x: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number. -9999 is what "impossible" looks like in practice.
    return float(x) if math.isfinite(x) else -9999.0


def completion_logprobs(serving: OpenAIServing, token_ids: list[int], logprobs: list[dict[int, float]] | None,
                         top_n: int, text_offset0: int) -> CompletionLogprobs:
    out = CompletionLogprobs()
    offset = text_offset0
    for tok, lp in zip(token_ids, logprobs or [{} for _ in token_ids]):
        s = serving.token_str(tok)
        out.tokens.append(s)
        out.text_offset.append(offset)
        offset += len(s)
        out.token_logprobs.append(finite(lp[tok]) if tok in lp else None)
        top = sorted(lp.items(), key=lambda kv: -kv[1])[:top_n] if top_n > 0 else []
        out.top_logprobs.append({serving.token_str(t): finite(v) for t, v in top})
    return out


def prepend_prompt_logprobs(serving: OpenAIServing, prompt_ids: list[int],
                             prompt_logprobs: list[dict[int, float] | None] | None, top_n: int,
                             completion: CompletionLogprobs) -> CompletionLogprobs:
    """The echoed prompt's tokens with their logprobs (the first token has none), then the completion's."""
    entries = [e or {} for e in (prompt_logprobs or [None] * len(prompt_ids))]
    out = completion_logprobs(serving, prompt_ids, entries, top_n, 0)
    out.top_logprobs[0] = None
    out.tokens += completion.tokens
    out.text_offset += completion.text_offset
    out.token_logprobs += completion.token_logprobs
    out.top_logprobs += completion.top_logprobs
    return out


def chat_logprobs(serving: OpenAIServing, token_ids: list[int], logprobs: list[dict[int, float]] | None,
                   top_n: int) -> ChatChoiceLogprobs:
    content = []
    for tok, lp in zip(token_ids, logprobs or [{} for _ in token_ids]):
        s = serving.token_str(tok)
        top = sorted(lp.items(), key=lambda kv: -kv[1])[:top_n] if top_n > 0 else []
        content.append(ChatTokenLogprob(
            token=s, logprob=finite(lp.get(tok, -math.inf)), bytes=list(s.encode("utf-8", "replace")),
            top_logprobs=[TopLogprob(token=serving.token_str(t), logprob=finite(v),
                                     bytes=list(serving.token_str(t).encode("utf-8", "replace"))) for t, v in top]))
    return ChatChoiceLogprobs(content=content)

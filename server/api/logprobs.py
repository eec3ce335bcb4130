"""Logprobs in the OpenAI response shapes: the completions layout (parallel lists) and the chat layout
(one entry per token with its top alternatives)."""
from __future__ import annotations

import math

from pagedmodel.server.engine.outputs import RequestOutput

from .protocol import ChatChoiceLogprobs, ChatTokenLogprob, CompletionLogprobs, PromptLogprob, PromptLogprobs, TopLogprob
from .serving import OpenAIServing


def finite(x: float) -> float:
    # JSON has no -inf; OpenAI clients expect a number. -9999 is what "impossible" looks like in practice.
    return float(x) if math.isfinite(x) else -9999.0


def token_label(serving: OpenAIServing, token_id: int, as_ids: bool) -> str:
    """How logprobs name a token: its text, or vLLM's "token_id:N" (return_tokens_as_token_ids), which
    stays exact for a token that is part of a multi-byte character and so not valid UTF-8 on its own."""
    return f"token_id:{token_id}" if as_ids else serving.token_str(token_id)


def sampled_and_top(entry: dict[int, float], token: int, top_n: int) -> dict[int, float]:
    """A completions top_logprobs entry as vLLM builds it: the sampled token, then the top_n most likely
    (the sampled one once); so logprobs=0 gives the sampled token alone, not an empty dict."""
    out = {token: entry[token]} if token in entry else {}
    for t, v in sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]:
        out.setdefault(t, v)
    return out


def completion_logprobs(serving: OpenAIServing, token_ids: list[int], logprobs: list[dict[int, float]] | None,
                         top_n: int, text_offset0: int, as_ids: bool = False) -> CompletionLogprobs:
    out = CompletionLogprobs()
    offset = text_offset0
    for tok, lp in zip(token_ids, logprobs or [{} for _ in token_ids]):
        s = serving.token_str(tok)
        out.tokens.append(token_label(serving, tok, as_ids))
        out.text_offset.append(offset)
        offset += len(s)
        out.token_logprobs.append(finite(lp[tok]) if tok in lp else None)
        out.top_logprobs.append({token_label(serving, t, as_ids): finite(v) for t, v in sampled_and_top(lp, tok, top_n).items()})
    return out


def prepend_prompt_logprobs(serving: OpenAIServing, prompt_ids: list[int],
                             prompt_logprobs: list[dict[int, float] | None] | None, top_n: int,
                             completion: CompletionLogprobs, as_ids: bool = False) -> CompletionLogprobs:
    """The echoed prompt's tokens with their logprobs (the first token has none), then the completion's."""
    entries = [e or {} for e in (prompt_logprobs or [None] * len(prompt_ids))]
    out = completion_logprobs(serving, prompt_ids, entries, top_n, 0, as_ids)
    out.top_logprobs[0] = None
    out.tokens += completion.tokens
    out.text_offset += completion.text_offset
    out.token_logprobs += completion.token_logprobs
    out.top_logprobs += completion.top_logprobs
    return out


def chat_logprobs(serving: OpenAIServing, token_ids: list[int], logprobs: list[dict[int, float]] | None,
                   top_n: int, as_ids: bool = False) -> ChatChoiceLogprobs:
    content = []
    for tok, lp in zip(token_ids, logprobs or [{} for _ in token_ids]):
        s = token_label(serving, tok, as_ids)
        top = sorted(lp.items(), key=lambda kv: -kv[1])[:top_n] if top_n > 0 else []
        content.append(ChatTokenLogprob(
            token=s, logprob=finite(lp.get(tok, -math.inf)), bytes=list(s.encode("utf-8", "replace")),
            top_logprobs=[TopLogprob(token=token_label(serving, t, as_ids), logprob=finite(v),
                                     bytes=list(token_label(serving, t, as_ids).encode("utf-8", "replace")))
                          for t, v in top]))
    return ChatChoiceLogprobs(content=content)


def prompt_logprobs(serving: OpenAIServing, out: RequestOutput, top_n: int | None,
                    as_ids: bool = False) -> PromptLogprobs | None:
    """vLLM's ``prompt_logprobs``: per prompt token (the first has none) the token itself with its rank in
    the distribution, then the ``top_n`` most likely with theirs (1..top_n), each keyed by token id."""
    if out.prompt_logprobs is None:
        return None
    result: PromptLogprobs = []
    ranks = out.prompt_token_ranks
    for pos, entry in enumerate(out.prompt_logprobs):
        if entry is None:
            result.append(None)
            continue
        token = out.prompt_token_ids[pos]
        scored = {token: PromptLogprob(logprob=finite(entry[token]), rank=ranks[pos] if pos < len(ranks) else None,
                                       decoded_token=token_label(serving, token, as_ids))}
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n or 0]
        for rank, (t, v) in enumerate(top, start=1):
            scored.setdefault(t, PromptLogprob(logprob=finite(v), rank=rank, decoded_token=token_label(serving, t, as_ids)))
        result.append(scored)
    return result

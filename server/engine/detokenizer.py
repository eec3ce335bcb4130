"""Incremental detokenization: text grows token by token and never ends inside a UTF-8 character.

Decoding a window that starts a few tokens back keeps tokenizer-specific spacing right (a word-start
marker depends on its neighbour); text ending in U+FFFD means the window stops inside a multi-byte
character, so it is held back until the next token completes it (or, at the sequence's end, appended
as decoded).
"""
from __future__ import annotations

from .sequence import Sequence

_CONTEXT_TOKENS = 5


def init_offsets(seq: Sequence) -> None:
    seq.read_offset = seq.num_prompt_tokens
    seq.prefix_offset = max(seq.num_prompt_tokens - _CONTEXT_TOKENS, 0)


def flush_held_text(tokenizer, seq: Sequence, skip_special_tokens: bool = True) -> str:
    """At the end of a sequence: the text still held back (a character cut by the last token) is appended
    as the full decode renders it (with U+FFFD), so the text is the decode of the tokens, as in vLLM."""
    ids = seq.token_ids
    if seq.read_offset >= len(ids):
        return ""
    prefix = tokenizer.decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(ids[seq.prefix_offset:], skip_special_tokens=skip_special_tokens)
    new_text = full[len(prefix):]
    seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
    seq.output_text += new_text
    return new_text


def detokenize_incrementally(tokenizer, seq: Sequence, skip_special_tokens: bool = True) -> str:
    """Append the text of ``seq``'s newest tokens to ``seq.output_text``; returns the new text."""
    ids = seq.token_ids
    prefix = tokenizer.decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(ids[seq.prefix_offset:], skip_special_tokens=skip_special_tokens)
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        new_text = full[len(prefix):]
        seq.prefix_offset = seq.read_offset
        seq.read_offset = len(ids)
        seq.output_text += new_text
        return new_text
    return ""

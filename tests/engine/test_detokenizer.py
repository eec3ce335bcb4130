"""Incremental detokenization with the real SmolLM2 byte-level BPE: multi-byte characters split over
several tokens never surface as U+FFFD, and the streamed pieces add up to the full decode."""
from __future__ import annotations

import pytest

from pagedmodel.server.engine.detokenizer import detokenize_incrementally, init_offsets
from pagedmodel.server.engine.sequence import Sequence

pytestmark = pytest.mark.model

TEXTS = [
    " Paris is the capital of France.",
    " naïve café — über straße, 東京タワー and 北京 🙂🚀👩‍👩‍👧 done",
    "\n\n  indented\tcode() { return 42; }  ",
    " 12345678901234567890 digits",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode(tokenizer, text):
    prompt = tokenizer("Say:").input_ids
    output = tokenizer(text, add_special_tokens=False).input_ids
    seq = Sequence(list(prompt), len(prompt))
    init_offsets(seq)
    pieces = []
    for token in output:
        seq.token_ids.append(token)
        piece = detokenize_incrementally(tokenizer, seq)
        assert "\ufffd" not in piece
        pieces.append(piece)
    assert "".join(pieces) == seq.output_text == tokenizer.decode(output)
    if any(ord(c) > 0xFFFF for c in text):   # 4-byte characters take several tokens: some steps add nothing
        assert "" in pieces


def test_a_character_cut_by_the_last_token_is_flushed_as_decoded(tokenizer):
    """At a sequence's end its text is the decode of its tokens (vLLM's): a cut character shows as U+FFFD."""
    from pagedmodel.server.engine.detokenizer import flush_held_text

    prompt = tokenizer("Say:").input_ids
    output = tokenizer(" cat 🐱🐶", add_special_tokens=False).input_ids[:-1]   # the dog's last byte cut off
    seq = Sequence(list(prompt), len(prompt))
    init_offsets(seq)
    for token in output:
        seq.token_ids.append(token)
        detokenize_incrementally(tokenizer, seq)
    assert seq.output_text == " cat 🐱"   # held back while the sequence may go on
    assert flush_held_text(tokenizer, seq).endswith("\ufffd")
    assert seq.output_text == tokenizer.decode(output) and flush_held_text(tokenizer, seq) == ""

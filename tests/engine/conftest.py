"""A tiny word-level Llama (vocab 512, token ``tN`` = id N): fast engine tests with exact token control."""
from __future__ import annotations

import pytest
import torch


def make_wordlevel_llama(path, vocab_size: int = 512, **overrides):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
    cfg.update(overrides)
    LlamaForCausalLM(LlamaConfig(**cfg)).save_pretrained(str(path))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t2", bos_token="t1").save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def wordlevel_llama_dir(tmp_path_factory):
    return make_wordlevel_llama(tmp_path_factory.mktemp("wordlevel_llama"))

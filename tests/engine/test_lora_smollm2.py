"""LoRA exactness on the real SmolLM2-135M: peft adapters of rank 8 (every projection) and rank 16
(attention only), random non-zero lora_B from fixed seeds; one batch mixes both adapters and the base
model, and each request's greedy tokens equal HF transformers + peft ``generate``'s."""
from __future__ import annotations

import pytest

from lora_adapters import hf_peft_greedy_all, make_peft_adapter
from pagedmodel import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.model

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):"]
NEW = 8


def test_smollm2_adapters_match_hf_peft(smollm2_dir, tmp_path):
    a8 = make_peft_adapter(smollm2_dir, tmp_path / "a8", rank=8, seed=11, std=0.02)
    a16 = make_peft_adapter(smollm2_dir, tmp_path / "a16", rank=16, seed=12, std=0.02,
                            targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    llm = LLM(model=str(smollm2_dir), device="cpu", dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=16, max_model_len=256, max_num_seqs=8)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    reqs = {"a8": LoRARequest("a8", 1, str(a8)), "a16": LoRARequest("a16", 2, str(a16)), None: None}
    names = ["a8", "a16", None, "a16", "a8"]
    prompts = [ids[i % len(ids)] for i in range(len(names))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True),
                        lora_request=[reqs[n] for n in names])
    got = [list(o.outputs[0].token_ids) for o in outs]
    paths = {"a8": a8, "a16": a16, None: None}
    want = hf_peft_greedy_all(smollm2_dir, paths, ids, NEW)
    assert want["a8"] != want[None] and want["a16"] != want[None]     # the adapters matter
    assert got == [want[n][i % len(ids)] for i, n in enumerate(names)]

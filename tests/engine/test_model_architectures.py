"""Our fused Llama-family model against HF on every supported architecture and RoPE variant:
Llama (tied embeddings), Mistral and Qwen2 (separate head; Qwen2 with q/k/v biases), llama3 and
linear RoPE scaling. Greedy tokens through the paged engine must equal HF generate."""
from __future__ import annotations

import pytest
import torch

from pagedmodel.server.engine.llm import LLM
from pagedmodel.server.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.model

PROMPTS = [[1, 2, 3], list(range(100, 140)), list(range(500, 597))]
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def hf_greedy(model_dir, prompt, n):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}),
    ("mistral", {}),
    ("qwen2", {}),
    ("llama", {"rope_scaling": LLAMA3_ROPE}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
])
def test_engine_matches_hf(tmp_path, smollm2_dir, arch, overrides):
    from tiny_models import make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path / arch, arch, tokenizer_dir=smollm2_dir, **overrides)
    llm = LLM(str(model_dir), device="cpu", dtype="float32", block_size=8, max_model_len=256, kv_cache_memory=8 << 20)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, 12), f"{arch} {overrides} prompt len {len(prompt)}"

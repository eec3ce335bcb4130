"""LoRA on the Triton attention path (interpreter on CPU): a batch mixing two peft adapters and the
base model gives HF transformers + peft's greedy tokens, as on the torch path (tests/engine/test_lora.py)."""
from __future__ import annotations

from lora_adapters import hf_peft_greedy_all, make_peft_adapter
from pagedmodel import LLM, LoRARequest, SamplingParams
from pagedmodel.kernels.backend import BACKEND_ENV
from tiny_models import make_tiny_model_dir

NEW = 4


def test_lora_mixed_batch_on_triton_matches_hf_peft(tmp_path, smollm2_dir, monkeypatch):
    base = make_tiny_model_dir(tmp_path / "base", "llama", tokenizer_dir=smollm2_dir, tie_word_embeddings=False)
    a8 = make_peft_adapter(base, tmp_path / "a8", rank=8, seed=1)
    a16 = make_peft_adapter(base, tmp_path / "a16", rank=16, targets=("q_proj", "v_proj", "down_proj"), seed=2)
    monkeypatch.setenv(BACKEND_ENV, "triton")
    llm = LLM(model=str(base), device="cpu", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
              block_size=8, max_model_len=64, num_gpu_blocks_override=32)
    assert llm.engine.backend.name == "triton"
    ids = [llm.tokenizer.encode(p) for p in ("The capital of France is", "Hi there", "One two three four")]
    loras = [LoRARequest("a8", 1, str(a8)), None, LoRARequest("a16", 2, str(a16))]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids],
                        SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True), lora_request=loras)
    ref = hf_peft_greedy_all(base, {"a8": a8, "a16": a16, None: None}, ids, NEW)
    want = [ref["a8"][0], ref[None][1], ref["a16"][2]]
    assert ref["a8"][0] != ref[None][0]     # the adapter matters
    assert [list(o.outputs[0].token_ids) for o in outs] == want

"""PEFT LoRA adapters for tests, made by `peft` itself on an HF checkpoint, with non-zero weights.

PEFT initialises lora_B to zero (an adapter that changes nothing); these draw A and B from a fixed
seed instead, large enough that the adapter visibly changes greedy outputs.
"""
from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_peft_adapter(base_dir: str | Path, out_dir: str | Path, *, rank: int = 8,
                      targets: tuple[str, ...] = ALL_TARGETS, seed: int = 0, std: float = 0.05,
                      alpha: int | None = None) -> Path:
    """Writes adapter_config.json + adapter_model.safetensors for the model in ``base_dir``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank,
                        target_modules=list(targets), lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    out = Path(out_dir)
    model.save_pretrained(str(out))
    return out


def hf_peft_greedy(base_dir: str | Path, adapter_dir: str | Path | None, prompts: list[list[int]],
                   max_new_tokens: int) -> list[list[int]]:
    """HF transformers (+ peft when an adapter is given) greedy tokens, one prompt at a time (no padding)."""
    return hf_peft_greedy_all(base_dir, {"x": adapter_dir}, prompts, max_new_tokens)["x"]


def hf_peft_greedy_all(base_dir: str | Path, adapters: dict, prompts: list[list[int]],
                       max_new_tokens: int) -> dict:
    """As hf_peft_greedy for several adapters (key -> adapter dir, or None for the base model), loading
    the base model once and switching adapters with peft's set_adapter / disable_adapter."""
    import contextlib

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    named = {key: path for key, path in adapters.items() if path is not None}
    if named:
        from peft import PeftModel

        first, *rest = named
        model = PeftModel.from_pretrained(model, str(named[first]), adapter_name=str(first))
        for key in rest:
            model.load_adapter(str(named[key]), adapter_name=str(key))
    model.eval()
    out = {}
    with torch.no_grad():
        for key, path in adapters.items():
            if path is not None:
                model.set_adapter(str(key))
            ctx = model.disable_adapter() if path is None and named else contextlib.nullcontext()
            with ctx:
                out[key] = [_greedy(model, ids, max_new_tokens) for ids in prompts]
    return out


def _greedy(model, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    y = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                       min_new_tokens=n, pad_token_id=0)
    return y[0, len(ids):].tolist()

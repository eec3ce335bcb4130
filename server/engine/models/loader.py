"""Load HF safetensors checkpoints into our fused-projection models."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from .llama import LlamaForCausalLM

ARCHITECTURES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}

# HF name fragment -> (our fused parameter, shard index); shards are concatenated in this order
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def model_class(config) -> type:
    archs = getattr(config, "architectures", None) or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise ValueError(f"unsupported architecture {archs}; supported: {sorted(ARCHITECTURES)}")


def _hf_to_ours(name: str) -> tuple[str, int | None]:
    name = name.removeprefix("model.")
    for hf, (ours, shard) in _FUSED.items():
        if f".{hf}." in name:
            return name.replace(hf, ours), shard
    return name, None


def load_weights(model: LlamaForCausalLM, model_dir: Path, dtype: torch.dtype, device: torch.device) -> None:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    params = dict(model.named_parameters())
    shards: dict[str, dict[int, torch.Tensor]] = {}
    loaded: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for hf_name in st.keys():
                if "rotary_emb" in hf_name:
                    continue
                name, shard = _hf_to_ours(hf_name)
                if name == "lm_head.weight" and model.lm_head is None:
                    continue  # tied: the embedding is the head
                if name not in params:
                    raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {type(model).__name__}")
                tensor = st.get_tensor(hf_name)
                if shard is None:
                    _assign(params[name], tensor, hf_name)
                    loaded.add(name)
                else:
                    shards.setdefault(name, {})[shard] = tensor
    for name, parts in shards.items():
        expected = 3 if "qkv" in name else 2
        if sorted(parts) != list(range(expected)):
            raise ValueError(f"checkpoint misses shards of {name}: has {sorted(parts)}")
        _assign(params[name], torch.cat([parts[i] for i in range(expected)], dim=0), name)
        loaded.add(name)
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:4]}")
    # (the rotary cos/sin tables move with the model but stay float32: RotaryEmbedding._apply)
    model.to(device=device, dtype=dtype)


DUMMY_WEIGHT_RANGE = 1e-3   # vLLM's dummy range: logits stay near zero, so every token is about as likely


def init_dummy_weights(model: LlamaForCausalLM, dtype: torch.dtype, device: torch.device, seed: int) -> None:
    """--load-format dummy: every parameter uniform in +-DUMMY_WEIGHT_RANGE, from ``seed`` (the same model on
    every start with the same --seed); the rotary tables are buffers, computed as for real weights."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.uniform_(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, generator=generator)
    model.to(device=device, dtype=dtype)


def _assign(param: torch.nn.Parameter, tensor: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}")
    with torch.no_grad():
        param.data = tensor.to(param.dtype).contiguous()


def read_config(model_dir: Path):
    from transformers import AutoConfig

    if not (Path(model_dir) / "config.json").exists():
        raise FileNotFoundError(f"{model_dir} has no config.json")
    json.loads((Path(model_dir) / "config.json").read_text())  # a clear error for a broken file
    return AutoConfig.from_pretrained(str(model_dir))

"""Tiny random HF-format models for tests: real architectures and tokenizer, seconds to build and run.

`make_tiny_model_dir(path, arch)` writes a 2-layer model of the given family with deterministic random
weights (float32 safetensors, via transformers' own save_pretrained) plus the SmolLM2 tokenizer, so text
prompts, chat templates and detokenization behave as with the real default model.

Weights are drawn so that logits are well separated (std ~4 over the vocabulary): greedy decoding is then
stable across kernels and dtypes, unlike HF's default 0.02-std init whose near-uniform logits make argmax
ties a coin flip between two correct implementations. Qwen2's q/k/v biases are drawn non-zero so that a
loader that drops them produces different outputs.
"""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import torch

ARCHITECTURES = ("llama", "mistral", "qwen2")

# Shared shape: GQA (4 query heads over 2 KV heads), head_dim 16, long enough context for paging tests.
BASE_CONFIG: dict[str, Any] = {
    "vocab_size": 49152,            # the SmolLM2 tokenizer's size
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "bos_token_id": 1,              # SmolLM2's <|im_start|>
    "eos_token_id": 2,              # SmolLM2's <|im_end|>
    "pad_token_id": 2,
}

# Per family: what differs in real checkpoints of it. Llama ties embeddings like SmolLM2; the others
# keep a separate lm_head so both loading paths get exercised.
ARCH_CONFIG: dict[str, dict[str, Any]] = {
    "llama": {"tie_word_embeddings": True},
    "mistral": {"tie_word_embeddings": False, "sliding_window": None},
    "qwen2": {"tie_word_embeddings": False, "use_sliding_window": False},
}

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def make_tiny_model_dir(
    path: str | Path,
    arch: str = "llama",
    *,
    tokenizer_dir: str | Path | None = None,
    seed: int = 0,
    **config_overrides: Any,
) -> Path:
    """Write a tiny random `arch` model to `path` (created if needed) and return it.

    config_overrides replace entries of the HF config, e.g. `num_hidden_layers=3`,
    `rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256}`, `max_position_embeddings=4096`. tokenizer_dir defaults to
    the prepared SmolLM2 directory (prepared on first use). Same arguments, same bytes.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, MistralConfig, Qwen2Config

    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {ARCHITECTURES}, got {arch!r}")
    config_cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[arch]
    if tokenizer_dir is None:
        from pagedmodel.server.engine.model_store import resolve_model

        tokenizer_dir = resolve_model(None)
    tokenizer_dir = Path(tokenizer_dir)

    # deep copy: transformers writes into dicts it is given (rope_scaling gains rope_theta)
    values = copy.deepcopy({**BASE_CONFIG, **ARCH_CONFIG[arch], **config_overrides})
    tokenizer_size = _tokenizer_size(tokenizer_dir / "tokenizer.json")
    if values["vocab_size"] < tokenizer_size:
        raise ValueError(f"vocab_size {values['vocab_size']} is smaller than the tokenizer's {tokenizer_size} tokens")
    config = config_cls(**values)
    config.dtype = torch.float32

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    _add_classic_rope_keys(path / "config.json")
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, path / name)
    tok_config_path = path / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    tok_config["model_max_length"] = config.max_position_embeddings
    tok_config_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
    return path


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Redraw every parameter from our own generator, in name order, so bytes depend only on the seed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)             # around 1, but not exactly: scales matter
            elif name.endswith(".bias"):
                param.copy_(0.2 * noise)                   # non-zero: a dropped bias must show
            elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
                param.copy_(0.5 * noise)                   # logits std ~ 0.5 * sqrt(hidden) = 4
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)  # unit-variance activations per layer


def _add_classic_rope_keys(config_path: Path) -> None:
    # transformers 5 writes only `rope_parameters`; published checkpoints carry the classic
    # `rope_theta` / `rope_scaling` keys. Writing both (they agree) keeps the tiny models realistic.
    config = json.loads(config_path.read_text())
    rope = config.get("rope_parameters")
    if isinstance(rope, dict):
        config.setdefault("rope_theta", rope.get("rope_theta"))
        if rope.get("rope_type", "default") != "default":
            config.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def _tokenizer_size(tokenizer_json: Path) -> int:
    data = json.loads(tokenizer_json.read_text())
    ids = list(data["model"]["vocab"].values()) + [t["id"] for t in data.get("added_tokens", [])]
    return max(ids) + 1

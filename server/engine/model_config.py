"""What the checkpoint is: its directory and served name, HF config, tokenizer, context limit and EOS ids.

With --skip-tokenizer-init there is no tokenizer (``tokenizer`` is None): the engine takes token ids and gives
token ids, its EOS ids come from the model's config and generation_config.json alone."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .args import ConfigError, EngineArgs
from .models.loader import model_class, read_config


@dataclass
class ModelConfig:
    model_dir: Path
    served_name: str
    hf_config: Any
    tokenizer: Any            # None: --skip-tokenizer-init
    max_model_len: int
    eos_token_ids: set[int]   # one set, shared by the sampler (min_tokens) and the stop checker

    @classmethod
    def from_args(cls, args: EngineArgs) -> "ModelConfig":
        from transformers import AutoTokenizer

        from .model_store import resolve_model

        model_dir = Path(resolve_model(args.model, weights=args.load_format != "dummy"))
        config = read_config(model_dir)
        model_class(config)  # unsupported architectures fail here, before any allocation
        tokenizer = None if args.skip_tokenizer_init else AutoTokenizer.from_pretrained(str(model_dir))
        return cls(model_dir, args.served_model_name or _default_served_name(args.model, model_dir), config,
                   tokenizer, _max_model_len(config, args.max_model_len), _eos_ids(tokenizer, config, model_dir))

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.hf_config, "num_key_value_heads", None) or self.hf_config.num_attention_heads

    @property
    def head_dim(self) -> int:
        c = self.hf_config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def _default_served_name(model: str | None, model_dir: Path) -> str:
    """A local dir serves under its folder name, a hub id under itself, a built-in under its upstream name."""
    if model and Path(model).expanduser().is_dir():
        return Path(model).expanduser().resolve().name
    from .model_store import BUILTIN_SOURCES, DEFAULT_MODEL_NAME, SMOLLM2

    if not model or any(model in s.aliases or model.lower() == s.name for s in BUILTIN_SOURCES.values()):
        return DEFAULT_MODEL_NAME if (not model or model_dir.name == SMOLLM2.name) else model_dir.name
    return model.removeprefix("hf://")


def _max_model_len(config: Any, asked: int | None) -> int:
    max_len = int(getattr(config, "max_position_embeddings", 2048))
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and config.model_type == "mistral":
        max_len = min(max_len, int(window))  # no sliding-window attention here: stay inside the window
    if asked and asked > max_len:
        raise ConfigError(f"--max-model-len {asked} exceeds the model's limit of {max_len} tokens")
    return asked or max_len


def _eos_ids(tokenizer: Any, config: Any, model_dir: Path) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(tokenizer, "eos_token_id", None), getattr(config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    gen_cfg = model_dir / "generation_config.json"
    if gen_cfg.exists():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return ids

"""A PEFT LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``), read and
checked against the base model, its weights kept on the CPU until a slot needs them.

PEFT adds ``lora_B(lora_A(x)) * scaling`` to a projection's output, ``scaling = lora_alpha / r``
(``/ sqrt(r)`` with rsLoRA). Only what the Llama projections can take is accepted; anything else
(DoRA, trained biases, extra saved modules, per-module ranks) is refused with a message naming it,
rather than served subtly wrong.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..model_store import ModelNotAvailableError, resolve_adapter

# the HF projection names an adapter may target -> (input, output) feature counts, from the config
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRAError(ValueError):
    """An adapter that cannot be served on this model; the API answers 400 with the message."""


def projection_shapes(hf_config) -> dict[str, tuple[int, int]]:
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


@dataclass
class LoRAAdapter:
    name: str
    int_id: int
    path: str
    rank: int
    scaling: float
    # (layer index, HF projection name) -> (A [rank, in], B [out, rank]) on the CPU, in the model's dtype
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False, default_factory=dict)

    @property
    def cache_salt(self) -> bytes:
        """Prefix-cache isolation: the same tokens under another adapter (or none) have other K/V."""
        return f"lora:{self.name}:{self.path}".encode()


def load_adapter(name: str, int_id: int, path: str | Path, hf_config, max_rank: int,
                 dtype: torch.dtype = torch.float32) -> LoRAAdapter:
    """Reads and checks the adapter from its directory or ``hf://org/name`` (fetched from the Hub); raises
    LoRAError with the reason when it cannot be served."""
    try:
        root = resolve_adapter(str(path))
    except ModelNotAvailableError as exc:
        raise LoRAError(str(exc)) from None
    config = _read_config(root)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"adapter {name!r}: adapter_config.json has no valid rank 'r' ({rank!r})")
    if rank > max_rank:
        raise LoRAError(f"adapter {name!r} has rank {rank}, above --max-lora-rank {max_rank}")
    _refuse_unsupported(name, config)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = _read_tensors(name, root)
    shapes = projection_shapes(hf_config)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(2) not in TARGETS:
            raise LoRAError(f"adapter {name!r}: tensor {key!r} targets no supported projection "
                            f"(supported: {', '.join(TARGETS)})")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if layer >= hf_config.num_hidden_layers:
            raise LoRAError(f"adapter {name!r}: tensor {key!r} is for layer {layer}; the model has "
                            f"{hf_config.num_hidden_layers}")
        pairs.setdefault((layer, module), {})[which] = tensor
    weights = {}
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"adapter {name!r}: layer {layer} {module} has lora_{''.join(ab)} but not both A and B")
        a, b = ab["A"], ab["B"]
        n_in, n_out = shapes[module]
        if tuple(a.shape) != (rank, n_in) or tuple(b.shape) != (n_out, rank):
            raise LoRAError(f"adapter {name!r}: layer {layer} {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                            f"this model needs A ({rank}, {n_in}) and B ({n_out}, {rank})")
        weights[(layer, module)] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
    if not weights:
        raise LoRAError(f"adapter {name!r}: adapter_model.safetensors holds no LoRA weights")
    source = str(path) if str(path).startswith("hf://") else str(root)   # what requests and /v1/models name
    return LoRAAdapter(name, int_id, source, rank, float(scaling), weights)


def _read_config(root: Path) -> dict:
    if not root.is_dir():
        raise LoRAError(f"LoRA adapter path {str(root)!r} is not a directory")
    cfg = root / "adapter_config.json"
    try:
        config = json.loads(cfg.read_text())
    except FileNotFoundError:
        raise LoRAError(f"{str(root)!r} has no adapter_config.json (not a PEFT adapter directory)") from None
    except (OSError, ValueError) as exc:
        raise LoRAError(f"cannot read {cfg}: {exc}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{cfg} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{cfg}: peft_type {config.get('peft_type')!r} is not LORA")
    return config


def _refuse_unsupported(name: str, config: dict) -> None:
    if config.get("use_dora"):
        raise LoRAError(f"adapter {name!r} uses DoRA, which is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"adapter {name!r} trains biases (bias={config['bias']!r}); only bias='none' is supported")
    if config.get("modules_to_save"):
        raise LoRAError(f"adapter {name!r} saves whole modules {config['modules_to_save']!r}; not supported")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise LoRAError(f"adapter {name!r} has per-module ranks or alphas (rank_pattern/alpha_pattern); not supported")
    if config.get("fan_in_fan_out"):
        raise LoRAError(f"adapter {name!r} has fan_in_fan_out=true (Conv1D layouts); not supported for Llama")


def _read_tensors(name: str, root: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = root / "adapter_model.safetensors"
    if not path.exists():
        raise LoRAError(f"{str(root)!r} has no adapter_model.safetensors")
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise LoRAError(f"adapter {name!r}: cannot read {path}: {exc}") from None

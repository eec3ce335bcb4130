"""Which device, dtype and KV block size the engine runs with (``--device``, ``--dtype``, ``--block-size``)."""
from __future__ import annotations

from typing import Any

import torch

from pagedmodel.kernels.cpu_features import has_native_bf16

from .args import CPU_BLOCK_SIZE, GPU_BLOCK_SIZE, ConfigError


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for, but no CUDA device is available")
    return device


def pick_dtype(name: str, config: Any, device: torch.device, native_bf16: bool | None = None) -> torch.dtype:
    """``--dtype``; ``auto`` is bf16 on GPUs (fp16 if the checkpoint is fp16) and on CPUs with native
    bf16 (AMX / AVX512-BF16), float32 on other CPUs (there bf16 is emulated: slower and lossy)."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.bfloat16 if (has_native_bf16() if native_bf16 is None else native_bf16) else torch.float32
    wanted = getattr(config, "torch_dtype", None) or getattr(config, "dtype", None)
    return torch.float16 if wanted in (torch.float16, "float16") else torch.bfloat16


def pick_block_size(block_size: int | None, device: torch.device) -> int:
    """``--block-size``; unset, 128 tokens on CPU and 16 elsewhere, as vLLM does."""
    if block_size is not None:
        return block_size
    return CPU_BLOCK_SIZE if device.type == "cpu" else GPU_BLOCK_SIZE

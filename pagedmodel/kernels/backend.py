"""Attention backend selection: Triton on CUDA, pure torch on CPU.

``PAGEDMODEL_ATTENTION_BACKEND=torch|triton`` overrides the choice, so the Triton path
can also run on CPU under ``TRITON_INTERPRET=1`` (tests) and the torch path on a GPU
(debugging).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from . import torch_attention
from .attention_metadata import AttentionMetadata

BACKEND_ENV = "PAGEDMODEL_ATTENTION_BACKEND"


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    write_kv: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
    paged_attention: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor]
    copy_blocks: Callable[[list[torch.Tensor], torch.Tensor], None]
    # On a CPU cache, writes go through the CPU ops extension's ``write_kv`` (cpu_cache_write.cpp) and
    # attention through its ops: the model may then rotate and write in one call (``rotary_and_write_kv``),
    # and the worker builds the extension before the first request.
    cache_write_is_cpu_op: bool = False


TORCH_BACKEND = AttentionBackend(
    name="torch",
    write_kv=torch_attention.write_kv,
    paged_attention=torch_attention.paged_attention,
    copy_blocks=torch_attention.copy_blocks,
    cache_write_is_cpu_op=True,
)


def _triton_backend() -> AttentionBackend:
    from . import triton_attention  # imported lazily: triton is optional on CPU machines

    return AttentionBackend(
        name="triton",
        write_kv=triton_attention.write_kv,
        paged_attention=triton_attention.paged_attention,
        copy_blocks=triton_attention.copy_blocks,
    )


def select_backend(device: torch.device | str, override: str | None = None) -> AttentionBackend:
    choice = (override or os.environ.get(BACKEND_ENV, "")).strip().lower()
    if not choice:
        choice = "triton" if torch.device(device).type == "cuda" else "torch"
    if choice == "torch":
        return TORCH_BACKEND
    if choice == "triton":
        return _triton_backend()
    raise ValueError(f"{BACKEND_ENV} must be 'torch' or 'triton', got {choice!r}")

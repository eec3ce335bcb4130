"""Attention as one opaque op for compiled graphs (``server/engine/compiled_forward.py``).

A compiled graph must not trace the paged cache, the block tables or the host-side row plan: they
change every step, so the graph would guard (and recompile) on every batch. Inside the graph each
layer's attention is ``pagedmodel::forward_attention(q, k, v, layer, scale)``, which reads the step's
metadata, backend and KV caches from ``forward_context``, set around each compiled call (vLLM's
forward context does the same for the same reason).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from .attention_metadata import AttentionMetadata
from .backend import AttentionBackend


@dataclass
class ForwardContext:
    meta: AttentionMetadata
    backend: AttentionBackend
    kv_caches: list[torch.Tensor]


_context: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(meta: AttentionMetadata, backend: AttentionBackend,
                    kv_caches: list[torch.Tensor]) -> Iterator[None]:
    """The step the compiled graph's attention op reads; one step at a time (the engine is one thread)."""
    global _context
    previous, _context = _context, ForwardContext(meta, backend, kv_caches)
    try:
        yield
    finally:
        _context = previous


@torch.library.custom_op("pagedmodel::forward_attention", mutates_args=())
def forward_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    """This layer's K/V written into its cache slots, then paged attention over each row's own context.
    (The cache write is a side effect the graph does not see; the op's output is always used, so the
    compiler never drops or reorders the call across layers.)"""
    ctx = _context
    if ctx is None:
        raise RuntimeError("pagedmodel::forward_attention called outside forward_context")
    cache = ctx.kv_caches[layer]
    ctx.backend.write_kv(k, v, cache, ctx.meta.slot_mapping)
    return ctx.backend.paged_attention(q, cache, ctx.meta, scale)


@forward_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    return q.new_empty(q.shape)

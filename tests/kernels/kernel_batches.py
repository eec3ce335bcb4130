"""Builders for the paged batches the kernel tests feed to both backends."""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from pagedmodel.kernels.attention_metadata import AttentionMetadata


@dataclass
class PagedBatch:
    query: torch.Tensor      # [T, q_heads, head_dim]
    kv_cache: torch.Tensor   # [2, num_blocks, block_size, kv_heads, head_dim], random everywhere
    meta: AttentionMetadata


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    block_size: int = 4,
    q_heads: int = 2,
    kv_heads: int = 1,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_blocks: int = 3,
    share_first_block: bool = False,
) -> PagedBatch:
    """A batch whose sequences own shuffled, non-contiguous physical blocks.

    The whole cache is random, including block 0 (what table padding points at), unused
    blocks and the slots past each sequence's end, so a kernel reading anything it should
    not gets a wrong answer rather than a lucky zero. ``share_first_block`` makes every
    sequence's first block the same physical block (a shared prefix).
    """
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    needed = [-(-s // block_size) for s in seq_lens]
    total = sum(needed) + spare_blocks + 1
    free = list(range(1, total))
    rng.shuffle(free)
    shared = free.pop() if share_first_block else None
    tables: list[list[int]] = []
    slots: list[int] = []
    for q_len, s_len, n in zip(query_lens, seq_lens, needed):
        table = [free.pop() for _ in range(n)]
        if shared is not None and table:
            table[0] = shared
        tables.append(table)
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(s_len - q_len, s_len))
    cache = torch.randn(2, total, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    query = torch.randn(sum(query_lens), q_heads, head_dim, generator=gen).to(dtype)
    return PagedBatch(query, cache, AttentionMetadata.build(query_lens, seq_lens, tables, slots))

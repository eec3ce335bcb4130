"""The KV cache tensors: one ``[2, num_blocks, block_size, kv_heads, head_dim]`` tensor per layer,
sized from a byte budget, plus the block-copy op that copy-on-write needs."""
from __future__ import annotations

import torch

from pagedmodel.kernels.backend import AttentionBackend

CPU_DEFAULT_KV_BYTES = 1 << 30


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, backend: AttentionBackend):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.backend = backend
        shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
        self.layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.nbytes = sum(t.numel() * t.element_size() for t in self.layers)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            mapping = torch.tensor(pairs, dtype=torch.int64, device=self.layers[0].device)
            self.backend.copy_blocks(self.layers, mapping)

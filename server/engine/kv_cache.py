"""The KV cache tensors: one ``[2, num_blocks, block_size, kv_heads, head_dim]`` tensor per layer,
sized from a byte budget, plus the block-copy op that copy-on-write needs."""
from __future__ import annotations

import torch

from pagedmodel.kernels import huge_pages
from pagedmodel.kernels.backend import AttentionBackend

CPU_DEFAULT_KV_BYTES = 1 << 30


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, backend: AttentionBackend, num_cpu_blocks: int = 0):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.backend = backend
        self.device = torch.device(device)
        # zeros, not empty: attention reads (and masks) a block's unused tail, and NaN * 0 is still NaN.
        # On CPU the blocks go on 2 MB pages: a step's reads hop from block to block over the whole cache,
        # a TLB miss per 4 KB page otherwise (pagedmodel/kernels/huge_pages.py).
        shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
        if self.device.type == "cpu":
            self.layers = [huge_pages.zeros(shape, dtype) for _ in range(num_layers)]
        else:
            self.layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.nbytes = sum(t.numel() * t.element_size() for t in self.layers)
        self.num_cpu_blocks = num_cpu_blocks
        self._cpu_shape = (2, num_cpu_blocks, block_size, num_kv_heads, head_dim)
        self._cpu_layers: list[torch.Tensor] | None = None  # swap space, allocated on first swap-out

    def cpu_layers(self) -> list[torch.Tensor]:
        if self._cpu_layers is None:
            pin = self.device.type == "cuda"
            self._cpu_layers = [torch.zeros(self._cpu_shape, dtype=self.layers[0].dtype, pin_memory=pin)
                                for _ in self.layers]
        return self._cpu_layers

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            mapping = torch.tensor(pairs, dtype=torch.int64, device=self.layers[0].device)
            self.backend.copy_blocks(self.layers, mapping)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, cpu block) pairs: device -> swap space."""
        if pairs:
            dev = torch.tensor([d for d, _ in pairs], device=self.device)
            cpu = torch.tensor([c for _, c in pairs])
            for src, dst in zip(self.layers, self.cpu_layers()):
                dst[:, cpu] = src[:, dev].to("cpu", non_blocking=True)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(cpu block, device block) pairs: swap space -> device."""
        if pairs:
            cpu = torch.tensor([c for c, _ in pairs])
            dev = torch.tensor([d for _, d in pairs], device=self.device)
            for src, dst in zip(self.cpu_layers(), self.layers):
                dst[:, dev] = src[:, cpu].to(self.device, non_blocking=True)

"""What one engine step tells the attention kernels about its flattened batch.

The batch is variable-length and unpadded: sequence ``i`` owns query rows
``query_start_loc[i]:query_start_loc[i+1]`` of the flattened ``[T, heads, head_dim]``
tensors. Those rows are the *last* ``query_len`` tokens of its context of
``seq_len`` tokens, so row ``j`` sits at absolute position ``seq_len - query_len + j``
and attends causally to context positions ``0..seq_len - query_len + j``. A decode row
has ``query_len == 1``; a chunked prefill has ``0 < query_len < seq_len``; a fresh
prefill has ``query_len == seq_len``. One batch may mix all three, in any order.

Context token ``p`` of sequence ``i`` lives in physical block
``block_tables[i, p // block_size]`` at offset ``p % block_size``; ``block_tables`` is
padded with 0 past each sequence's last block (never read there).

Device tensors are the truth; the host lists only shape launches. Under a CUDA-graph capture
(``server/engine/cuda_graph_runner.py``) the host lists are fixed when the graph is recorded while the
device tensors change on every replay, so there ``seq_lens_cpu`` holds an *upper bound* (the
max model length) and kernels must read exact lengths from ``seq_lens`` / ``query_start_loc``,
using the host copies only for grid sizes, gather widths and tuning (e.g. the split count).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor     # [T] int64: cache slot (block * block_size + offset) per new token; -1 = don't write
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor         # [B] int32, context length including this step's tokens
    block_tables: torch.Tensor     # [B, max_blocks] int32
    query_lens_cpu: list[int]      # host copies, so kernels' launch logic never syncs the device
    seq_lens_cpu: list[int]
    # what a kernel derives from these tensors once per step (e.g. the torch path's row plan), keyed
    # by what it was derived from, so the other layers of the step reuse it
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @property
    def is_all_decode(self) -> bool:
        return all(q == 1 for q in self.query_lens_cpu)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        slot_mapping: list[int],
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        """Host lists -> device tensors (one transfer each)."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        width = max((len(t) for t in block_tables), default=0) or 1
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        return cls(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(len(padded), width),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
        )

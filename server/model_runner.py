"""Flattens a scheduled step into one unpadded batch, runs the model, and returns next-token logits."""
from __future__ import annotations

import torch

from pagedmodel.kernels.attention_metadata import AttentionMetadata
from pagedmodel.kernels.backend import AttentionBackend

from .block_manager import BlockManager
from .kv_cache import KVCache
from .scheduler import SchedulerOutput


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, block_manager: BlockManager,
                 backend: AttentionBackend, device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.bm = block_manager
        self.backend = backend
        self.device = device

    def prepare(self, sched: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """input ids, positions, attention metadata, and the flat rows whose logits are needed."""
        bs = self.bm.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        for s in sched.scheduled:
            start, end = s.start, s.start + s.num_new_tokens
            table = self.bm.block_ids(s.seq)
            ids.extend(s.seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(s.num_new_tokens)
            seq_lens.append(end)
            tables.append(table)
            if s.samples:
                sample_rows.append(len(ids) - 1)
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, slots, self.device)
        return (torch.tensor(ids, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device), meta, sample_rows)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> torch.Tensor:
        """Runs one step; returns float32 logits ``[num sampling sequences, vocab]`` in schedule order."""
        # the order the block manager's bookkeeping assumes: a block given up by a swap-out may be a
        # swap-in or copy-on-write target of the same step, and a swapped-in block may be a CoW source
        self.kv_cache.swap_out(sched.blocks_to_swap_out)
        self.kv_cache.swap_in(sched.blocks_to_swap_in)
        self.kv_cache.copy_blocks(sched.blocks_to_copy)
        input_ids, positions, meta, sample_rows = self.prepare(sched)
        hidden = self.model(input_ids, positions, self.kv_cache.layers, meta, self.backend)
        if not sample_rows:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[rows])

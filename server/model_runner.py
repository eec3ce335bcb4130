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

    def prepare(self, sched: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int],
                                                       list[tuple[int, int, int]]]:
        """input ids, positions, attention metadata, the flat rows whose logits are sampled from, and
        (scheduled index, first position, row count) spans of prompt rows whose logprobs were asked for."""
        bs = self.bm.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        prompt_spans: list[tuple[int, int, int]] = []
        for i, s in enumerate(sched.scheduled):
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
            # position p's logits score prompt token p + 1 (the last prompt position's are sampled from)
            last = min(end, s.seq.num_prompt_tokens - 1)
            if s.group.params.prompt_logprobs is not None and s.seq.num_output_tokens == 0 and start < last:
                prompt_spans.append((i, start, last - start))
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, slots, self.device)
        return (torch.tensor(ids, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device), meta, sample_rows, prompt_spans)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[torch.Tensor, list[tuple[int, int, torch.Tensor]]]:
        """Runs one step; returns float32 logits ``[num sampling sequences, vocab]`` in schedule order, and
        (scheduled index, first position, prompt log-probabilities) for prompts that asked for them."""
        # the order the block manager's bookkeeping assumes: a block given up by a swap-out may be a
        # swap-in or copy-on-write target of the same step, and a swapped-in block may be a CoW source
        self.kv_cache.swap_out(sched.blocks_to_swap_out)
        self.kv_cache.swap_in(sched.blocks_to_swap_in)
        self.kv_cache.copy_blocks(sched.blocks_to_copy)
        input_ids, positions, meta, sample_rows, prompt_spans = self.prepare(sched)
        hidden = self.model(input_ids, positions, self.kv_cache.layers, meta, self.backend)
        prompt_logprobs = []
        offsets = [0]
        for s in sched.scheduled:
            offsets.append(offsets[-1] + s.num_new_tokens)
        for i, start, count in prompt_spans:
            row0 = offsets[i]
            logits = self.model.compute_logits(hidden[row0:row0 + count])
            prompt_logprobs.append((i, start, torch.log_softmax(logits, dim=-1)))
        if not sample_rows:
            return hidden.new_empty((0, 0), dtype=torch.float32), prompt_logprobs
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[rows]), prompt_logprobs

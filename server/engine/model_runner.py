"""Flattens a scheduled step into one unpadded batch, runs the model, and returns next-token logits.

Pure-decode steps (one new token per row) replay a CUDA graph when one was captured (CUDA, Triton
backend, no ``--enforce-eager``; see ``cuda_graph_runner.py``); every other step runs eagerly.
"""
from __future__ import annotations

import logging
from typing import Literal, Sequence

import torch

from pagedmodel.kernels.attention_metadata import AttentionMetadata
from pagedmodel.kernels.backend import AttentionBackend

from .block_manager import BlockManager
from .cuda_graph_runner import CUDAGraphRunner, GraphBackend, capture_sizes, select_graph_backend
from .kv_cache import KVCache
from .scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, block_manager: BlockManager,
                 backend: AttentionBackend, device: torch.device, *, max_model_len: int | None = None,
                 max_num_seqs: int = 256, enforce_eager: bool = False,
                 graph_backend: GraphBackend | None | Literal["auto"] = "auto",
                 graph_sizes: Sequence[int] | None = None):
        """``graph_backend``: ``"auto"`` lets ``select_graph_backend`` decide (device, attention
        backend, ``enforce_eager``, ``PAGEDMODEL_CUDA_GRAPHS``); tests may force one (e.g.
        ``EmulatedGraphBackend()`` on CPU) or ``None``; ``enforce_eager`` wins either way.
        ``graph_sizes`` replaces the batch-size ladder. Graphs are captured here, once, so the KV
        cache must already be allocated."""
        self.model = model
        self.kv_cache = kv_cache
        self.bm = block_manager
        self.backend = backend
        self.device = device
        if isinstance(graph_backend, str):
            if graph_backend != "auto":
                raise ValueError(f"graph_backend must be 'auto', None or a GraphBackend, got {graph_backend!r}")
            graph_backend = select_graph_backend(device, backend, enforce_eager)
        self.graph_runner: CUDAGraphRunner | None = None
        self.graph_capture_error: str | None = None
        if graph_backend is not None and not enforce_eager:
            if max_model_len is None:
                raise ValueError("CUDA graphs need max_model_len (it sizes the static block tables)")
            runner = CUDAGraphRunner(
                model, kv_cache.layers, backend, graph_backend, block_size=block_manager.block_size,
                max_model_len=max_model_len, sizes=graph_sizes or capture_sizes(max_num_seqs), device=device)
            try:
                runner.capture()
                self.graph_runner = runner
            except Exception as exc:   # graphs are an optimisation: a capture failure must not stop serving
                self.graph_capture_error = f"{type(exc).__name__}: {exc}"
                logger.error("CUDA graph capture failed (%s); every step runs eagerly. --enforce-eager skips the "
                             "capture.", self.graph_capture_error, exc_info=True)
                del runner
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    torch.cuda.empty_cache()     # give the half-captured graphs' pool back to the KV-less heap

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
        hidden = None
        if self.graph_runner is not None:
            hidden = self.graph_runner.run(input_ids, positions, meta)  # None: not a capturable step
        if hidden is None:
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

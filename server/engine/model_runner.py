"""Flattens a scheduled step into one unpadded batch, runs the model, and returns next-token logits.

It reads only the scheduler's output (sequences, their block ids, the block copies and swaps): block
bookkeeping stays with the scheduler.

Pure-decode steps (one new token per row) replay a CUDA graph when one was captured (CUDA, Triton
backend, no ``--enforce-eager``; see ``cuda_graph_runner.py``); every other step runs eagerly.
"""
from __future__ import annotations

import logging
from typing import Literal, Sequence

import torch

from pagedmodel.kernels.attention_metadata import AttentionMetadata
from pagedmodel.kernels.backend import AttentionBackend

from .compiled_forward import CompiledForward
from .cuda_graph_runner import CUDAGraphRunner, GraphBackend, capture_sizes, select_graph_backend
from .kv_cache import KVCache
from .lora.layers import LoRABatch, LoRAState
from .step_types import ModelRunnerOutput, ScheduledSequence, SchedulerOutput

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, backend: AttentionBackend, device: torch.device, *, max_model_len: int | None = None,
                 max_num_seqs: int = 256, enforce_eager: bool = False,
                 graph_backend: GraphBackend | None | Literal["auto"] = "auto",
                 graph_sizes: Sequence[int] | None = None, lora: LoRAState | None = None,
                 torch_compile: bool = False):
        """``graph_backend``: ``"auto"`` lets ``select_graph_backend`` decide (device, attention
        backend, ``enforce_eager``, ``PAGEDMODEL_CUDA_GRAPHS``); tests may force one (e.g.
        ``EmulatedGraphBackend()`` on CPU) or ``None``; ``enforce_eager`` wins either way.
        ``graph_sizes`` replaces the batch-size ladder. Graphs are captured here, once, so the KV
        cache must already be allocated. ``lora``: the model's LoRA wrappers (``--enable-lora``); steps with
        adapter rows run eagerly. ``torch_compile``: the forward through one inductor graph
        (``compiled_forward.py``), compiled here; ``enforce_eager`` wins, and a failed compile leaves
        every step eager."""
        self.model = model
        self.lora = lora
        self.kv_cache = kv_cache
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
                model, kv_cache.layers, backend, graph_backend, block_size=kv_cache.block_size,
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
        self.compiled: CompiledForward | None = None
        self.compile_error: str | None = None
        if torch_compile and not enforce_eager:
            self.compiled = self._compile()

    def _compile(self) -> CompiledForward | None:
        compiled = CompiledForward(self.model)
        try:
            compiled.warm_up(self.kv_cache.layers, self.backend, self.device, self.kv_cache.block_size)
        except Exception as exc:   # an optimisation: a compile failure must not stop serving
            self._compile_failed(exc)
            return None
        logger.info("forward compiled with torch.compile in %.0f s", compiled.compile_seconds)
        return compiled

    def _compile_failed(self, exc: Exception) -> None:
        self.compiled = None
        self.compile_error = f"{type(exc).__name__}: {str(exc).strip()[:500]}"
        logger.error("torch.compile of the forward failed (%s); every step runs eagerly", self.compile_error,
                     exc_info=True)

    def prepare(self, sched: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int],
                                                       list[tuple[ScheduledSequence, int, int]]]:
        """input ids, positions, attention metadata, the flat rows whose logits are sampled from, and
        (scheduled sequence, first flat row, row count) spans of prompt rows whose logprobs were asked for."""
        bs = self.kv_cache.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        prompt_spans: list[tuple[ScheduledSequence, int, int]] = []
        for s in sched.scheduled:
            start, end = s.start, s.start + s.num_new_tokens
            table = s.block_ids
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
                prompt_spans.append((s, len(ids) - (end - start), last - start))
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, slots, self.device)
        return (torch.tensor(ids, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device), meta, sample_rows, prompt_spans)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step: the scheduled block moves, then the model; logits for the sequences that sample."""
        # the order the block manager's bookkeeping assumes: a block given up by a swap-out may be a
        # swap-in or copy-on-write target of the same step, and a swapped-in block may be a CoW source
        self.kv_cache.swap_out(sched.blocks_to_swap_out)
        self.kv_cache.swap_in(sched.blocks_to_swap_in)
        self.kv_cache.copy_blocks(sched.blocks_to_copy)
        input_ids, positions, meta, sample_rows, prompt_spans = self.prepare(sched)
        lora_batch = self._lora_batch(sched) if self.lora is not None else None
        embeds = self._embed_rows(sched)
        hidden = None
        if self.graph_runner is not None and lora_batch is None and embeds is None:
            hidden = self.graph_runner.run(input_ids, positions, meta)  # None: not a capturable step
        if hidden is None:
            if self.lora is not None:
                self.lora.batch = lora_batch
            try:   # steps with prompt embeddings (rare prefills) run eagerly, outside compiled code
                hidden = self._forward(input_ids, positions, meta, compiled=lora_batch is None and embeds is None,
                                       embeds=embeds)
            finally:
                if self.lora is not None:
                    self.lora.batch = None
        out = ModelRunnerOutput([s for s in sched.scheduled if s.samples],
                                hidden.new_empty((0, 0), dtype=torch.float32))
        for s, row0, count in prompt_spans:
            logits = self.model.compute_logits(hidden[row0:row0 + count])
            out.prompt_logprobs[s.seq.seq_id] = (s, torch.log_softmax(logits, dim=-1))
        if sample_rows:
            rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
            out.logits = self.model.compute_logits(hidden[rows], float32=False)
        return out

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, *,
                 compiled: bool, embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if compiled and self.compiled is not None:
            try:
                return self.compiled(input_ids, positions, self.kv_cache.layers, meta, self.backend)
            except Exception as exc:   # e.g. a recompile for a new shape failed: this step and the rest eagerly
                self._compile_failed(exc)   # (the layers it ran rewrite the same cache slots with the same K/V)
        if embeds is not None:
            return self.model(input_ids, positions, self.kv_cache.layers, meta, self.backend, embeds=embeds)
        return self.model(input_ids, positions, self.kv_cache.layers, meta, self.backend)

    def _embed_rows(self, sched: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(flat rows, their input embeddings) for the step's prompt positions given as embeddings
        (prompt_embeds.py); None when there are none."""
        rows: list[int] = []
        values: list[torch.Tensor] = []
        offset = 0
        for s in sched.scheduled:
            embeds = s.group.prompt_embeds
            if embeds is not None and s.start < s.seq.num_prompt_tokens:
                for at, chunk in embeds.rows_between(s.start, s.start + s.num_new_tokens):
                    rows.extend(range(offset + at, offset + at + chunk.shape[0]))
                    values.append(chunk)
            offset += s.num_new_tokens
        if not rows:
            return None
        return (torch.tensor(rows, dtype=torch.long, device=self.device),
                torch.cat(values).to(self.device, non_blocking=True))

    def _lora_batch(self, sched: SchedulerOutput) -> LoRABatch | None:
        """Loads the adapters the scheduler placed in slots this step, and groups the step's token rows
        by slot; None when no row uses an adapter."""
        for slot, adapter in sched.lora_loads:
            self.lora.load(slot, adapter)
        rows: dict[int, list[int]] = {}
        offset = 0
        for s in sched.scheduled:
            if s.lora_slot is not None:
                rows.setdefault(s.lora_slot, []).extend(range(offset, offset + s.num_new_tokens))
            offset += s.num_new_tokens
        if not rows:
            return None
        if len(rows) == 1 and len(next(iter(rows.values()))) == offset:    # every row under one adapter
            return LoRABatch([(next(iter(rows)), None)])
        return LoRABatch([(slot, torch.tensor(r, dtype=torch.long, device=self.device)) for slot, r in rows.items()])

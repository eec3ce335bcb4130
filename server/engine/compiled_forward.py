"""The model's forward through ``torch.compile`` (inductor): opt-in with ``--torch-compile``, eager otherwise.

The whole decoder is one graph with the step's token count as a dynamic dimension. Attention is the
one op the compiler must not see into: the paged cache, the block tables and the host-side row plan
change every step, so tracing them would guard (and recompile) on every batch. It is therefore one
opaque custom op, ``pagedmodel::forward_attention(q, k, v, layer, scale)``, that reads the step's
metadata, backend and KV caches from ``forward_context``, set around each compiled call (vLLM's
forward context does the same for the same reason). Inside the graph the layers use torch ops, not
our hand-fused C++ ones: inductor fuses the norms, rotary embedding and SiLU itself, and with
``freezing`` it prepacks the weights for oneDNN as ``cpu_linear`` does by hand.

Why it is off by default: the first compile takes 1-3 minutes on two cores, and on CPU the graph
did not beat the eager path (docs/engine.md, "Compiled forward"). Compile failures never stop serving: the first call compiles (at start-up, in ``warm_up``); any error there, or in a later
recompile, logs and leaves the runner eager.
"""
from __future__ import annotations

import time

import torch

from pagedmodel.kernels.attention_metadata import AttentionMetadata
from pagedmodel.kernels.backend import AttentionBackend
from pagedmodel.kernels.forward_attention import forward_context


class CompiledForward:
    """``model(input_ids, positions, kv_caches, meta, backend)`` through one compiled graph."""

    def __init__(self, model: torch.nn.Module, *, freezing: bool = True):
        """``freezing``: inductor treats the weights as constants (folds, prepacks them for oneDNN), so
        the model's weights must not change after the compile (adapters are separate tensors)."""
        self.model = model
        self.compile_seconds = 0.0
        # no layer gets a cache: attention is one op that reads the step from the forward context
        self._no_caches = [None] * len(model.layers)
        self._compiled = torch.compile(self._forward, dynamic=True, fullgraph=True, options={"freezing": freezing})

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, self._no_caches, None, None)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        with forward_context(meta, backend, kv_caches):
            return self._compiled(input_ids, positions)

    def warm_up(self, kv_caches: list[torch.Tensor], backend: AttentionBackend, device: torch.device,
                block_size: int) -> None:
        """Compiles before the first request: one step of one token and one of several (dynamo treats a
        dimension of 1 apart). The steps write no cache slot (slot -1) and read only block 0."""
        start = time.perf_counter()
        with torch.inference_mode():   # as the runner's steps: guards tell inference tensors apart
            for tokens in (2, 1):
                ids = torch.zeros(tokens, dtype=torch.long, device=device)
                positions = torch.arange(tokens, dtype=torch.long, device=device)
                meta = AttentionMetadata.build([tokens], [tokens], [[0] * (-(-tokens // block_size))],
                                               [-1] * tokens, device)
                self(ids, positions, kv_caches, meta, backend)
        self.compile_seconds = time.perf_counter() - start


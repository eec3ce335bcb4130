"""Pure-decode steps replayed from CUDA graphs, one graph per batch size of a ladder.

Why: a decode step of a small model is a few hundred tiny kernels (SmolLM2-135M: 30 layers x
~12 launches) whose device time is far below the host's time to launch them; replaying a graph
recorded once replaces all of those launches with one.

What is captured: the model's forward (``model(input_ids, positions, kv_caches, meta, backend)``,
hidden states only) for a step where every scheduled row has exactly one new token. Logits,
sampling and everything else stay eager: they run on the ``b`` real rows only.

The ladder (``capture_sizes``): 1, 2, 4, 8, then every multiple of 8 from 16, up to
``min(max_num_seqs, 512)``, plus that cap itself when it is not on the ladder (a cap of 20 gives
1, 2, 4, 8, 16, 20). A batch of ``b`` rows runs the graph of the smallest captured size >= ``b``,
so at most 7 padding rows ride along above 8 (small next to the step's fixed cost); larger
batches run eagerly. Sizes are captured largest first into one shared memory pool, so the pool
is sized by the largest graph and the smaller ones reuse its memory (graphs never run at once).

Static buffers, allocated once for the largest size, at fixed addresses the graphs were recorded
with: input ids, positions, slot mapping, sequence lengths, query start offsets (always
``0..b``), block tables padded to ``ceil(max_model_len / block_size)`` columns, and the hidden
state output. Each size's ``AttentionMetadata`` is a set of views of them whose host lists are
fixed at capture: one token per row, and ``seq_lens_cpu`` = max model length for every row. The
kernels only size grids and tune from the host lists and read exact lengths from the device
tensors (see ``pagedmodel/kernels/attention_metadata.py``), so the Triton split-KV count is the one chosen
for max-model-len contexts, whatever this step's longest context is, and stays exact.

Padding rows (``b <= i < padded``): token 0 at position 0, slot ``-1`` (the cache-write kernels
skip it, so padding never touches the KV cache), sequence length 1. Their block-table row keeps
whatever an earlier step left there: a length-1 row reads only column 0, and every value ever
stored in the buffer is a valid block id (or the initial 0). Real rows' columns past this step's
widest table also keep older values; kernels never read past a row's own length unmasked.

The graph mechanics are injectable (``GraphBackend``): ``CudaGraphBackend`` wraps
``torch.cuda.CUDAGraph``; ``EmulatedGraphBackend`` is a CPU stand-in that records the captured
callable and re-runs it on replay. The callable closes over the static buffers and the
capture-time metadata only, so on CPU the tests check the buffer handling, padding, ladder and
fallbacks end to end. What the stand-in cannot prove: that capture sees no host-device sync
(CUDA itself refuses one during capture), the memory pool's sharing, stream ordering, and that
kernels were compiled before capture (the CUDA path warms up on a side stream first). Those need
a GPU: ``benchmarks/gpu_kernels.py`` exercises them.
"""
from __future__ import annotations

import bisect
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch

from pagedmodel.kernels.attention_metadata import AttentionMetadata
from pagedmodel.kernels.backend import AttentionBackend

log = logging.getLogger("pagedmodel.cuda_graphs")

# Test-only switch: "emulate" runs decode through the CPU stand-in on any device, "off" disables
# graphs as --enforce-eager does, unset/"auto" captures real graphs on CUDA only.
GRAPHS_ENV = "PAGEDMODEL_CUDA_GRAPHS"
GRAPHS_ENV_VALUES = ("auto", "emulate", "off")
MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> list[int]:
    """The batch-size ladder for ``max_num_seqs`` (see the module docstring)."""
    if max_num_seqs < 1 or limit < 1:
        raise ValueError(f"max_num_seqs and limit must be >= 1, got {max_num_seqs} and {limit}")
    top = min(max_num_seqs, limit)
    sizes = [s for s in (1, 2, 4, 8) if s <= top] + list(range(16, top + 1, 8))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


# ---- graph mechanics -----------------------------------------------------------------------

class Graph(Protocol):
    def capture(self, fn: Callable[[], None]) -> None:
        """Record ``fn`` (its device work, reading and writing only tensors that outlive the graph)."""

    def replay(self) -> None:
        """Run what was recorded again, on whatever those tensors hold now."""


class GraphBackend(Protocol):
    name: str

    def new_graph(self) -> Graph:
        """A fresh graph; every graph of one backend shares one memory pool."""

    def free_memory(self) -> int | None:
        """Free device bytes now (to measure what capture cost), None where not measurable."""


class _CudaGraph:
    def __init__(self, owner: "CudaGraphBackend"):
        self._owner = owner
        self._graph: torch.cuda.CUDAGraph | None = None

    def capture(self, fn: Callable[[], None]) -> None:
        if self._graph is not None:
            raise RuntimeError("this graph is already captured")
        device, stream = self._owner.device, self._owner.stream
        # Warm up on the capture stream first: Triton compiles its kernels and cuBLAS picks its
        # algorithms on first use, and neither may happen inside a capture.
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._owner.pool, stream=stream):
            fn()
        torch.cuda.synchronize(device)
        self._graph = graph

    def replay(self) -> None:
        if self._graph is None:
            raise RuntimeError("replay() before capture()")
        self._graph.replay()


class CudaGraphBackend:
    """Real CUDA graphs on one device, all allocating from one pool."""

    name = "cuda"

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}")
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(self.device)

    def new_graph(self) -> Graph:
        return _CudaGraph(self)

    def free_memory(self) -> int | None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # count what capture holds, not blocks the allocator merely caches
        return torch.cuda.mem_get_info(self.device)[0]


class _EmulatedGraph:
    def __init__(self) -> None:
        self._fn: Callable[[], None] | None = None
        self.replays = 0

    def capture(self, fn: Callable[[], None]) -> None:
        if self._fn is not None:
            raise RuntimeError("this graph is already captured")
        fn()  # as the CUDA path's warm-up does: a callable that can't run fails at capture time
        self._fn = fn

    def replay(self) -> None:
        if self._fn is None:
            raise RuntimeError("replay() before capture()")
        self.replays += 1
        self._fn()


class EmulatedGraphBackend:
    """CPU stand-in for tests: replay re-runs the recorded callable (see the module docstring
    for what that can and cannot prove)."""

    name = "emulated"

    def new_graph(self) -> Graph:
        return _EmulatedGraph()

    def free_memory(self) -> int | None:
        return None


def select_graph_backend(device: torch.device | str, attention: AttentionBackend, enforce_eager: bool,
                         env: str | None = None) -> GraphBackend | None:
    """Which graphs decode uses: none with ``enforce_eager``, the stand-in when ``GRAPHS_ENV`` says
    ``emulate`` (tests), real ones on CUDA with the Triton backend, none otherwise."""
    choice = (os.environ.get(GRAPHS_ENV, "") if env is None else env).strip().lower() or "auto"
    if choice not in GRAPHS_ENV_VALUES:
        raise ValueError(f"{GRAPHS_ENV} must be one of {GRAPHS_ENV_VALUES}, got {choice!r}")
    if enforce_eager or choice == "off":
        return None
    if choice == "emulate":
        return EmulatedGraphBackend()
    device = torch.device(device)
    if device.type != "cuda":
        return None
    if attention.name != "triton":
        # the torch path syncs with the host (it filters -1 slots by value), which capture forbids
        log.warning("CUDA graphs need the Triton attention backend, not %r: decode runs eagerly", attention.name)
        return None
    return CudaGraphBackend(device)


# ---- the runner ----------------------------------------------------------------------------

@dataclass
class GraphRunnerStats:
    sizes: list[int]
    capture_seconds: float = 0.0
    capture_bytes: int | None = None                          # device memory capture took (None on CPU)
    replays: Counter = field(default_factory=Counter)         # padded size -> steps replayed
    eager_steps: Counter = field(default_factory=Counter)     # reason -> steps run eagerly instead


class CUDAGraphRunner:
    """Captures the decode forward for each size of ``sizes`` and replays it for decode batches.

    ``run`` returns the hidden states of the step's rows, or ``None`` when the step is not
    eligible (a row with more than one new token, more rows than the largest graph, a block
    table wider than max-model-len allows); the caller then runs the model eagerly.
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], attention: AttentionBackend,
                 graphs: GraphBackend, *, block_size: int, max_model_len: int, sizes: Sequence[int],
                 device: torch.device | str):
        sizes = list(sizes)
        if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes) or sizes != sorted(set(sizes)):
            raise ValueError(f"capture sizes must be distinct positive ints in increasing order, got {sizes}")
        if block_size < 1 or max_model_len < 1:
            raise ValueError(f"block_size and max_model_len must be >= 1, got {block_size} and {max_model_len}")
        if not kv_caches:
            raise ValueError("no KV cache layers to capture against")
        self.model = model
        self.attention = attention
        self.graphs = graphs
        self.device = torch.device(device)
        self.max_model_len = max_model_len
        self.sizes = sizes
        # Bound at capture: a graph keeps the addresses it was recorded with, so replays must use
        # these very tensors even if someone later swaps the list's entries.
        self._kv_caches = list(kv_caches)
        self._max_blocks = -(-max_model_len // block_size)
        params = next(model.parameters())
        largest = sizes[-1]
        hidden_size = int(model.config.hidden_size)
        dev = self.device
        with torch.inference_mode():
            self._input_ids = torch.zeros(largest, dtype=torch.long, device=dev)
            self._positions = torch.zeros(largest, dtype=torch.long, device=dev)
            self._slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=dev)
            self._seq_lens = torch.ones(largest, dtype=torch.int32, device=dev)
            self._query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=dev)
            self._block_tables = torch.zeros(largest, self._max_blocks, dtype=torch.int32, device=dev)
            self._hidden = torch.zeros(largest, hidden_size, dtype=params.dtype, device=dev)
        self._metas = {size: self._static_meta(size) for size in sizes}
        self._graphs: dict[int, Graph] = {}
        self.stats = GraphRunnerStats(sizes=list(sizes))

    def _static_meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self._slot_mapping[:size],
            query_start_loc=self._query_start_loc[:size + 1],
            seq_lens=self._seq_lens[:size],
            block_tables=self._block_tables[:size],
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[self.max_model_len] * size,  # an upper bound: see the module docstring
        )

    def _forward(self, size: int) -> None:
        hidden = self.model(self._input_ids[:size], self._positions[:size], self._kv_caches,
                            self._metas[size], self.attention)
        self._hidden[:size].copy_(hidden)

    @torch.inference_mode()
    def capture(self) -> GraphRunnerStats:
        """Record one graph per size (once, after the KV cache is allocated). The static buffers
        hold padding rows throughout (every slot -1), so warm-up runs write nothing to the cache."""
        if self._graphs:
            raise RuntimeError("graphs are already captured")
        free_before = self.graphs.free_memory()
        start = time.perf_counter()
        for size in reversed(self.sizes):  # largest first: the shared pool is sized once
            graph = self.graphs.new_graph()
            graph.capture(lambda size=size: self._forward(size))
            self._graphs[size] = graph
        self.stats.capture_seconds = time.perf_counter() - start
        free_after = self.graphs.free_memory()
        if free_before is not None and free_after is not None:
            self.stats.capture_bytes = free_before - free_after
        log.info("captured %d %s decode graphs (batch sizes %s) in %.2f s, %s", len(self.sizes), self.graphs.name,
                 _ladder_text(self.sizes), self.stats.capture_seconds,
                 "n/a memory" if self.stats.capture_bytes is None
                 else f"{self.stats.capture_bytes / 2**20:.1f} MiB of device memory")
        return self.stats

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured size a batch of ``num_seqs`` rows runs at, None if above the ladder."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Hidden states ``[b, hidden]`` of a pure-decode step from its graph, or None (run eagerly).
        The result is a view of the static output: valid until the next ``run``."""
        if not self._graphs:
            raise RuntimeError("run() before capture()")
        num_seqs = meta.num_seqs
        reason = self._ineligible(input_ids, meta)
        if reason is not None:
            self.stats.eager_steps[reason] += 1
            return None
        padded = self.padded_size(num_seqs)
        if padded is None:
            self.stats.eager_steps["batch above the largest graph"] += 1
            return None
        width = meta.block_tables.shape[1]
        self._input_ids[:num_seqs].copy_(input_ids)
        self._positions[:num_seqs].copy_(positions)
        self._slot_mapping[:num_seqs].copy_(meta.slot_mapping)
        self._seq_lens[:num_seqs].copy_(meta.seq_lens)
        self._block_tables[:num_seqs, :width].copy_(meta.block_tables)
        if padded > num_seqs:  # rows a larger batch left behind must not write its slots again
            self._input_ids[num_seqs:padded].zero_()
            self._positions[num_seqs:padded].zero_()
            self._slot_mapping[num_seqs:padded].fill_(-1)
            self._seq_lens[num_seqs:padded].fill_(1)
        self._graphs[padded].replay()
        self.stats.replays[padded] += 1
        return self._hidden[:num_seqs]

    def _ineligible(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> str | None:
        if meta.num_seqs == 0 or not meta.is_all_decode:
            return "not a pure decode step"
        if input_ids.shape[0] != meta.num_seqs:
            raise ValueError(f"a decode step has one token per row: {input_ids.shape[0]} ids for "
                             f"{meta.num_seqs} sequences")
        if meta.block_tables.shape[1] > self._max_blocks:
            return "block table wider than max-model-len"
        return None


def _ladder_text(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes)) if len(sizes) <= 8 else f"{', '.join(map(str, sizes[:5]))}, ..., {sizes[-1]}"


__all__ = ["CUDAGraphRunner", "GraphRunnerStats", "Graph", "GraphBackend", "CudaGraphBackend",
           "EmulatedGraphBackend", "select_graph_backend", "capture_sizes", "GRAPHS_ENV", "MAX_CAPTURE_SIZE"]

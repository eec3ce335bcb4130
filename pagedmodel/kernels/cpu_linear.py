"""Linear layers with oneDNN-prepacked weights: the CPU path for the model's projections and head.

Why: at the engine's shapes (M = tokens in the step, K/N = 576/960/1536/3072/49,152) oneDNN's matmul
over a weight reordered once into its blocked layout beats ``F.linear``, which re-reads the row-major
weight on every call. This is what vLLM's CPU backend does for unquantized linears on x86 (a
prepacked oneDNN matmul handle per layer).

- float32 (any x86 CPU; measured on an AVX2 EPYC): 15-50 % faster on the large weights once a step
  has more than a few rows; for one row it is slower, so steps under ``MIN_ROWS[float32]`` rows keep
  ``F.linear`` (the weight stays, so both paths are exact float32 GEMMs).
- bfloat16, only where the CPU has native bf16 (AMX or AVX512-BF16, ``cpu_features``): the packed
  layout is what AMX's tiles read, 1.3-1.8x faster than ``F.linear`` at 1-64 rows on every weight
  (a Sapphire-Rapids-class Xeon, one thread; the 49,152-wide head 16.4 -> 12.4 ms at one row, 21.6 ->
  12.5 ms at 64), so every step uses it.
- bfloat16 has four GEMMs, and which is fastest depends on the CPU more than on its flags, so
  ``cpu_linear_plan.py`` keeps a ``LinearPlan`` for each CPU family (or measures them here when
  asked): oneDNN's bf16 GEMM over its packed copy; a float32 packed copy of the weight
  (steps of at least ``FLOAT32_GEMM_MIN_ROWS`` rows cast their input to float32, multiply there and
  cast back; the head keeps float32 logits), which paid 1.3-1.4x at 64 rows on an Emerald Rapids
  guest without AMX and costs 2x on an AMD EPYC with the same flags; and our op
  (``cpu_bf16_linear.cpp``, AVX-512) over a panel-packed copy, which widens the bf16 weights in
  registers and multiplies in float32: per decode step of SmolLM2-135M on the Emerald Rapids guest
  (one thread, 300-token contexts) 8 rows 92 -> 67 ms and 16 rows 125 -> 90 ms against oneDNN's bf16
  GEMM, while on the EPYC it wins only at one row. A layer keeps only the copies its plan uses.

oneDNN builds (and caches) a primitive for every input shape it meets, about a megabyte each with
its scratchpad: serving, where the rows of a step take every value from 1 to max-num-batched-tokens,
grew a bf16 engine's RSS by 335 MiB in 15 minutes and a sweep over 800 row counts by 2-3 GiB. So
the rows are padded up to a bucket (``padded_rows``: exact to 8, then multiples of 8 to 64, then
steps of an eighth of the power of two below; at most 12.5 % extra rows past 64), which bounds the
shapes to about 70 per weight.

The reorder needs a CPU tensor and torch built with mkldnn; anything else keeps the plain layers.
``PAGEDMODEL_CPU_LINEAR=packed|measure|bf16|float32|off`` (default ``packed`` where it applies: bf16 GEMMs
as the CPU family's plan says): ``measure`` times the candidates at load, ``bf16`` packs with oneDNN's bf16
GEMM alone (no float32 copies, no panels), ``float32`` takes the fixed split tuned on the Emerald Rapids
guest, ``off`` keeps the plain layers.
"""
from __future__ import annotations

import logging
import os
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_features, cpu_isa, cpu_ops, huge_pages
from .cpu_linear_plan import LinearPlan, choose_plans, default_plan
from .cpu_weight_layouts import pack_amx_tiles, pack_panels

log = logging.getLogger("pagedmodel.kernels.cpu_linear")

LINEAR_ENV = "PAGEDMODEL_CPU_LINEAR"
LINEAR_ENV_VALUES = ("packed", "measure", "bf16", "float32", "off")
# below this many rows F.linear's unpacked GEMM is as fast or faster (measured at M = 1)
MIN_ROWS = {torch.float32: 8, torch.bfloat16: 1}
AVX512_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl"})   # what cpu_bf16_linear.cpp vectorizes with
AMX_FLAGS = frozenset({"amx_tile", "amx_bf16"})   # what cpu_amx_linear.cpp runs on
HUGE_PAGE_BATCH = 64 << 20          # bytes of packed copies moved at a time: the extra memory while they move


def _choice(env: str | None = None) -> str:
    choice = (os.environ.get(LINEAR_ENV, "") if env is None else env).strip().lower() or "packed"
    if choice not in LINEAR_ENV_VALUES:
        raise ValueError(f"{LINEAR_ENV} must be one of {LINEAR_ENV_VALUES}, got {choice!r}")
    return choice


def enabled(env: str | None = None) -> bool:
    return _choice(env) != "off"


def bf16_plans(weights: list[torch.Tensor]) -> dict[tuple[int, int], LinearPlan]:
    """A ``LinearPlan`` for each shape of these weights: for bf16 weights the CPU family's plan, or as the env
    says (``cpu_linear_plan.py``); none for float32 weights (``PackedLinear`` needs none)."""
    weights = [w for w in weights if w.dtype == torch.bfloat16]
    level = cpu_ops.level()
    return choose_plans(weights, _choice(), cpu_ops.bf16_linear() if bf16_panels() else None, amx_tiles_op(),
                        default=default_plan(cpu_isa.cpu_vendor(), None if level is None else level.name))


class Packing(NamedTuple):
    count: int                                  # layers replaced
    plans: dict[tuple[int, int], LinearPlan]    # by bf16 weight shape, for layers packed later (a tied head)

    def plan_for(self, weight: torch.Tensor) -> LinearPlan:
        return self.plans.get(tuple(weight.shape), LinearPlan())


def bf16_panels(flags: frozenset[str] | None = None) -> bool:
    """Whether small bf16 steps can go through ``cpu_bf16_linear.cpp``: the loaded build of the CPU ops (or
    ``flags``) has the AVX-512 it is vectorized for."""
    if not AVX512_FLAGS <= (cpu_ops.level_flags() if flags is None else flags):
        return False
    return cpu_ops.bf16_linear() is not None


def amx_tiles_op(flags: frozenset[str] | None = None) -> Callable[..., torch.Tensor] | None:
    """``cpu_amx_linear.cpp``'s op where the loaded build of the CPU ops (or ``flags``) has AMX-BF16, else None."""
    if not AMX_FLAGS <= (cpu_ops.level_flags() if flags is None else flags):
        return None
    return cpu_ops.amx_linear()


def applies(weight: torch.Tensor, native_bf16: bool | None = None) -> bool:
    """Whether oneDNN can prepack this weight here and it pays: a 2-D CPU weight, torch built with
    mkldnn, float32, or bfloat16 on a CPU with native bf16 (elsewhere oneDNN would emulate it)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    if weight.dtype != torch.bfloat16:
        return False
    native = cpu_features.has_native_bf16() if native_bf16 is None else native_bf16
    return native and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def padded_rows(rows: int) -> int:
    """The row count a step of ``rows`` rows is computed at (see the module docstring)."""
    if rows <= 8:
        return rows
    step = 8 if rows <= 64 else 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


class PackedLinear(nn.Module):
    """``y = x @ weight.T + bias`` through a oneDNN-packed copy of ``weight`` for steps of at least
    ``MIN_ROWS[dtype]`` rows; bf16 weights follow ``plan``: the panel op for steps of up to
    ``plan.panel_max_rows`` rows, a float32 packed copy from ``plan.float32_min_rows`` rows.
    ``float_output``: those two paths return float32 (the head)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, plan: LinearPlan = LinearPlan(),
                 float_output: bool = False):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = bias
        bf16 = self.weight.dtype == torch.bfloat16
        self.plan = plan if bf16 else LinearPlan()
        self._panel_op = cpu_ops.bf16_linear() if self.plan.panel_max_rows else None
        if self.plan.panel_max_rows and self._panel_op is None:
            raise RuntimeError("a plan with the panel op, but the CPU ops extension is not loaded")
        self._amx_op = amx_tiles_op() if self.plan.amx_max_rows else None
        if self.plan.amx_max_rows and self._amx_op is None:
            raise RuntimeError("a plan with the AMX op, but this CPU or the CPU ops extension lacks it")
        reorder = torch.ops.mkldnn._reorder_linear_weight
        float32_copy = self.plan.float32_min_rows is not None
        with torch.no_grad():
            self.panels = pack_panels(self.weight.detach()) if self._panel_op is not None else None
            self.amx_tiles = pack_amx_tiles(self.weight.detach()) if self._amx_op is not None else None
            self.packed = reorder(self.weight.detach(), None) if self.plan.needs_bf16_pack() else None
            self.packed32 = reorder(self.weight.detach().float(), None) if float32_copy else None
            # the paths that add the bias in float32 (the ops would widen a bf16 bias on every call)
            float32_paths = self.panels is not None or self.amx_tiles is not None or float32_copy
            self.bias32 = bias.detach().float() if float32_paths and bias is not None else None
        self.min_rows = MIN_ROWS[self.weight.dtype]
        self.float_output = float_output
        self.out_features = self.weight.shape[0]   # a plain int: the weight is a parameter, slow to reach per call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():   # a compiled forward: inductor packs the weight itself
            return F.linear(x, self.weight, self.bias)
        rows = x.shape[0] if x.dim() == 2 else 0
        if rows < self.min_rows:
            return F.linear(x, self.weight, self.bias)
        plan = self.plan
        if rows <= plan.panel_max_rows:   # neither op builds a primitive per shape: no padding
            return self._panel_op(x, self.panels, self.out_features, self.bias32, self.float_output)
        if rows <= plan.amx_max_rows:
            return self._amx_op(x, self.amx_tiles, self.out_features, self.bias32, self.float_output)
        wide = self.packed32 is not None and rows >= plan.float32_min_rows
        padded = padded_rows(rows)
        if padded != rows:   # the extra rows' outputs are computed and dropped
            buf = x.new_empty(padded, x.shape[1], dtype=torch.float32 if wide else x.dtype)
            buf[:rows] = x   # the cast, if any, in the same copy
            buf[rows:].zero_()   # only the padding: zeroing all of a prefill's rows first cost 30 ms per prompt
            x = buf
        elif wide:
            x = x.float()
        if wide:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed32, self.bias32, "none", [], "")
            if not self.float_output:
                y = y.to(self.weight.dtype)
        else:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return y if padded == rows else y[:rows]


def pack_linears(model: nn.Module, extra_weights: tuple[torch.Tensor, ...] = ()) -> Packing:
    """Replaces every CPU ``nn.Linear`` that ``applies`` in ``model`` by a ``PackedLinear`` sharing its parameters;
    plans ``extra_weights`` too (and counts them in the float32 copies' budget) for the caller to pack."""
    if not enabled():
        return Packing(0, {})
    targets = [(name, mod) for name, mod in model.named_modules() if type(mod) is nn.Linear and applies(mod.weight)]
    packing = Packing(len(targets), bf16_plans([mod.weight for _, mod in targets] + list(extra_weights)) if targets else {})
    for name, mod in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, PackedLinear(mod.weight, mod.bias, plan=packing.plan_for(mod.weight)))
    if targets:
        log.info("%d linear layers use oneDNN-prepacked weights (%s=off turns it off)", len(targets), LINEAR_ENV)
    return packing


def place_on_huge_pages(model: nn.Module) -> int:
    """Moves the packed copies our ops stream (panels, AMX tiles) of every ``PackedLinear`` in ``model`` onto
    2 MB pages (``huge_pages.py``: a decode step reads all of them, and on 4 KB pages each 4 KB is a TLB
    miss), ``HUGE_PAGE_BATCH`` bytes at a time so the move never holds a second copy of the whole model.
    oneDNN's packed weights are opaque tensors and stay where they are. Returns the bytes moved."""
    if not huge_pages.available():
        return 0
    slots = [(mod, name) for mod in model.modules() if isinstance(mod, PackedLinear)
             for name in ("panels", "amx_tiles") if getattr(mod, name) is not None]
    moved, batch, batch_bytes = 0, [], 0
    for i, (mod, name) in enumerate(slots):
        batch.append((mod, name))
        batch_bytes += getattr(mod, name).nbytes
        if batch_bytes >= HUGE_PAGE_BATCH or i == len(slots) - 1:
            for (owner, attr), copy in zip(batch, huge_pages.gather([getattr(m, n) for m, n in batch])):
                setattr(owner, attr, copy)
            moved, batch, batch_bytes = moved + batch_bytes, [], 0
    huge_pages.return_freed_memory()
    return moved

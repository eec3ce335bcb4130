"""Which GEMM a bf16 linear layer uses for a step of a given number of rows: a plan for each CPU family,
or one measured on this CPU when asked.

The fastest of the bf16 paths differs by CPU far more than any flag tells. On an Emerald Rapids guest
(AVX512-BF16, no AMX) oneDNN's bf16 GEMM ran at 75 GFLOP/s against 110-147 for its float32 GEMM over a
float32 copy of the weight, and our panel op (``cpu_bf16_linear.cpp``) beat oneDNN's bf16 GEMM at 8 and 16
rows. On an AMD EPYC with the same flags oneDNN's bf16 GEMM is twice as fast as the float32 copy at 64 rows
and beats the panel op from 4 rows on; only at one or two rows does the panel op win (1.1-1.8x, the
49,152-wide head most). On AMX Xeons our AMX op wins at 1-64 rows on every shape. A rule tuned on one
machine cost another up to 2x on every linear.

``default_plan`` is that table: the plan for the CPU's vendor and the loaded build's level, with no
measuring at load. Measuring at every start took 5-6 s of a 15 s start, and on a busy machine its
timings were noisy enough that the plans changed from start to start. ``PAGEDMODEL_CPU_LINEAR=measure``
times the candidates on each of the model's weight shapes at a few row counts instead (``choose_plans``,
``plan_from``), and logs the timings and the plans: the way to find the plan for a CPU family the table
does not know.

``PAGEDMODEL_CPU_LINEAR`` also takes ``bf16`` (oneDNN's bf16 GEMM alone) and ``float32`` (the fixed split
tuned on the Emerald Rapids guest: the panel op below ``FLOAT32_GEMM_MIN_ROWS`` rows, float32 copies from
there).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .cpu_weight_layouts import pack_amx_tiles, pack_panels

log = logging.getLogger("pagedmodel.kernels.cpu_linear")

FLOAT32_GEMM_MIN_ROWS = 32          # float32 copies, where they pay, serve steps of at least this many rows
FLOAT32_COPY_BUDGET = 4 << 30       # bytes of float32 weight copies a model may add
AMX_COPY_BUDGET = 4 << 30           # bytes of AMX tile copies (bf16, beside oneDNN's packed copy) a model may add
MEASURED_ROWS = (1, 2, 4, 8, 16, 32, 64)
PANEL_ROWS_LIMIT = 16               # the panel op is measured (and used) up to here, or up to the float32 split
FLOAT32_MARGIN = 0.85               # float32 copies cost 4 bytes a parameter: take them only for a clear win
# oneDNN takes rows from the AMX op only when clearly faster: the measurement repeats one weight, hot in
# cache, where oneDNN looks its best; in a step the weights stream from DRAM, where the AMX op's
# prefetching wins (30 layers' linears streamed on an AMX Xeon: 22.0 against 50.7 ms at 32 rows, 35.9
# against 41.3 at 64, where hot-weight timings had the two within 5 % and flipped from load to load)
AMX_MARGIN = 0.85
MIN_TIMED_SECONDS = 2e-3            # each measurement repeats a call for at least this long
TIMING_ROUNDS = 5                   # rounds of measurements, the candidates in turn; each keeps its best


@dataclass(frozen=True)
class LinearPlan:
    """The GEMM for each step size of a bf16 ``PackedLinear``; the rows no rule claims use oneDNN's bf16 GEMM."""
    panel_max_rows: int = 0                 # steps of 1..panel_max_rows rows: the panel op (0: never)
    float32_min_rows: int | None = None     # steps of at least this many rows: a float32 copy (None: never)
    amx_max_rows: int = 0                   # steps past the panel op's up to this many rows: the AMX op (0: never)

    def needs_bf16_pack(self) -> bool:
        """Whether some row count is left to oneDNN's bf16 GEMM (else its packed copy is not made)."""
        small = max(self.panel_max_rows, self.amx_max_rows)
        return self.float32_min_rows is None or small < self.float32_min_rows - 1

    def describe(self) -> str:
        parts = [f"panel op for 1-{self.panel_max_rows} rows"] if self.panel_max_rows else []
        if self.amx_max_rows > self.panel_max_rows:
            parts.append(f"AMX op for {self.panel_max_rows + 1}-{self.amx_max_rows} rows")
        if self.needs_bf16_pack():
            parts.append("oneDNN bf16 GEMM" + (" for the rest" if parts else ""))
        if self.float32_min_rows is not None:
            parts.append(f"float32 GEMMs from {self.float32_min_rows} rows")
        return ", ".join(parts)


FIXED_FLOAT32_SPLIT = LinearPlan(panel_max_rows=FLOAT32_GEMM_MIN_ROWS - 1, float32_min_rows=FLOAT32_GEMM_MIN_ROWS)

Timings = dict[str, dict[int, float]]   # candidate ("bf16", "float32", "panel", "amx") -> rows -> seconds a call


def plan_from(timings: Timings) -> LinearPlan:
    """The plan these timings call for: float32 copies from ``FLOAT32_GEMM_MIN_ROWS`` rows if they beat the
    bf16 GEMM clearly at the largest measured step; the panel op for the smallest steps while it beats the
    bf16 GEMM and the AMX op at each measured row count (and right up to the float32 split if it wins up
    to its limit); then the AMX op while it beats what would serve each measured count (``amx_rows``)."""
    bf16, float32, panel = timings["bf16"], timings.get("float32", {}), timings.get("panel", {})
    amx = timings.get("amx", {})
    largest = max(bf16)
    use_float32 = largest in float32 and float32[largest] < FLOAT32_MARGIN * bf16[largest]
    panel_max = 0
    for rows in sorted(r for r in bf16 if r <= PANEL_ROWS_LIMIT):
        if rows not in panel or panel[rows] >= min(bf16[rows], amx.get(rows, float("inf"))):
            break
        panel_max = rows
    if use_float32 and panel_max == PANEL_ROWS_LIMIT:
        panel_max = FLOAT32_GEMM_MIN_ROWS - 1   # no bf16 copy just for the rows between the two
    return LinearPlan(panel_max_rows=panel_max, float32_min_rows=FLOAT32_GEMM_MIN_ROWS if use_float32 else None,
                      amx_max_rows=amx_rows(timings, panel_max, use_float32))


def amx_rows(timings: Timings, panel_max: int, use_float32: bool) -> int:
    """The largest measured row count up to which the AMX op holds, at every measured count past the panel
    op's, against the GEMM the plan would use otherwise: no rival is faster by ``AMX_MARGIN`` (0: never, or
    not measured)."""
    amx, best = timings.get("amx", {}), 0
    for rows in sorted(r for r in timings["bf16"] if r > panel_max):
        rivals = [timings["bf16"][rows]]
        if use_float32 and rows >= FLOAT32_GEMM_MIN_ROWS and rows in timings.get("float32", {}):
            rivals.append(timings["float32"][rows])
        if rows not in amx or min(rivals) < AMX_MARGIN * amx[rows]:
            break
        best = rows
    return best


def _seconds_per_call(candidates: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Each candidate's best seconds a call over ``TIMING_ROUNDS`` rounds, the candidates taking turns within
    each round. In turns, a neighbour's burst slows every candidate of one round, and each candidate's best
    round is a quiet one; timed one after another (best of three back-to-back rounds each), a burst could
    sit on one candidate's three rounds, and the plans flipped from load to load on a noisy guest."""
    calls = {}
    for name, fn in candidates.items():
        fn()   # oneDNN builds its primitive for the shape on the first call
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < MIN_TIMED_SECONDS or count < 3:
            fn()
            count += 1
        calls[name] = count
    best = dict.fromkeys(candidates, float("inf"))
    for _ in range(TIMING_ROUNDS):
        for name, fn in candidates.items():
            start = time.perf_counter()
            for _ in range(calls[name]):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / calls[name])
    return best


def measure(out_features: int, in_features: int, panel_op: Callable | None,
            rows_list: tuple[int, ...] = MEASURED_ROWS, float32: bool = True, amx_op: Callable | None = None) -> Timings:
    """Seconds a call of each candidate GEMM takes here on a random bf16 [out_features, in_features] weight
    (``float32``: the float32 copy too)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16)
    reorder, linear = torch.ops.mkldnn._reorder_linear_weight, torch.ops.mkldnn._linear_pointwise
    with torch.inference_mode():
        packed = reorder(weight, None)
        packed32 = reorder(weight.float(), None) if float32 else None
        panels = pack_panels(weight) if panel_op is not None else None
        tiles = pack_amx_tiles(weight) if amx_op is not None else None
        timings: Timings = {"bf16": {}, "float32": {}, "panel": {}, "amx": {}}
        for rows in rows_list:
            x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
            candidates = {"bf16": lambda: linear(x, packed, None, "none", [], "")}
            if packed32 is not None and rows == max(rows_list):   # the plan weighs it at the largest step only
                candidates["float32"] = lambda: linear(x.float(), packed32, None, "none", [], "").to(torch.bfloat16)
            if panels is not None and rows <= PANEL_ROWS_LIMIT:
                candidates["panel"] = lambda: panel_op(x, panels, out_features, None, False)
            if tiles is not None:
                candidates["amx"] = lambda: amx_op(x, tiles, out_features, None, False)
            for name, seconds in _seconds_per_call(candidates).items():
                timings[name][rows] = seconds
    return timings


def default_plan(vendor: str, level: str | None) -> LinearPlan:
    """The plan for a CPU of this vendor (``/proc/cpuinfo``'s vendor_id) running this level of the CPU ops
    (``cpu_isa``), from ``PAGEDMODEL_CPU_LINEAR=measure`` runs on each family (docs/engine.md has the figures)."""
    if level == "amx":                  # AMX Xeons: the AMX op for 1-64 rows on every shape, the head included
        return LinearPlan(amx_max_rows=MEASURED_ROWS[-1])
    if level == "avx512_bf16" and vendor == "GenuineIntel":    # an Emerald Rapids guest that hides AMX
        return FIXED_FLOAT32_SPLIT
    if level in ("avx512_bf16", "avx512"):   # AMD EPYC (Zen 4): the panel op at 1-2 rows, oneDNN above
        return LinearPlan(panel_max_rows=2)
    return LinearPlan()


def available(plan: LinearPlan, panel_op: Callable | None, amx_op: Callable | None, float32_fits: bool) -> LinearPlan:
    """``plan`` without what this process lacks: the panel op, the AMX op, room for float32 copies."""
    return LinearPlan(panel_max_rows=plan.panel_max_rows if panel_op is not None else 0,
                      float32_min_rows=plan.float32_min_rows if float32_fits else None,
                      amx_max_rows=plan.amx_max_rows if amx_op is not None else 0)


def choose_plans(weights: list[torch.Tensor], choice: str, panel_op: Callable | None,
                 amx_op: Callable | None = None, default: LinearPlan = LinearPlan()) -> dict[tuple[int, int], LinearPlan]:
    """A plan for each shape of these bf16 weights under ``PAGEDMODEL_CPU_LINEAR=choice``: ``packed``, the CPU
    family's ``default`` for every shape; ``measure``, each shape measured here, once (a decoder layer's
    projections and the wide head differ)."""
    shapes = sorted({tuple(w.shape) for w in weights})
    fits = sum(w.numel() for w in weights) * 4 <= FLOAT32_COPY_BUDGET
    if amx_op is not None and sum(w.numel() for w in weights) * 2 > AMX_COPY_BUDGET:
        log.warning("AMX tile copies of the linears would pass %d GiB: no AMX op", AMX_COPY_BUDGET >> 30)
        amx_op = None
    if choice == "bf16" or not weights:
        return {shape: LinearPlan() for shape in shapes}
    if choice == "packed":
        plan = available(default, panel_op, amx_op, fits)
        log.info("bf16 linears: %s (this CPU family's plan; PAGEDMODEL_CPU_LINEAR=measure times them here)",
                 plan.describe())
        return {shape: plan for shape in shapes}
    if choice == "float32":
        if not fits:
            log.warning("float32 copies of the linears would pass %d GiB: oneDNN's bf16 GEMM alone",
                        FLOAT32_COPY_BUDGET >> 30)
        plan = (LinearPlan() if not fits else FIXED_FLOAT32_SPLIT if panel_op is not None
                else LinearPlan(float32_min_rows=FLOAT32_GEMM_MIN_ROWS))
        return {shape: plan for shape in shapes}
    plans = {}
    for out_features, in_features in shapes:
        timings = measure(out_features, in_features, panel_op, float32=fits, amx_op=amx_op)   # no copies past the budget
        plans[out_features, in_features] = plan = plan_from(timings)
        log.info("bf16 %dx%d linears (ms a call by rows): %s -> %s", out_features, in_features,
                 "; ".join(f"{name} " + " ".join(f"{r}:{t * 1e3:.3f}" for r, t in by_rows.items())
                           for name, by_rows in timings.items() if by_rows), plan.describe())
    return plans

"""oneDNN-prepacked linears (pagedmodel/kernels/cpu_linear.py): same results as F.linear, used only where they apply."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedmodel.kernels import cpu_linear, cpu_linear_plan, cpu_ops, cpu_weight_layouts
from pagedmodel.kernels.cpu_linear import PackedLinear, pack_linears
from pagedmodel.kernels.cpu_linear_plan import FIXED_FLOAT32_SPLIT, FLOAT32_GEMM_MIN_ROWS, LinearPlan

needs_mkldnn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without mkldnn")


FP32_MIN = cpu_linear.MIN_ROWS[torch.float32]
bf16_packs = pytest.mark.skipif(not cpu_linear.applies(torch.zeros(2, 2, dtype=torch.bfloat16)),
                                reason="no native bf16 on this CPU (AMX / AVX512-BF16): bf16 stays unpacked")


@needs_mkldnn
@pytest.mark.parametrize("rows", [0, 1, FP32_MIN - 1, FP32_MIN, 9, 64, 65, 100, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_matches_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 40, generator=g)
    with torch.inference_mode():
        got = PackedLinear(w, b)(x)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@needs_mkldnn
def test_packed_path_is_taken_from_min_rows(monkeypatch):
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(cpu_linear.torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(1) or real(*a))
    layer = PackedLinear(torch.randn(16, 8))
    layer(torch.randn(FP32_MIN - 1, 8))
    assert calls == []
    layer(torch.randn(FP32_MIN, 8))
    assert calls == [1]


def test_row_buckets_are_few_and_waste_little():
    buckets = {cpu_linear.padded_rows(m) for m in range(1, 4097)}
    assert len(buckets) <= 80   # oneDNN keeps a primitive (~1 MB) per distinct shape
    for m in range(1, 4097):
        p = cpu_linear.padded_rows(m)
        assert p >= m and (p == m if m <= 8 else p - m < 8 if m <= 64 else p <= 1.125 * m)


@bf16_packs
@pytest.mark.parametrize("rows", [1, 5, 64, 77])
def test_bf16_packed_matches_f_linear_from_one_row(rows, monkeypatch):
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(cpu_linear.torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g).bfloat16()
    x = torch.randn(rows, 64, generator=g).bfloat16()
    with torch.inference_mode():
        got = PackedLinear(w)(x)
    assert calls == [1]   # bf16 packs pay from one row on
    torch.testing.assert_close(got.float(), F.linear(x, w).float(), rtol=2e-2, atol=2e-2)


PLANS = {"split": FIXED_FLOAT32_SPLIT, "panel_1": LinearPlan(panel_max_rows=1),
         "bf16": LinearPlan(), "bf16_then_f32": LinearPlan(float32_min_rows=FLOAT32_GEMM_MIN_ROWS),
         "panel_1_amx_64": LinearPlan(panel_max_rows=1, amx_max_rows=64)}
needs_amx = pytest.mark.skipif(not cpu_linear.AMX_FLAGS <= cpu_ops.level_flags(),
                               reason="the loaded CPU ops build has no AMX-BF16 (no AMX on this CPU)")


def _path_for(plan: LinearPlan, rows: int) -> str:
    if rows <= plan.panel_max_rows:
        return "panel"
    if rows <= plan.amx_max_rows:
        return "amx"
    return "float32" if plan.float32_min_rows is not None and rows >= plan.float32_min_rows else "bf16"


@bf16_packs
@pytest.mark.parametrize("rows", [1, 2, FLOAT32_GEMM_MIN_ROWS - 1, FLOAT32_GEMM_MIN_ROWS, 64, 77])
@pytest.mark.parametrize("float_output", [False, True])
@pytest.mark.parametrize("plan_name", sorted(PLANS))
def test_bf16_layers_follow_their_plan(rows, float_output, plan_name, monkeypatch):
    """Each step size takes its plan's GEMM. The panel op and the float32 copy multiply the bf16 values in
    float32 (the bias too), returned as bf16 or, for the head, float32; oneDNN's bf16 GEMM returns bf16.
    A layer keeps only the copies its plan uses."""
    plan = PLANS[plan_name]
    if plan.panel_max_rows and cpu_ops.bf16_linear() is None:
        pytest.fail(f"the CPU ops are not loaded: {cpu_ops.load_error()}")
    if plan.amx_max_rows and cpu_linear.amx_tiles_op() is None:
        pytest.skip("no AMX-BF16 here: no plan would name the AMX op")
    onednn = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(cpu_linear.torch.ops.mkldnn, "_linear_pointwise",
                        lambda x, w, *a: onednn.append(x.dtype) or real(x, w, *a))
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g).bfloat16()
    b = torch.randn(96, generator=g).bfloat16()
    x = torch.randn(rows, 64, generator=g).bfloat16()
    with torch.inference_mode():
        layer = PackedLinear(w, b, plan=plan, float_output=float_output)
        got = layer(x)
    assert (layer.panels is not None) == (plan.panel_max_rows > 0)
    assert (layer.amx_tiles is not None) == (plan.amx_max_rows > 0)
    assert (layer.packed32 is not None) == (plan.float32_min_rows is not None)
    assert (layer.packed is None) == (plan_name == "split")   # the split leaves no rows to the bf16 GEMM
    # the ops add a float32 bias: one widened once, at packing, wherever a path of the plan takes one
    float32_bias_paths = plan.panel_max_rows > 0 or plan.amx_max_rows > 0 or plan.float32_min_rows is not None
    assert (layer.bias32 is not None) == float32_bias_paths
    path = _path_for(plan, rows)
    assert onednn == {"panel": [], "amx": [], "float32": [torch.float32], "bf16": [torch.bfloat16]}[path]
    float32_arithmetic = path != "bf16"
    assert got.shape == (rows, 96)
    assert got.dtype == (torch.float32 if float32_arithmetic and float_output else torch.bfloat16)
    exact = F.linear(x.float(), w.float(), b.float())
    if float32_arithmetic and float_output:
        torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-4)
    elif float32_arithmetic:   # rounded once to bf16 (summation order may move a tie by one ulp)
        torch.testing.assert_close(got.float(), exact.bfloat16().float(), rtol=2 ** -7, atol=1e-4)
    else:
        torch.testing.assert_close(got.float(), exact, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("out_features, in_features", [(96, 64), (50, 33), (31, 7), (960, 576)])
@pytest.mark.parametrize("rows", [0, 1, 7, 8, 9, 17, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_op_is_the_float32_product_of_the_bf16_values(out_features, in_features, rows, bias):
    """``cpu_bf16_linear.cpp`` over ``pack_panels``: partial panels, odd K, row tiles and their
    remainders, bias; float32 out exact to float32, bf16 out rounded once."""
    op = cpu_ops.bf16_linear()
    if op is None:
        pytest.fail(f"the CPU ops are not loaded: {cpu_ops.load_error()}")
    g = torch.Generator().manual_seed(rows * 1000 + in_features)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g) if bias else None
    panels = cpu_weight_layouts.pack_panels(w)
    panel = cpu_weight_layouts.PANEL
    assert panels.shape == (-(-out_features // panel), -(-in_features // 2), 2 * panel)
    exact = F.linear(x.float(), w.float(), b)
    got32 = op(x, panels, out_features, b, True)
    torch.testing.assert_close(got32, exact, rtol=1e-5, atol=1e-4)
    got16 = op(x, panels, out_features, b, False)
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16.float(), exact.bfloat16().float(), rtol=2 ** -7, atol=1e-4)


def test_panel_op_rejects_mismatched_shapes():
    op = cpu_ops.bf16_linear()
    if op is None:
        pytest.fail(f"the CPU ops are not loaded: {cpu_ops.load_error()}")
    panels = cpu_weight_layouts.pack_panels(torch.randn(64, 16).bfloat16())
    with pytest.raises(RuntimeError, match="x has 18 columns"):
        op(torch.randn(2, 18).bfloat16(), panels, 64, None, False)
    with pytest.raises(RuntimeError, match="do not fit"):
        op(torch.randn(2, 16).bfloat16(), panels, 65, None, False)
    with pytest.raises(RuntimeError, match="bias has 3 values"):
        op(torch.randn(2, 16).bfloat16(), panels, 64, torch.zeros(3), False)


def test_panels_need_avx512_and_the_op():
    assert not cpu_linear.bf16_panels(frozenset({"avx2", "avx512_bf16"}))
    assert cpu_linear.bf16_panels(frozenset(cpu_linear.AVX512_FLAGS)) == (cpu_ops.bf16_linear() is not None)


def test_amx_tiles_hold_each_weight_where_the_tile_unit_reads_it():
    """Tile (n, d), row r, column c holds (W[16n + c][32d + 2r], W[16n + c][32d + 2r + 1]); padding is zero."""
    w = torch.arange(1, 40 * 70 + 1, dtype=torch.float32).view(40, 70).bfloat16()   # N, K not whole tiles
    tiles = cpu_weight_layouts.pack_amx_tiles(w)
    assert tiles.shape == (3, 3, 512) and tiles.dtype == torch.int16
    as_bf16 = tiles.view(torch.bfloat16).view(3, 3, 16, 16, 2)
    for n, k in [(0, 0), (17, 33), (39, 69), (31, 64)]:
        assert as_bf16[n // 16, k // 32, (k % 32) // 2, n % 16, k % 2] == w[n, k]
    assert as_bf16[2, :, :, 8:].abs().sum() == 0 and as_bf16[:, 2, 3:].abs().sum() == 0   # rows 40-47, cols 70-95


def _amx_op():
    op = cpu_linear.amx_tiles_op()
    if op is None:
        pytest.fail(f"a CPU with AMX-BF16, but the AMX op is not loaded: {cpu_ops.load_error()}")
    return op


@needs_amx
@pytest.mark.parametrize("out_features, in_features", [(96, 64), (50, 33), (31, 7), (960, 576)])
@pytest.mark.parametrize("rows", [0, 1, 15, 16, 17, 64, 65, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_amx_op_is_the_float32_product_of_the_bf16_values(out_features, in_features, rows, bias):
    """``cpu_amx_linear.cpp`` over ``pack_amx_tiles``: partial tiles in N and K, row tiles and groups of
    four and their remainders, bias; float32 out to float32 precision, bf16 out rounded once."""
    op = _amx_op()
    g = torch.Generator().manual_seed(rows * 1000 + in_features)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16() if bias else None
    tiles = cpu_weight_layouts.pack_amx_tiles(w)
    exact = F.linear(x.float(), w.float(), None if b is None else b.float())
    got32 = op(x, tiles, out_features, b, True)
    assert got32.dtype == torch.float32 and got32.shape == (rows, out_features)
    torch.testing.assert_close(got32, exact, rtol=1e-5, atol=1e-4)
    got16 = op(x, tiles, out_features, b, False)
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16.float(), exact.bfloat16().float(), rtol=2 ** -7, atol=1e-4)


@needs_amx
def test_amx_op_rejects_mismatched_shapes():
    op = _amx_op()
    tiles = cpu_weight_layouts.pack_amx_tiles(torch.randn(64, 40).bfloat16())
    with pytest.raises(RuntimeError, match="x has 70 columns"):
        op(torch.randn(2, 70).bfloat16(), tiles, 64, None, False)
    with pytest.raises(RuntimeError, match="do not fit"):
        op(torch.randn(2, 40).bfloat16(), tiles, 65, None, False)
    with pytest.raises(RuntimeError, match="bias has 3 values"):
        op(torch.randn(2, 40).bfloat16(), tiles, 64, torch.zeros(3), False)
    with pytest.raises(RuntimeError, match="contiguous int16"):
        op(torch.randn(2, 40).bfloat16(), tiles.float(), 64, None, False)


def test_the_amx_op_needs_amx_on_the_cpu():
    assert cpu_linear.amx_tiles_op(frozenset({"avx512f", "avx512_bf16"})) is None


def _timings(bf16: dict, float32: dict, panel: dict) -> cpu_linear_plan.Timings:
    return {"bf16": bf16, "float32": float32, "panel": panel}


ROWS = (1, 2, 4, 8, 16, 64)


def test_the_plan_follows_the_measured_gemms():
    # ms a call, shaped like the two CPUs the module docstring describes
    epyc = _timings(dict(zip(ROWS, (0.12, 0.13, 0.13, 0.21, 0.35, 1.15))),
                    dict(zip(ROWS, (0.21, 0.22, 0.24, 0.40, 0.56, 2.63))),
                    dict(zip(ROWS[:5], (0.09, 0.12, 0.22, 0.40, 0.74))))
    assert cpu_linear_plan.plan_from(epyc) == LinearPlan(panel_max_rows=2)
    emerald = _timings(dict(zip(ROWS, (0.30, 0.31, 0.33, 0.40, 0.60, 2.00))),
                       dict(zip(ROWS, (0.40, 0.41, 0.42, 0.50, 0.70, 1.40))),
                       dict(zip(ROWS[:5], (0.10, 0.12, 0.15, 0.25, 0.50))))
    assert cpu_linear_plan.plan_from(emerald) == FIXED_FLOAT32_SPLIT
    emerald["panel"][8] = 0.45   # the panel op loses at 8 rows: it serves 1-4, oneDNN's bf16 GEMM 5-31
    assert cpu_linear_plan.plan_from(emerald) == LinearPlan(panel_max_rows=4, float32_min_rows=FLOAT32_GEMM_MIN_ROWS)
    del emerald["panel"]   # no panel op here
    assert cpu_linear_plan.plan_from(emerald) == LinearPlan(float32_min_rows=FLOAT32_GEMM_MIN_ROWS)
    close = dict(epyc, float32={64: 1.15 * 0.9})   # a 10 % win is not worth 4 bytes a parameter
    assert cpu_linear_plan.plan_from(close).float32_min_rows is None


def test_the_amx_op_takes_the_rows_it_wins_after_the_panel_op():
    rows = (1, 2, 4, 8, 16, 32, 64)
    amx_xeon = {"bf16": dict(zip(rows, (0.27, 0.26, 0.27, 0.28, 0.28, 0.51, 0.60))),
                "float32": {64: 2.2},
                "panel": dict(zip(rows[:5], (0.16, 0.17, 0.23, 0.38, 0.73))),
                "amx": dict(zip(rows, (0.17, 0.17, 0.18, 0.18, 0.20, 0.26, 0.47)))}
    # ms a call, the 3072x576 gate/up on an AMX Xeon: the panel op wins at 1 row only, AMX from 2 to 64
    assert cpu_linear_plan.plan_from(amx_xeon) == LinearPlan(panel_max_rows=1, amx_max_rows=64)
    amx_xeon["amx"][32] = 0.56   # 9 % behind oneDNN at 32: within the margin, AMX keeps the rows
    assert cpu_linear_plan.plan_from(amx_xeon) == LinearPlan(panel_max_rows=1, amx_max_rows=64)
    amx_xeon["amx"][32] = 0.61   # 16 % behind: oneDNN's bf16 GEMM from 17 rows
    assert cpu_linear_plan.plan_from(amx_xeon) == LinearPlan(panel_max_rows=1, amx_max_rows=16)
    amx_xeon["float32"][64] = 0.35   # a float32 copy clearly faster at 64 takes the steps AMX loses there
    amx_xeon["amx"][32] = 0.26
    assert cpu_linear_plan.plan_from(amx_xeon) == LinearPlan(panel_max_rows=1, amx_max_rows=32,
                                                             float32_min_rows=FLOAT32_GEMM_MIN_ROWS)
    del amx_xeon["panel"], amx_xeon["float32"][64]
    assert cpu_linear_plan.plan_from(amx_xeon) == LinearPlan(amx_max_rows=64)
    amx_xeon["amx"][1] = 0.35   # clearly losing at one row is losing from the start
    assert cpu_linear_plan.plan_from(amx_xeon) == LinearPlan()


def test_candidates_are_timed_in_turns_and_keep_their_best_round(monkeypatch):
    """A burst that slows one candidate's early calls must not decide the plan: the candidates take turns
    round after round, and each keeps its quickest round. (A fake clock: each call advances it by its cost.)"""
    clock, order = {"now": 0.0}, []
    monkeypatch.setattr(cpu_linear_plan.time, "perf_counter", lambda: clock["now"])
    monkeypatch.setattr(cpu_linear_plan, "MIN_TIMED_SECONDS", 0.0)   # three calls a measurement

    def candidate(name, costs):
        def call():
            order.append(name)
            clock["now"] += costs(sum(n == name for n in order))
        return call

    # bursty: 4 ms a call for its first ten (warm-up, calibration, first round, part of the second), then 1 ms
    bursty = candidate("bursty", lambda n: 4e-3 if n <= 10 else 1e-3)
    steady = candidate("steady", lambda n: 2e-3)
    best = cpu_linear_plan._seconds_per_call({"bursty": bursty, "steady": steady})
    assert best == pytest.approx({"bursty": 1e-3, "steady": 2e-3})
    switches = sum(a != b for a, b in zip(order, order[1:]))
    assert switches == 2 * cpu_linear_plan.TIMING_ROUNDS + 1   # warm/calibrate each, then a turn each a round


def test_plans_say_what_they_use():
    assert FIXED_FLOAT32_SPLIT.describe() == "panel op for 1-31 rows, float32 GEMMs from 32 rows"
    assert LinearPlan(panel_max_rows=1).describe() == "panel op for 1-1 rows, oneDNN bf16 GEMM for the rest"
    assert LinearPlan().describe() == "oneDNN bf16 GEMM"
    assert LinearPlan(panel_max_rows=2, amx_max_rows=64).describe() == \
        "panel op for 1-2 rows, AMX op for 3-64 rows, oneDNN bf16 GEMM for the rest"


@bf16_packs
def test_measuring_times_every_candidate_and_plans_each_shape(caplog):
    op, amx = cpu_ops.bf16_linear(), cpu_linear.amx_tiles_op()
    timings = cpu_linear_plan.measure(96, 64, op, rows_list=(1, 4, 64), amx_op=amx)
    assert set(timings["bf16"]) == {1, 4, 64} and set(timings["float32"]) == {64}
    assert set(timings["amx"]) == ({1, 4, 64} if amx is not None else set())
    assert cpu_linear_plan.measure(96, 64, None, rows_list=(1, 64), float32=False)["float32"] == {}
    assert set(timings["panel"]) == ({1, 4} if op is not None else set())
    assert all(t > 0 for by_rows in timings.values() for t in by_rows.values())
    weights = [torch.zeros(96, 64, dtype=torch.bfloat16)] * 2 + [torch.zeros(500, 64, dtype=torch.bfloat16)]
    with caplog.at_level("INFO", logger="pagedmodel.kernels.cpu_linear"):
        plans = cpu_linear_plan.choose_plans(weights, "measure", op)
    assert set(plans) == {(96, 64), (500, 64)}   # each shape once
    for (n, k), plan in plans.items():
        assert f"bf16 {n}x{k} linears" in caplog.text and plan.describe() in caplog.text


def test_the_env_skips_the_measurement_and_the_budget_bounds_float32_copies(monkeypatch):
    monkeypatch.setattr(cpu_linear_plan, "measure", lambda *a, **k: pytest.fail("measured"))
    small, op = [torch.zeros(8, 8, dtype=torch.bfloat16)], object()
    choose = cpu_linear_plan.choose_plans
    assert choose(small, "bf16", op) == {(8, 8): LinearPlan()}
    assert choose(small, "float32", op) == {(8, 8): FIXED_FLOAT32_SPLIT}
    assert choose(small, "float32", None) == {(8, 8): LinearPlan(float32_min_rows=FLOAT32_GEMM_MIN_ROWS)}
    monkeypatch.setattr(cpu_linear_plan, "FLOAT32_COPY_BUDGET", 8 * 8 * 4 - 1)
    assert choose(small, "float32", op) == {(8, 8): LinearPlan()}   # over the memory budget
    wins = _timings({1: 1.0, 64: 2.0}, {64: 1.0}, {})
    monkeypatch.setattr(cpu_linear_plan, "measure",   # as measure does: no float32 timing unless asked
                        lambda *a, float32=True, **k: wins if float32 else {**wins, "float32": {}})
    assert choose(small, "measure", None) == {(8, 8): LinearPlan()}   # float32 wins, but over budget
    monkeypatch.setattr(cpu_linear_plan, "FLOAT32_COPY_BUDGET", 8 * 8 * 4)
    assert choose(small, "measure", None) == {(8, 8): LinearPlan(float32_min_rows=FLOAT32_GEMM_MIN_ROWS)}
    assert cpu_linear.bf16_plans([torch.zeros(8, 8)]) == {}   # float32 weights need none


@pytest.mark.parametrize("vendor, level, plan", [
    ("GenuineIntel", "amx", LinearPlan(amx_max_rows=64)),
    ("GenuineIntel", "avx512_bf16", FIXED_FLOAT32_SPLIT),
    ("AuthenticAMD", "avx512_bf16", LinearPlan(panel_max_rows=2)),
    ("AuthenticAMD", "avx2", LinearPlan()), ("AuthenticAMD", None, LinearPlan())])
def test_each_cpu_family_gets_its_plan_without_measuring(vendor, level, plan, monkeypatch):
    """The default: the same plan at every start, busy machine or not, and no seconds spent timing GEMMs."""
    monkeypatch.setattr(cpu_linear_plan, "measure", lambda *a, **k: pytest.fail("measured"))
    weights = [torch.zeros(8, 8, dtype=torch.bfloat16), torch.zeros(16, 8, dtype=torch.bfloat16)]
    default = cpu_linear_plan.default_plan(vendor, level)
    assert default == plan
    panel, amx = object(), object()
    assert cpu_linear_plan.choose_plans(weights, "packed", panel, amx, default) == {(8, 8): plan, (16, 8): plan}
    lacking = cpu_linear_plan.choose_plans(weights, "packed", None, None, default)[8, 8]   # neither op loaded
    assert lacking.panel_max_rows == lacking.amx_max_rows == 0
    assert lacking.float32_min_rows == plan.float32_min_rows


def test_the_amx_op_is_measured_only_within_its_copies_budget(monkeypatch):
    seen = []
    monkeypatch.setattr(cpu_linear_plan, "measure", lambda *a, amx_op=None, **k: seen.append(amx_op) or
                        _timings({1: 1.0, 64: 2.0}, {}, {}))
    small, amx = [torch.zeros(8, 8, dtype=torch.bfloat16)], object()
    cpu_linear_plan.choose_plans(small, "measure", None, amx)
    monkeypatch.setattr(cpu_linear_plan, "AMX_COPY_BUDGET", 8 * 8 * 2 - 1)
    cpu_linear_plan.choose_plans(small, "measure", None, amx)
    assert seen == [amx, None]


def test_bf16_is_packed_only_with_native_bf16():
    w = torch.zeros(4, 4, dtype=torch.bfloat16)
    assert not cpu_linear.applies(w, native_bf16=False)
    assert cpu_linear.applies(w, native_bf16=True) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert not cpu_linear.applies(torch.zeros(4, 4, dtype=torch.float16), native_bf16=True)


def _net(dtype=torch.float32) -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4, bias=False))).to(dtype)


@needs_mkldnn
def test_pack_linears_replaces_fp32_layers_and_keeps_their_parameters():
    net = _net()
    before = dict(net.named_parameters())
    x = torch.randn(32, 8)
    expected = net(x)
    assert pack_linears(net).count == 2
    assert isinstance(net[0], PackedLinear) and isinstance(net[2][0], PackedLinear)
    assert {k: v.data_ptr() for k, v in net.named_parameters()} == {k: v.data_ptr() for k, v in before.items()}
    with torch.inference_mode():
        torch.testing.assert_close(net(x), expected, rtol=1e-5, atol=1e-5)


def test_pack_linears_leaves_bf16_layers_without_native_bf16_and_honours_off(monkeypatch):
    monkeypatch.setattr(cpu_linear.cpu_features, "has_native_bf16", lambda: False)
    assert pack_linears(_net(torch.bfloat16)).count == 0
    monkeypatch.setenv(cpu_linear.LINEAR_ENV, "off")
    net = _net()
    assert pack_linears(net).count == 0 and type(net[0]) is nn.Linear


def test_a_bad_env_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(cpu_linear.LINEAR_ENV, "fast")
    with pytest.raises(ValueError, match="PAGEDMODEL_CPU_LINEAR must be one of"):
        pack_linears(_net())


@needs_mkldnn
def test_engine_tokens_are_the_same_packed_or_not(tiny_llama_dir, monkeypatch):
    """The engine packs every projection and the tied head, and greedy decoding does not notice."""
    from pagedmodel import LLM, SamplingParams

    prompts = [[1] + [(5 * i + j) % 400 + 10 for j in range(3 + 9 * i)] for i in range(12)]   # 12 rows: packed path
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = {}
    for mode in ("packed", "off"):
        monkeypatch.setenv(cpu_linear.LINEAR_ENV, mode)
        llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", max_model_len=256)
        model = llm.engine.runner.model
        packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
        assert len(packed) == (0 if mode == "off" else 2 * 2 * 2 + 1)   # qkv, o, gate_up, down per layer + head
        assert (model.logits_head is not None) is (mode == "packed")
        runs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert runs["packed"] == runs["off"]


@bf16_packs
def test_a_bf16_engine_told_float32_packs_float32_copies_and_keeps_float32_logits(tiny_llama_dir, monkeypatch):
    from pagedmodel import LLM, SamplingParams

    monkeypatch.setenv(cpu_linear.LINEAR_ENV, "float32")
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="bfloat16", max_model_len=256)
    model = llm.engine.runner.model
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == 2 * 4 + 1 and all(m.packed32 is not None for m in packed)
    assert model.logits_head.float_output
    prompts = [[1] + [(5 * i + j) % 400 + 10 for j in range(3 + 9 * i)] for i in range(20)]   # 20 rows: float32 GEMMs
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    assert model.compute_logits(torch.zeros(20, model.config.hidden_size, dtype=torch.bfloat16)).dtype == torch.float32

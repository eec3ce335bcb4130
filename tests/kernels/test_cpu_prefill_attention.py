"""The bf16 prefill ops (``cpu_prefill_attention.cpp``: on VDPBF16PS, and on AMX tiles) against the
float32 tiled torch path.

Each op is built only where the CPU has its instructions (AVX512-BF16; AMX-BF16); there a missing op
fails these tests, elsewhere they are skipped (the torch path serves and is tested in
test_torch_attention.py).
"""
from __future__ import annotations

import pytest
import torch

from pagedmodel.kernels import cpu_ops, torch_attention

TOL = dict(rtol=2 ** -7, atol=2 ** -7)   # bf16 output; scores and softmax float32 in both
OPS = {   # accessor, the CPU flags its build needs
    "vdpbf16ps": (cpu_ops.bf16_prefill, {"avx512_bf16"}),
    "amx": (cpu_ops.amx_prefill, {"avx512_bf16", "amx_tile", "amx_bf16"}),
}


def _found_or_skip(name: str):
    accessor, flags = OPS[name]
    found = accessor()
    if found is None:
        if flags <= cpu_ops.level_flags():
            pytest.fail(f"the loaded CPU ops build has {sorted(flags)} but the {name} op is missing")
        pytest.skip(f"needs a build of the CPU ops for {sorted(flags)} (loaded: {getattr(cpu_ops.level(), 'name', None)})")
    return found


@pytest.fixture(scope="module", params=sorted(OPS))
def op(request):
    return _found_or_skip(request.param)


def _problem(q_len: int, seq_len: int, block_size: int, q_heads: int, kv_heads: int, head_dim: int,
             seed: int = 0, sharpness: float = 1.0):
    """A bf16 paged cache holding one sequence's context in shuffled blocks (spare blocks of garbage
    around them), and its last q_len positions' queries."""
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-seq_len // block_size)
    cache = (torch.randn(2, blocks + 5, block_size, kv_heads, head_dim, generator=gen) * 3).bfloat16()
    table = torch.randperm(blocks + 5, generator=gen)[:blocks].to(torch.int32)
    query = (torch.randn(q_len, q_heads, head_dim, generator=gen) * sharpness).bfloat16()
    return query, cache, table


@pytest.mark.parametrize("q_len,seq_len,block_size,q_heads,kv_heads,head_dim", [
    (37, 37, 16, 9, 3, 64),      # a whole prompt, rows not a multiple of the 6-row tile, 37 keys (not 32k)
    (20, 85, 128, 9, 3, 64),     # a chunk late in its context, one partial 128-token block
    (64, 64, 16, 4, 4, 128),     # no GQA, head dim 128 (two passes of 64 dims for p.v)
    (7, 100, 16, 8, 2, 64),      # fewer rows than a tile per kv head's group of 4
    (130, 161, 32, 9, 3, 64),    # several 32-key steps, every tile a different visible length
    (16, 16, 16, 9, 3, 64),      # exactly one 16-row AMX block
    (17, 300, 16, 9, 3, 64),     # one row past it, late in a context not a multiple of 64 keys
    (1, 1, 16, 9, 3, 64),        # one token
])
def test_matches_the_float32_tiled_path(op, q_len, seq_len, block_size, q_heads, kv_heads, head_dim):
    query, cache, table = _problem(q_len, seq_len, block_size, q_heads, kv_heads, head_dim)
    scale = head_dim ** -0.5
    got = op(query, cache, table, seq_len, scale)
    expected = torch_attention.prefill_attention_tiled(query.float(), cache.float(), table, seq_len, scale)
    assert got.dtype == torch.bfloat16 and got.shape == query.shape
    torch.testing.assert_close(got.float(), expected, **TOL)


@pytest.mark.parametrize("sharpness", [10.0, 100.0])
def test_peaked_scores(op, sharpness):
    """Scores hundreds apart: the row max must come off before the exp (and the exp clamps far below it)."""
    query, cache, table = _problem(50, 90, 16, 9, 3, 64, seed=3, sharpness=sharpness)
    got = op(query, cache, table, 90, 0.125)
    expected = torch_attention.prefill_attention_tiled(query.float(), cache.float(), table, 90, 0.125)
    assert torch.isfinite(got.float()).all()
    torch.testing.assert_close(got.float(), expected, **TOL)


def test_prefill_attention_takes_the_fastest_op_for_bf16_only():
    """AMX where the CPU has it, else VDPBF16PS; float32 stays on the torch path."""
    name = "amx" if OPS["amx"][1] <= cpu_ops.level_flags() else "vdpbf16ps"
    op = _found_or_skip(name)
    query, cache, table = _problem(40, 70, 16, 9, 3, 64, seed=1)
    assert torch.equal(torch_attention.prefill_attention(query, cache, table, 70, 0.125),
                       op(query, cache, table, 70, 0.125))
    q32, c32 = query.float(), cache.float()
    assert torch.equal(torch_attention.prefill_attention(q32, c32, table, 70, 0.125),
                       torch_attention.prefill_attention_tiled(q32, c32, table, 70, 0.125))


def test_the_two_ops_agree_to_bf16_rounding():
    """Both sum exact bf16 products in float32, in different orders: their outputs differ by at most a
    bf16 rounding step, on a 1,000-token prompt whose later tiles see hundreds of keys."""
    vdp, amx = _found_or_skip("vdpbf16ps"), _found_or_skip("amx")
    query, cache, table = _problem(1000, 1000, 16, 9, 3, 64, seed=5)
    a, b = vdp(query, cache, table, 1000, 0.125).float(), amx(query, cache, table, 1000, 0.125).float()
    assert ((a - b).abs() <= 2 ** -7 * b.abs().clamp_min(1.0)).all()


def test_bad_inputs_are_refused_with_their_reason(op):
    query, cache, table = _problem(10, 40, 16, 9, 3, 64)
    with pytest.raises(RuntimeError, match="10 query rows over a context of 5"):
        op(query, cache, table, 5, 0.125)
    with pytest.raises(RuntimeError, match="needs 4 blocks, the table has 3"):
        op(query, cache, table, 50, 0.125)
    bad_table = table.clone()
    bad_table[1] = 99
    with pytest.raises(RuntimeError, match="block id 99 out of range"):
        op(query, cache, bad_table, 40, 0.125)
    with pytest.raises(RuntimeError, match="head dim must be a multiple of 64"):
        op(query[..., :32].contiguous(), cache[..., :32].contiguous(), table, 40, 0.125)
    with pytest.raises(RuntimeError, match="scale must be positive"):
        op(query, cache, table, 40, 0.0)
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        op(query.float(), cache, table, 40, 0.125)


def test_refused_amx_tiles_leave_the_amx_ops_unused(monkeypatch, caplog):
    """Where a sandbox refuses AMX tile state (arch_prctl) the AMX ops would raise on every call: the probe
    says so, and prefill takes the VDPBF16PS op (or the torch path) instead."""
    def refused(*_args):
        raise RuntimeError("amx_bf16_linear: the kernel refused AMX tile state (arch_prctl)")

    assert not cpu_ops.amx_tiles_permitted(refused)
    assert "AMX tiles refused here" in caplog.text
    monkeypatch.setitem(cpu_ops._state, "amx_permitted", False)
    assert cpu_ops.amx_linear() is None and cpu_ops.amx_prefill() is None
    query, cache, table = _problem(40, 70, 16, 9, 3, 64, seed=2)
    got = torch_attention.prefill_attention(query, cache, table, 70, 0.125)
    vdp = cpu_ops.bf16_prefill()
    expected = (vdp(query, cache, table, 70, 0.125) if vdp is not None
                else torch_attention.prefill_attention_tiled(query, cache, table, 70, 0.125))
    assert torch.equal(got, expected)


def test_the_amx_probe_passes_where_the_op_runs():
    amx = _found_or_skip("amx")
    assert amx is not None and cpu_ops.amx_tiles_permitted(torch.ops.pagedmodel.amx_bf16_linear)

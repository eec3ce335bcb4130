"""The CPU cache write (C++ op where built, index_copy_ otherwise) against a row-by-row oracle."""
from __future__ import annotations

import pytest
import torch

from pagedmodel.kernels import cpu_ops, torch_attention

SENTINEL = 7.0   # every cell starts here; a cell the write must not touch keeps it


def _expected(cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: list[int]) -> torch.Tensor:
    out = cache.clone()
    flat = out.view(2, -1, *cache.shape[3:])
    for t, slot in enumerate(slots):
        if slot >= 0:
            flat[0, slot], flat[1, slot] = key[t], value[t]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,dim", [(1, 64), (3, 64), (2, 128)])
def test_strided_rows_land_in_their_slots_and_padding_is_skipped(op_mode, dtype, heads, dim):
    """k and v as the model passes them: column slices of one fused projection output (strided tokens)."""
    gen = torch.Generator().manual_seed(heads * dim)
    cache = torch.full((2, 6, 16, heads, dim), SENTINEL, dtype=dtype)
    slots = [5, -1, 90, 17, -1, 0, 95]
    fused = torch.randn(len(slots), 3 * heads * dim, generator=gen).to(dtype)
    key = fused[:, heads * dim:2 * heads * dim].view(-1, heads, dim)
    value = fused[:, 2 * heads * dim:].view(-1, heads, dim)
    expected = _expected(cache, key, value, slots)
    torch_attention.write_kv(key, value, cache, torch.tensor(slots))
    assert torch.equal(cache, expected)
    assert int((cache == SENTINEL).sum()) == 2 * (6 * 16 - 5) * heads * dim   # nothing else touched


def test_rows_of_another_dtype_are_converted(op_mode):
    cache = torch.zeros(2, 2, 4, 1, 8, dtype=torch.bfloat16)
    key, value = torch.randn(2, 2, 1, 8).unbind(0)   # float32 rows into a bf16 cache: the torch path converts
    torch_attention.write_kv(key, value, cache, torch.tensor([1, 6]))
    assert torch.equal(cache.view(2, 8, 1, 8)[0, [1, 6]], key.bfloat16())
    assert torch.equal(cache.view(2, 8, 1, 8)[1, [1, 6]], value.bfloat16())


def test_a_strided_slot_mapping_keeps_the_torch_path(op_mode):
    cache = torch.zeros(2, 2, 4, 1, 8)
    key, value = torch.randn(2, 2, 1, 8).unbind(0)
    slots = torch.tensor([[1, 0], [6, 0]])[:, 0]   # a column: int64 but not contiguous, which the op refuses
    torch_attention.write_kv(key, value, cache, slots)
    assert torch.equal(cache.view(2, 8, 1, 8)[0, [1, 6]], key)
    assert torch.equal(cache.view(2, 8, 1, 8)[1, [1, 6]], value)


def test_the_op_refuses_a_slot_past_the_cache_before_writing():
    op = cpu_ops.cache_write()
    assert op is not None, cpu_ops.load_error()
    cache = torch.zeros(2, 2, 4, 1, 8)
    rows = torch.ones(3, 1, 8)
    with pytest.raises(RuntimeError, match="row 2: slot 8 outside the cache's 8 slots"):
        op(rows, rows, cache, torch.tensor([0, 3, 8]))
    assert int(cache.count_nonzero()) == 0
    with pytest.raises(RuntimeError, match="cache's dtype"):
        op(rows.double(), rows, cache, torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="heads must be contiguous"):
        wide = torch.ones(3, 1, 16)
        op(wide[:, :, ::2], rows, cache, torch.tensor([0, 1, 2]))

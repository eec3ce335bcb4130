"""Triton cache write vs the torch oracle (interpreter)."""
from __future__ import annotations

import pytest
import torch

from pagedmodel.kernels import torch_attention
from pagedmodel.kernels.triton_attention import write_kv

SENTINEL = 7.0  # every cell starts here; a cell the kernel must not touch keeps it


def _caches(num_blocks: int, block_size: int, heads: int, dim: int, dtype: torch.dtype):
    cache = torch.full((2, num_blocks, block_size, heads, dim), SENTINEL, dtype=dtype)
    return cache, cache.clone()


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads,dim", [(1, 64), (3, 96), (2, 128)])
def test_matches_oracle_and_skips_minus_one(block_size, heads, dim):
    gen = torch.Generator().manual_seed(block_size * heads)
    tri, ref = _caches(5, block_size, heads, dim, torch.float32)
    num_slots = 5 * block_size
    slots = torch.randperm(num_slots, generator=gen)[:4]
    slots = torch.cat([slots[:2], torch.tensor([-1]), slots[2:], torch.tensor([-1])])
    key = torch.randn(len(slots), heads, dim, generator=gen)
    value = torch.randn(len(slots), heads, dim, generator=gen)
    write_kv(key, value, tri, slots)
    torch_attention.write_kv(key, value, ref, slots)
    assert torch.equal(tri, ref)
    assert int((tri == SENTINEL).sum()) == 2 * (num_slots - 4) * heads * dim  # nothing else touched


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_same_dtype_copies_bit_exactly(dtype):
    tri, ref = _caches(3, 4, 2, 64, dtype)
    key, value = torch.randn(2, 5, 2, 64).to(dtype).unbind(0)
    slots = torch.tensor([0, 5, 11, -1, 2], dtype=torch.int32)
    write_kv(key, value, tri, slots)
    torch_attention.write_kv(key, value, ref, slots.long())
    assert torch.equal(tri, ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_casts_to_the_cache_dtype(dtype):
    tri, ref = _caches(2, 4, 1, 64, dtype)
    key, value = torch.randn(2, 3, 1, 64).unbind(0)
    slots = torch.tensor([1, 6, 3])
    write_kv(key, value, tri, slots)
    torch_attention.write_kv(key, value, ref, slots)
    # the interpreter truncates fp32 -> bf16 where GPUs round to nearest: allow that 1 ulp
    tol = dict(rtol=2 ** -7, atol=0) if dtype == torch.bfloat16 else dict(rtol=0, atol=0)
    torch.testing.assert_close(tri, ref, **tol)


def test_strided_key_value_views():
    # the engine slices k and v out of one fused projection
    fused = torch.randn(4, 6, 64)
    key, value = fused[:, 2:4], fused[:, 4:6]
    tri, ref = _caches(3, 2, 2, 64, torch.float32)
    slots = torch.tensor([5, 0, -1, 3])
    write_kv(key, value, tri, slots)
    torch_attention.write_kv(key, value, ref, slots)
    assert torch.equal(tri, ref)


def test_no_tokens_is_a_no_op():
    tri, _ = _caches(2, 2, 1, 64, torch.float32)
    write_kv(torch.empty(0, 1, 64), torch.empty(0, 1, 64), tri, torch.empty(0, dtype=torch.long))
    assert bool((tri == SENTINEL).all())


def test_rejects_bad_inputs():
    cache, _ = _caches(2, 2, 1, 64, torch.float32)
    kv = torch.zeros(2, 1, 64)
    with pytest.raises(ValueError, match="values must be -1 or in"):
        write_kv(kv, kv, cache, torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="values must be -1 or in"):
        write_kv(kv, kv, cache, torch.tensor([0, -2]))
    with pytest.raises(ValueError, match=r"key must be \[2, 1, 64\]"):
        write_kv(torch.zeros(2, 2, 64), kv, cache, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="slot_mapping must be a 1-D int32/int64"):
        write_kv(kv, kv, cache, torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="kv_cache must be"):
        write_kv(kv, kv, cache[0], torch.tensor([0, 1]))

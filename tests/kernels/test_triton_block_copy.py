"""Triton block copy (copy-on-write) vs the torch oracle (interpreter)."""
from __future__ import annotations

import pytest
import torch

from pagedmodel.kernels import torch_attention
from pagedmodel.kernels.triton_attention import copy_blocks


def _layers(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(num_layers)]


@pytest.mark.parametrize("shape", [
    (2, 6, 4, 2, 64),    # one chunk per block run
    (2, 5, 16, 4, 32),   # 2048 elements: two full chunks
    (2, 4, 5, 3, 96),    # 1440 elements: a partial last chunk
    (2, 3, 1, 1, 64),    # block size 1
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_oracle_in_every_layer(shape, dtype):
    tri = _layers(3, shape, dtype)
    ref = [c.clone() for c in tri]
    pairs = [[0, 2]] + ([[1, shape[1] - 1]] if shape[1] > 3 else [])
    src_dst = torch.tensor(pairs)
    copy_blocks(tri, src_dst)
    torch_attention.copy_blocks(ref, src_dst)
    for a, b in zip(tri, ref):
        assert torch.equal(a, b)
    assert torch.equal(tri[1][:, 2], tri[1][:, 0])


def test_int32_pairs_and_untouched_blocks():
    tri = _layers(2, (2, 6, 2, 1, 64))
    before = [c.clone() for c in tri]
    copy_blocks(tri, torch.tensor([[5, 1], [3, 4]], dtype=torch.int32))
    for now, old in zip(tri, before):
        assert torch.equal(now[:, 1], old[:, 5]) and torch.equal(now[:, 4], old[:, 3])
        for untouched in (0, 2, 3, 5):
            assert torch.equal(now[:, untouched], old[:, untouched])


def test_empty_pairs_is_a_no_op():
    tri = _layers(1, (2, 2, 2, 1, 64))
    before = tri[0].clone()
    copy_blocks(tri, torch.empty(0, 2, dtype=torch.long))
    assert torch.equal(tri[0], before)


def test_rejects_bad_inputs():
    caches = _layers(2, (2, 4, 2, 1, 64))
    with pytest.raises(ValueError, match=r"\[N, 2\]"):
        copy_blocks(caches, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="block ids must be in"):
        copy_blocks(caches, torch.tensor([[0, 4]]))
    with pytest.raises(ValueError, match="distinct and never a source"):
        copy_blocks(caches, torch.tensor([[0, 1], [2, 1]]))
    with pytest.raises(ValueError, match="distinct and never a source"):
        copy_blocks(caches, torch.tensor([[0, 1], [1, 2]]))
    with pytest.raises(ValueError, match="contiguous blocks"):
        copy_blocks([_layers(1, (2, 4, 2, 2, 64))[0].transpose(2, 3)], torch.tensor([[0, 1]]))

"""Backend selection reaches the Triton entry points, and both backends agree end to end on one
step: write this step's K/V, then attend over the cache."""
from __future__ import annotations

import pytest
import torch

from kernel_batches import make_batch
from pagedmodel.kernels import backend, triton_attention


def test_cpu_defaults_to_torch_and_override_picks_triton(monkeypatch):
    monkeypatch.delenv(backend.BACKEND_ENV, raising=False)
    assert backend.select_backend("cpu").name == "torch"
    assert backend.select_backend("cpu").cache_write_is_cpu_op   # the model may fuse rotary with the write
    monkeypatch.setenv(backend.BACKEND_ENV, "triton")
    chosen = backend.select_backend("cpu")
    assert chosen.name == "triton"
    assert not chosen.cache_write_is_cpu_op   # Triton writes its own cache: no CPU op stands in for it
    assert chosen.paged_attention is triton_attention.paged_attention
    assert chosen.write_kv is triton_attention.write_kv
    assert chosen.copy_blocks is triton_attention.copy_blocks


def test_backends_agree_on_a_write_then_attend_step():
    batch = make_batch([1, 4, 3], [6, 4, 9], block_size=4, q_heads=4, kv_heads=2, seed=5)
    meta = batch.meta
    gen = torch.Generator().manual_seed(1)
    new_k = torch.randn(meta.slot_mapping.shape[0], 2, 64, generator=gen)
    new_v = torch.randn(meta.slot_mapping.shape[0], 2, 64, generator=gen)
    results = {}
    for name in ("torch", "triton"):
        impl = backend.select_backend("cpu", override=name)
        cache = batch.kv_cache.clone()
        impl.write_kv(new_k, new_v, cache, meta.slot_mapping)
        results[name] = (cache, impl.paged_attention(batch.query, cache, meta, 0.125))
    assert torch.equal(results["torch"][0], results["triton"][0])
    torch.testing.assert_close(results["triton"][1], results["torch"][1], rtol=1e-5, atol=1e-5)


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="must be 'torch' or 'triton'"):
        backend.select_backend("cpu", override="cuda-magic")

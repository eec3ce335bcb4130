"""Both attention backends stay exact when the metadata's host lists are only upper bounds.

A captured decode graph fixes the host lists at capture (``seq_lens_cpu`` = max model length for
every row, see server/engine/cuda_graph_runner.py) while the device tensors change on every replay. So
the kernels may take grid sizes, gather widths and the split count from the host lists but must
take every length that decides the result from ``seq_lens``. Padding rows as the graph runner
makes them (slot -1, length 1, table row pointing at block 0) must not disturb the real rows.
"""
from __future__ import annotations

import pytest
import torch

from kernel_batches import make_batch
from pagedmodel.kernels import torch_attention, triton_attention
from pagedmodel.kernels.attention_metadata import AttentionMetadata

BLOCK_SIZE = 4
MAX_MODEL_LEN = 48   # 12 table columns: wider than any real sequence below


def _as_captured(meta: AttentionMetadata, padding_rows: int) -> AttentionMetadata:
    """The same decode step as the graph runner would present it: padding rows appended, tables
    widened to max-model-len, host lengths replaced by the upper bound."""
    rows = meta.num_seqs + padding_rows
    width = -(-MAX_MODEL_LEN // BLOCK_SIZE)
    tables = torch.zeros(rows, width, dtype=torch.int32)
    tables[:meta.num_seqs, :meta.block_tables.shape[1]] = meta.block_tables
    return AttentionMetadata(
        slot_mapping=torch.cat([meta.slot_mapping, torch.full((padding_rows,), -1, dtype=torch.int64)]),
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32),
        seq_lens=torch.cat([meta.seq_lens, torch.ones(padding_rows, dtype=torch.int32)]),
        block_tables=tables,
        query_lens_cpu=[1] * rows,
        seq_lens_cpu=[MAX_MODEL_LEN] * rows,
    )


@pytest.mark.parametrize("backend,num_splits", [("torch", None), ("triton", 1), ("triton", 2), ("triton", 4)])
def test_upper_bound_host_lengths_and_padding_rows_are_exact(backend, num_splits):
    batch = make_batch([1] * 3, [9, 1, 22], block_size=BLOCK_SIZE, q_heads=4, kv_heads=2, head_dim=64, seed=3)
    scale = 64 ** -0.5
    expected = torch_attention.paged_attention(batch.query, batch.kv_cache, batch.meta, scale)
    padding = 2
    query = torch.cat([batch.query, torch.randn(padding, *batch.query.shape[1:])])
    meta = _as_captured(batch.meta, padding)
    if backend == "torch":
        got = torch_attention.paged_attention(query, batch.kv_cache, meta, scale)
    else:
        got = triton_attention.paged_attention(query, batch.kv_cache, meta, scale, num_splits=num_splits)
    torch.testing.assert_close(got[:3], expected, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got[3:]).all()  # padding rows attend to one (block 0) token: garbage, but finite


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padding_slots_write_nothing(backend):
    write_kv = (torch_attention if backend == "torch" else triton_attention).write_kv
    cache = torch.randn(2, 5, BLOCK_SIZE, 2, 16)
    before = cache.clone()
    key, value = torch.randn(4, 2, 16), torch.randn(4, 2, 16)
    write_kv(key, value, cache, torch.tensor([6, -1, 13, -1]))
    flat, flat_before = cache.view(2, -1, 2, 16), before.view(2, -1, 2, 16)
    assert torch.equal(flat[0, [6, 13]], key[[0, 2]]) and torch.equal(flat[1, [6, 13]], value[[0, 2]])
    others = torch.ones(flat.shape[1], dtype=torch.bool)
    others[[6, 13]] = False
    assert torch.equal(flat[:, others], flat_before[:, others])
    write_kv(key, value, cache, torch.full((4,), -1))   # an all-padding step
    assert torch.equal(cache.view(2, -1, 2, 16)[:, others], flat_before[:, others])

"""The torch path (C++ row op and its torch-ops fallback) against the dense reference.

The torch path is the oracle the Triton kernels are tested against, so it gets its own oracle:
``reference_attention``, the padded float32 computation it replaced. Both variants of the fast path
run here: the CPU op (``PAGEDMODEL_CPU_OPS=auto``, compiled at install) and the pure
torch-ops fallback (``off``).
"""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernel_batches import make_batch
from pagedmodel.kernels import cpu_ops, reference_attention, torch_attention

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2 ** -7, atol=2 ** -7),
       torch.float16: dict(rtol=2 ** -9, atol=2 ** -9)}


def _check(query_lens, seq_lens, dtype=torch.float32, **kw):
    batch = make_batch(query_lens, seq_lens, dtype=dtype, **kw)
    scale = batch.query.shape[-1] ** -0.5
    got = torch_attention.paged_attention(batch.query, batch.kv_cache, batch.meta, scale)
    expected = reference_attention.paged_attention(batch.query.float(), batch.kv_cache.float(), batch.meta, scale)
    assert got.shape == batch.query.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mixed_batch_every_row_kind(op_mode, dtype):
    # decode, short chunk, long chunk (> SHORT_CHUNK rows), fresh prefill, an idle sequence, 1-token context
    long_chunk = torch_attention.SHORT_CHUNK + 3
    _check([1, 5, long_chunk, 0, 1, 24], [9, 30, long_chunk + 9, 3, 1, 24], dtype, q_heads=6, kv_heads=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_chunks_span_several_query_tiles(op_mode, dtype):
    """Long chunks go PREFILL_TILE query rows at a time, each tile over the keys it can see: a whole
    prompt and a chunk late in its context, both over several tiles and ending mid-tile, must match
    the reference (a tile's masked triangle and its fully visible keys both in play)."""
    tile = torch_attention.PREFILL_TILE
    _check([2 * tile + 7, tile + 1], [2 * tile + 7, 3 * tile + 5], dtype, block_size=16, q_heads=9, kv_heads=3)


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
def test_decode_lengths_across_block_boundaries(op_mode, block_size):
    lens = [1, block_size - 1 or 1, block_size, block_size + 1, 3 * block_size, 70]
    _check([1] * len(lens), lens, block_size=block_size, q_heads=9, kv_heads=3, seed=block_size)


@pytest.mark.parametrize("sharpness", [1.0, 40.0, 400.0])
def test_peaked_softmax_and_smollm2_shapes(op_mode, sharpness):
    """Scores hundreds apart (the op's own exp meets arguments far below -87, where it clamps) and
    SmolLM2's attention shapes: 9 query / 3 kv heads, head dim 64, block size 16, bf16 and fp32."""
    for dtype in (torch.float32, torch.bfloat16):
        lens = [1, 3, 15, 16, 17, 33, 150, 401]
        batch = make_batch([1] * len(lens), lens, block_size=16, q_heads=9, kv_heads=3, head_dim=64, dtype=dtype,
                           seed=int(sharpness))
        scale = sharpness * 64 ** -0.5
        got = torch_attention.paged_attention(batch.query, batch.kv_cache, batch.meta, scale)
        expected = reference_attention.paged_attention(batch.query.float(), batch.kv_cache.float(), batch.meta, scale)
        assert torch.isfinite(got.float()).all()
        # float32 scores of magnitude ~sharpness x 8 carry rounding errors that grow with them (torch's
        # own SDPA fallback parts from the float32 reference the same way): the bound scales too
        tol = {k: v * sharpness for k, v in TOL[dtype].items()} if dtype == torch.float32 else TOL[dtype]
        torch.testing.assert_close(got.float(), expected, **tol)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 128])
def test_bf16_rows_at_the_vector_head_dims(op_mode, head_dim, block_size):
    """Head dims 64 and 128 take the op's AVX-512 steps (16 tokens per reduction tree), at the GPU
    default block size and at the CPU's (128, several trees per block): odd lengths, partial last
    blocks, contexts over several blocks, a short chunk's causal rows, and 20+ rows (a row's kv heads
    read together)."""
    lens = [1, 2, 3, 15, 17, block_size - 1, block_size + 1, 2 * block_size + 3, 301, 555] * 2
    _check([1] * len(lens) + [5], lens + [40], torch.bfloat16, block_size=block_size, q_heads=9, kv_heads=3,
           head_dim=head_dim, seed=head_dim + block_size)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (8, 4), (9, 3), (8, 2), (10, 2), (14, 2), (16, 2)])
def test_every_gqa_group_size_in_register_tiles(op_mode, head_dim, q_heads, kv_heads):
    """The AVX-512 steps take a kv head's query heads in register tiles (4 at head dim 64, 2 at 128)
    and the remainder in a smaller tile: groups of 1-8 cover whole tiles and each remainder size."""
    lens = [1, 16, 17, 40, 129, 300] * 4
    _check([1] * len(lens), lens, torch.float32, block_size=128, q_heads=q_heads, kv_heads=kv_heads,
           head_dim=head_dim, seed=q_heads * 10 + kv_heads)


def test_one_long_among_many_short(op_mode):
    _check([1] * 40, [5] * 39 + [300], block_size=16, q_heads=4, kv_heads=1, head_dim=32)


@pytest.mark.parametrize("rows", [2, 48])
def test_a_row_read_one_kv_head_at_a_time_or_all_at_once(op_mode, rows):
    """The op takes a row's kv heads one per work item when rows are few (2) and all together when
    they are many (48 rows, at most 12 threads): both must match the reference, GQA groups included."""
    lens = [(37 * i) % 90 + 1 for i in range(rows)]
    _check([1] * rows, lens, block_size=16, q_heads=9, kv_heads=3, head_dim=64, seed=rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_queries_read_in_place_from_the_fused_projection(op_mode, dtype):
    """The model hands over its queries as a strided view of the qkv projection's output (rows 15 heads
    wide, 9 of them queries): a decode step's rows go to the op as they are, and give what a contiguous
    copy gives."""
    batch = make_batch([1, 1, 1, 1], [40, 3, 20, 77], dtype=dtype, block_size=16, q_heads=9, kv_heads=3)
    qkv = torch.randn(batch.query.shape[0], 15, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    qkv[:, :9] = batch.query
    strided = qkv[:, :9]
    assert not strided.is_contiguous()
    got = torch_attention.paged_attention(strided, batch.kv_cache, batch.meta, 0.125)
    assert torch.equal(got, torch_attention.paged_attention(batch.query, batch.kv_cache, batch.meta, 0.125))


@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 40)), min_size=1, max_size=8), st.integers(0, 2**16))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_random_batches(op_mode, rows, seed):
    query_lens = [q for q, _ in rows]
    seq_lens = [max(q, 1) + extra for q, extra in rows]
    _check(query_lens, seq_lens, block_size=random.Random(seed).choice([1, 4, 8]), q_heads=4, kv_heads=2,
           head_dim=16, seed=seed)


def test_a_reused_metadata_object_follows_its_device_lengths(op_mode):
    """What a graph replay does: the same metadata object, new lengths in its tensors."""
    batch = make_batch([1, 1, 1], [30, 7, 12], block_size=4, q_heads=4, kv_heads=2)
    meta = batch.meta
    first = torch_attention.paged_attention(batch.query, batch.kv_cache, meta, 0.25)
    meta.seq_lens.copy_(torch.tensor([3, 7, 1], dtype=torch.int32))
    again = torch_attention.paged_attention(batch.query, batch.kv_cache, meta, 0.25)
    expected = reference_attention.paged_attention(batch.query, batch.kv_cache, meta, 0.25)
    torch.testing.assert_close(again, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(first[0], again[0])


def test_query_rows_beyond_the_context_are_refused():
    batch = make_batch([1], [4], block_size=4)
    batch.meta.query_start_loc[1] = 5   # five query rows claim a 4-token context
    with pytest.raises(ValueError, match="5 query rows but a context of only 4"):
        torch_attention.plan_rows(batch.meta)


def test_the_op_checks_lengths_and_block_ids(monkeypatch):
    monkeypatch.setenv(cpu_ops.OPS_ENV, "auto")
    op = cpu_ops.paged_attention()
    assert op is not None, cpu_ops.load_error()
    batch = make_batch([1, 1], [4, 8], block_size=4)
    tables, seqs = batch.meta.block_tables, torch.arange(2)
    with pytest.raises(RuntimeError, match="outside"):
        op(batch.query, batch.kv_cache, tables, seqs, torch.tensor([4, 9], dtype=torch.int32), 1.0)
    bad = tables.clone()
    bad[1, 1] = batch.kv_cache.shape[1]
    with pytest.raises(RuntimeError, match="block id"):
        op(batch.query, batch.kv_cache, bad, seqs, batch.meta.seq_lens, 1.0)


def test_an_install_without_the_ops_runs_torch_ops(monkeypatch, tmp_path):
    """No level built (a machine without a C++ compiler at install): the loader says why, attention still runs."""
    monkeypatch.setenv(cpu_ops.OPS_ENV, "auto")
    monkeypatch.setattr(cpu_ops, "_state", {})
    monkeypatch.setattr(cpu_ops, "MANIFEST", tmp_path / "cpu_ops_build.json")
    assert cpu_ops.load() is None and cpu_ops.paged_attention() is None
    assert "no CPU ops were built at install" in cpu_ops.load_error()
    _check([1, 3], [10, 3], q_heads=2, kv_heads=1)


def test_length_buckets_bound_the_padding():
    """The fallback's cost: padding every row to its bucket's longest stays within the ratio (or one
    block) of the rows' own lengths -- one long row among 63 short ones costs its own length."""
    rng = random.Random(0)
    for lens in ([150] * 63 + [2000], [rng.randint(1, 1500) for _ in range(256)], [1] * 5):
        buckets = torch_attention.length_buckets(lens, 16)
        assert sorted(r for b in buckets for r in b) == list(range(len(lens)))
        padded = sum(len(b) * max(lens[r] for r in b) for b in buckets)
        assert padded <= sum(max(torch_attention.BUCKET_RATIO * lens[r], lens[r] + 16) for r in range(len(lens)))
    assert len(torch_attention.length_buckets([150] * 63 + [2000], 16)) == 2

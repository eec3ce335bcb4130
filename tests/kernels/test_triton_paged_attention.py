"""Triton paged attention vs the pure-torch oracle, under the Triton interpreter.

Shapes are tiny on purpose: the interpreter costs milliseconds per loop iteration, and every
code path (tile boundaries, split-KV merges, block-table translation) is reachable with a
handful of tokens by shrinking the tile sizes instead of growing the inputs.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernel_batches import PagedBatch, make_batch
from pagedmodel.kernels import torch_attention, triton_launch, triton_paged_attention
from pagedmodel.kernels.attention_metadata import AttentionMetadata
from pagedmodel.kernels.triton_attention import paged_attention

# fp32 must agree to rounding noise. fp16 loses at most ~1 ulp of the output plus the fp16
# rounding of softmax weights before the P@V product. bf16 is upcast after load in the
# interpreter (numpy has no bf16 arithmetic), so only the final store rounds: 1 ulp.
TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2 ** -9, atol=2 ** -10),
    torch.bfloat16: dict(rtol=2 ** -7, atol=1e-5),
}


def oracle(batch: PagedBatch, scale: float) -> torch.Tensor:
    """The torch path in fp32 on the exact (already rounded) inputs the kernel sees."""
    return torch_attention.paged_attention(batch.query.float(), batch.kv_cache.float(), batch.meta, scale)


def check(batch: PagedBatch, scale: float | None = None, **config) -> torch.Tensor:
    scale = scale if scale is not None else 1.0 / math.sqrt(batch.query.shape[-1])
    out = paged_attention(batch.query, batch.kv_cache, batch.meta, scale, **config)
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    torch.testing.assert_close(out.float(), oracle(batch, scale), **TOLERANCES[batch.query.dtype])
    return out


# decode / chunked prefill / fresh prefill / no-rows-this-step / 1-token context, mixed
MIXED = dict(query_lens=[1, 5, 7, 0, 1, 3], seq_lens=[9, 5, 19, 3, 1, 3])


@pytest.mark.parametrize("block_size", [1, 4, 8, 16, 32, 64, 128])
def test_block_sizes(block_size):
    check(make_batch(**MIXED, block_size=block_size, seed=block_size), block_m=8, block_n=8)


@pytest.mark.parametrize("q_heads,kv_heads", [(1, 1), (4, 2), (3, 1), (6, 2), (8, 1), (20, 1)])
def test_gqa_ratios(q_heads, kv_heads):
    check(make_batch(**MIXED, q_heads=q_heads, kv_heads=kv_heads), block_m=16, block_n=8)


@pytest.mark.parametrize("head_dim", [64, 96, 128, 40])
def test_head_dims(head_dim):
    # 96 and 40 are padded to a power of two inside the kernel and masked
    check(make_batch(**MIXED, head_dim=head_dim, kv_heads=2, q_heads=4), block_m=8, block_n=8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_dtypes(dtype, num_splits):
    check(make_batch(**MIXED, q_heads=4, kv_heads=2, dtype=dtype), block_m=8, block_n=4, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [2, 4, 8])
def test_split_kv_decode_with_empty_splits(num_splits):
    # short sequences leave whole splits empty (lse = -inf); long ones span every split
    batch = make_batch([1, 1, 1, 1], [1, 3, 37, 64], block_size=4, q_heads=4, kv_heads=2)
    check(batch, block_n=4, num_splits=num_splits)


def test_split_kv_mixed_batch():
    check(make_batch(**MIXED, q_heads=2, kv_heads=1), block_m=4, block_n=4, num_splits=4)


@pytest.mark.parametrize("block_m,block_n", [(1, 1), (2, 2), (4, 16), (64, 64)])
def test_tile_shapes(block_m, block_n):
    # block_m < group size, tiles much smaller and much larger than blocks and sequences
    check(make_batch(**MIXED, q_heads=4, kv_heads=1, block_size=8), block_m=block_m, block_n=block_n)


def test_default_launch_config():
    check(make_batch(**MIXED, q_heads=6, kv_heads=2, block_size=16))


def test_context_spanning_many_blocks():
    # 120-token context over 30 shuffled 4-token blocks; a chunk of 6 rows on top of it
    batch = make_batch([1, 6], [97, 120], block_size=4, q_heads=2, kv_heads=1, seed=3)
    check(batch, block_m=8, block_n=32)


def test_physical_block_order_does_not_matter():
    batch = make_batch([2, 1], [10, 7], block_size=2, seed=11)
    out = check(batch, block_m=8, block_n=8)
    # move every used block to a new physical id (reverse order) and rewrite the tables
    meta = batch.meta
    num_blocks = batch.kv_cache.shape[1]
    moved = batch.kv_cache.clone()
    remap = torch.arange(num_blocks - 1, -1, -1)
    moved[:, remap] = batch.kv_cache
    tables = [[int(remap[b]) for b in row[: -(-s // 2)]] for row, s in zip(meta.block_tables.tolist(), meta.seq_lens_cpu)]
    moved_meta = AttentionMetadata.build(meta.query_lens_cpu, meta.seq_lens_cpu, tables, meta.slot_mapping.tolist())
    again = paged_attention(batch.query, moved, moved_meta, 1 / 8, block_m=8, block_n=8)
    torch.testing.assert_close(again, out, rtol=0, atol=0)


def test_shared_prefix_block():
    check(make_batch([1, 3, 1], [6, 8, 4], block_size=4, share_first_block=True), block_m=4, block_n=4)


def test_all_decode_batch_at_block_boundaries():
    # contexts ending exactly on, just after and just before a block edge
    check(make_batch([1] * 5, [8, 9, 7, 16, 1], block_size=8, q_heads=4, kv_heads=2), block_n=8)


def test_single_token_and_empty_context_prefills():
    check(make_batch([1, 4, 1], [1, 4, 1], block_size=2), block_m=2, block_n=2)


def test_unusual_scale_and_peaked_scores():
    # large logits: the online softmax must rescale without overflow
    batch = make_batch(**MIXED)
    batch.query.mul_(40.0)
    check(batch, scale=0.9, block_m=8, block_n=4)


def test_strided_query_view():
    # the engine slices q out of a fused qkv projection: rows are not contiguous
    batch = make_batch(**MIXED, q_heads=4, kv_heads=2)
    fused = torch.cat([batch.query, torch.randn_like(batch.query)], dim=1)
    batch.query = fused[:, :4]
    assert not batch.query.is_contiguous()
    check(batch, block_m=8, block_n=8)


def test_empty_batch():
    batch = make_batch([0, 0], [3, 2])
    out = paged_attention(batch.query, batch.kv_cache, batch.meta, 0.1)
    assert out.shape == (0, 2, 64)


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_random_mixed_batches(data):
    num_seqs = data.draw(st.integers(1, 4))
    seq_lens = data.draw(st.lists(st.integers(1, 24), min_size=num_seqs, max_size=num_seqs))
    query_lens = [data.draw(st.integers(0, s)) for s in seq_lens]
    if sum(query_lens) == 0:
        query_lens[0] = 1
    kv_heads = data.draw(st.sampled_from([1, 2]))
    batch = make_batch(query_lens, seq_lens, block_size=data.draw(st.sampled_from([1, 2, 4, 8, 16])),
                       kv_heads=kv_heads, q_heads=kv_heads * data.draw(st.sampled_from([1, 2, 3])),
                       head_dim=data.draw(st.sampled_from([16, 24])), seed=data.draw(st.integers(0, 99)))
    check(batch, block_m=data.draw(st.sampled_from([2, 8])), block_n=data.draw(st.sampled_from([2, 8])),
          num_splits=data.draw(st.sampled_from([1, 2, 4])))


# ---- bad inputs -------------------------------------------------------------------------

def _bad(match: str, batch: PagedBatch, **kwargs) -> None:
    query = kwargs.pop("query", batch.query)
    cache = kwargs.pop("kv_cache", batch.kv_cache)
    meta = kwargs.pop("meta", batch.meta)
    with pytest.raises(ValueError, match=match):
        paged_attention(query, cache, meta, 0.1, **kwargs)


def test_rejects_bad_shapes_and_dtypes():
    batch = make_batch([2, 1], [4, 3], q_heads=3, kv_heads=1)
    _bad("query must be", batch, query=batch.query[0])
    _bad("kv_cache must be", batch, kv_cache=batch.kv_cache[0])
    _bad("head_dim", batch, query=batch.query[..., :32])
    _bad("multiple of kv_heads", make_batch([1], [2], q_heads=3, kv_heads=2))
    _bad("share one dtype", batch, query=batch.query.half())
    _bad("rows but the query lengths sum", batch, query=batch.query[:2])
    _bad("contiguous head_dim", batch, query=batch.query.transpose(1, 2).contiguous().transpose(1, 2))


def test_rejects_bad_metadata():
    batch = make_batch([2, 1], [4, 3], block_size=2)
    meta = batch.meta
    narrow = AttentionMetadata(meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables[:, :1],
                               meta.query_lens_cpu, meta.seq_lens_cpu)
    _bad("block_tables has 1 columns", batch, meta=narrow)
    longer_query = AttentionMetadata.build([3, 1], [2, 3], [[1], [2, 3]], [0, 0, 0, 0])
    _bad("0 <= query_len <= seq_len", make_batch([3, 1], [3, 3]), meta=longer_query)
    wrong_dtype = AttentionMetadata(meta.slot_mapping, meta.query_start_loc.long(), meta.seq_lens,
                                    meta.block_tables, meta.query_lens_cpu, meta.seq_lens_cpu)
    _bad("query_start_loc must be int32", batch, meta=wrong_dtype)
    _bad("num_splits must be a power of two", batch, num_splits=3)
    _bad("block_m must be a power of two", batch, block_m=6)


def test_cpu_tensors_without_interpreter_get_a_clear_error(monkeypatch):
    monkeypatch.setattr(triton_launch, "interpreting", lambda: False)
    batch = make_batch([1], [2])
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        paged_attention(batch.query, batch.kv_cache, batch.meta, 0.1)


def test_split_heuristic(monkeypatch):
    choose = triton_paged_attention.choose_num_splits
    assert choose(1, 1, 1, 100_000, torch.device("cpu")) == 1  # never on the interpreter
    monkeypatch.setattr(triton_paged_attention, "_num_sms", lambda index: 132)  # an H100/H200
    gpu = torch.device("cuda", 0)
    assert choose(1, 8, 1, 4096, gpu) == 16       # one long decode: as many splits as allowed
    assert choose(1, 8, 1, 600, gpu) == 2         # but each split keeps >= 256 tokens
    assert choose(32, 8, 1, 4096, gpu) == 2       # 256 programs: ~4 per SM wants 2 splits
    assert choose(256, 8, 1, 4096, gpu) == 1      # the batch alone fills the GPU
    assert choose(1, 8, 1, 300, gpu) == 1         # short context: nothing to split
    assert choose(1, 8, 64, 4096, gpu) == 1       # prefill-heavy step


def test_each_new_metadata_is_validated_even_after_a_cached_plan():
    # the per-step plan cache must key on the metadata object, not on shapes alone
    batch = make_batch([2, 1], [4, 3], block_size=2)
    paged_attention(batch.query, batch.kv_cache, batch.meta, 0.1)
    paged_attention(batch.query, batch.kv_cache, batch.meta, 0.1)  # served from the cache
    meta = batch.meta
    bad = AttentionMetadata(meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables[:, :1],
                            meta.query_lens_cpu, meta.seq_lens_cpu)
    _bad("block_tables has 1 columns", batch, meta=bad)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_never_reads_past_a_sequence_end(num_splits):
    # NaN in every slot no sequence owns (block 0 = table padding, block tails, spare blocks):
    # even a masked read would surface through 0 * NaN, so a finite, exact output proves the
    # kernel touches only each sequence's first seq_len slots
    batch = make_batch([1, 3, 1, 2], [5, 11, 1, 2], block_size=4, q_heads=2, kv_heads=1, seed=9)
    meta = batch.meta
    owned = torch.zeros(batch.kv_cache.shape[1] * 4, dtype=torch.bool)
    for table, s_len in zip(meta.block_tables.tolist(), meta.seq_lens_cpu):
        owned[[table[p // 4] * 4 + p % 4 for p in range(s_len)]] = True
    clean = batch.kv_cache.clone()
    flat = batch.kv_cache.view(2, -1, 1, 64)
    flat[:, ~owned] = float("nan")
    out = paged_attention(batch.query, batch.kv_cache, meta, 0.125, block_m=4, block_n=4, num_splits=num_splits)
    assert bool(torch.isfinite(out).all())
    expected = torch_attention.paged_attention(batch.query, clean, meta, 0.125)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])

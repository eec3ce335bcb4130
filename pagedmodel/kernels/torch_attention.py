"""Torch paged attention: the CPU path, and the oracle the Triton kernels are tested against.

KV cache layout, one tensor per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 = keys, 1 = values). Contiguous, so a block is one ``block_size * heads * dim`` run
and a slot index ``block * block_size + offset`` addresses one token's K (or V) row.

Attention costs what the live tokens cost (the sum of the rows' own context lengths, never batch x
longest), in the cache's own dtype (no float32 copy of the cache):

- *Short rows* -- decode rows and chunks of at most ``SHORT_CHUNK`` rows -- each attend to their own
  context. On CPU the C++ op (``cpu_paged_attention``) reads each row's blocks in place. Elsewhere,
  or without a compiler, rows are bucketed by length (a bucket spans at most ``BUCKET_RATIO`` x its
  shortest row, plus a block) and each bucket is one padded, masked SDPA call.
- *Long chunks and prompts*: per sequence over its own context, in tiles of query rows that each read
  only the keys they can see (`prefill_attention`): with a bf16 cache on a CPU with AMX or AVX512-BF16,
  the C++ op ``cpu_prefill_attention`` (both products on AMX tiles, else on VDPBF16PS; a tile's scores
  kept in cache);
  otherwise torch ops over the gathered context, scores in float32 (`prefill_attention_tiled`).

Exact lengths are read from the device tensors (``seq_lens``, ``query_start_loc``), never from the
host lists, which a CUDA-graph capture fixes at an upper bound (see ``attention_metadata.py``). On
CPU that read is free; with this path on a GPU (debugging only) it syncs. The row plan derived from
the lengths is memoised on the metadata, keyed by the lengths, so the 30-odd layers of a step
build it once. ``reference_attention`` is the slower, dense second reference this is tested against.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import cpu_ops
from .attention_metadata import AttentionMetadata
from .reference_attention import gather_context

SHORT_CHUNK = 16     # chunks of up to this many rows go row by row; longer ones through one SDPA call
BUCKET_RATIO = 2.0   # torch fallback: a bucket's rows are padded to at most this x its shortest row
PREFILL_TILE = 64    # query rows per tile of a long chunk's attention (scores of a tile stay in cache)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V rows ``[T, kv_heads, dim]`` into their cache slots (-1 = skip); on CPU
    in one C++ call (``cpu_cache_write.cpp``) where the rows are in the cache's dtype."""
    if kv_cache.device.type == "cpu" and key.dtype == value.dtype == kv_cache.dtype and slot_mapping.dtype == torch.int64 \
            and slot_mapping.is_contiguous() and _heads_contiguous(key) and _heads_contiguous(value) \
            and (op := cpu_ops.cache_write()) is not None:
        op(key, value, kv_cache, slot_mapping)
        return
    _, num_blocks, block_size, heads, dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, heads, dim)
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def _heads_contiguous(rows: torch.Tensor) -> bool:
    """Each token's ``[kv_heads, dim]`` one run (tokens may be strided): what the C++ cache write reads."""
    return rows.dim() == 3 and rows.stride(2) == 1 and rows.stride(1) == rows.shape[2]


def copy_blocks(kv_caches: list[torch.Tensor], src_dst: torch.Tensor) -> None:
    """Copy whole blocks ``src -> dst`` (pairs ``[N, 2]``) in every layer: the copy-on-write op."""
    if src_dst.numel() == 0:
        return
    src, dst = src_dst[:, 0].long(), src_dst[:, 1].long()
    for cache in kv_caches:
        cache[:, dst] = cache[:, src]


@dataclass
class RowPlan:
    """How one step's query rows are split; derived from the lengths alone."""

    key: tuple[tuple[int, ...], tuple[int, ...]]   # (query_start_loc, seq_lens) it was built from
    row_index: torch.Tensor | None   # flat rows that go row by row; None: every row, in order
    row_seq: torch.Tensor            # [R] int64: each such row's sequence (its block-table row)
    row_len: torch.Tensor            # [R] int32: context tokens that row attends to
    row_lens: list[int]              # host copy of row_len
    long_seqs: list[tuple[int, int, int, int]]   # (sequence, first row, query rows, context length)


def plan_rows(meta: AttentionMetadata) -> RowPlan:
    starts = meta.query_start_loc.tolist()
    lens = meta.seq_lens.tolist()
    key = (tuple(starts), tuple(lens))
    cached = meta.memo.get("torch_rows")
    if cached is not None and cached.key == key:
        return cached
    device = meta.seq_lens.device
    if starts == list(range(len(lens) + 1)):   # all decode: rows are the sequences themselves
        plan = RowPlan(key, None, torch.arange(len(lens), device=device), meta.seq_lens.to(torch.int32),
                       lens, [])
    else:
        rows: list[int] = []
        row_seq: list[int] = []
        row_lens: list[int] = []
        long_seqs: list[tuple[int, int, int, int]] = []
        for i, s_len in enumerate(lens):
            start, q_len = starts[i], starts[i + 1] - starts[i]
            if q_len > s_len:
                raise ValueError(f"sequence {i} has {q_len} query rows but a context of only {s_len} tokens")
            if 0 < q_len <= SHORT_CHUNK:
                rows.extend(range(start, start + q_len))
                row_seq.extend([i] * q_len)
                row_lens.extend(range(s_len - q_len + 1, s_len + 1))   # causal: row j sees s_len - q_len + j + 1
            elif q_len > 0:
                long_seqs.append((i, start, q_len, s_len))
        plan = RowPlan(key, torch.tensor(rows, dtype=torch.long, device=device),
                       torch.tensor(row_seq, dtype=torch.long, device=device),
                       torch.tensor(row_lens, dtype=torch.int32, device=device), row_lens, long_seqs)
    meta.memo["torch_rows"] = plan
    return plan


def rows_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, plan: RowPlan,
                   scale: float) -> torch.Tensor:
    """Each row of ``query`` ``[R, q_heads, dim]`` over its own first ``plan.row_len`` context tokens."""
    if query.shape[0] == 0:
        return query.clone()
    q = query.to(kv_cache.dtype)
    op = cpu_ops.paged_attention() if kv_cache.device.type == "cpu" else None
    if op is not None:
        out = op(q if _heads_contiguous(q) else q.contiguous(), kv_cache, block_tables.to(torch.int32).contiguous(),
                 plan.row_seq, plan.row_len, scale)
    else:
        out = rows_attention_bucketed(q, kv_cache, block_tables, plan.row_seq, plan.row_lens, scale)
    return out.to(query.dtype)


def length_buckets(row_lens: list[int], block_size: int, ratio: float = BUCKET_RATIO) -> list[list[int]]:
    """Rows grouped by length, shortest first: a bucket holds rows up to ``ratio`` x its shortest row's
    length (or one more block), so padding each row to its bucket's longest costs at most that factor."""
    order = sorted(range(len(row_lens)), key=row_lens.__getitem__)
    buckets: list[list[int]] = []
    for r in order:
        if buckets and row_lens[r] <= max(int(row_lens[buckets[-1][0]] * ratio),
                                          row_lens[buckets[-1][0]] + block_size):
            buckets[-1].append(r)
        else:
            buckets.append([r])
    return buckets


def rows_attention_bucketed(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                            row_seq: torch.Tensor, row_lens: list[int], scale: float) -> torch.Tensor:
    """The torch-ops version of the row op: rows of similar length share one padded SDPA call."""
    _, _, block_size, kv_heads, dim = kv_cache.shape
    out = torch.empty_like(query)
    device = query.device
    for bucket in length_buckets(row_lens, block_size):
        idx = torch.tensor(bucket, dtype=torch.long, device=device)
        num_blocks = -(-row_lens[bucket[-1]] // block_size)
        width = num_blocks * block_size
        kv = kv_cache[:, block_tables[row_seq[idx], :num_blocks].long()]      # [2, n, blocks, bs, H, D]
        kv = kv.reshape(2, len(bucket), width, kv_heads, dim).transpose(2, 3)  # [2, n, H, width, D]
        lens = torch.tensor([row_lens[r] for r in bucket], device=device)
        mask = torch.arange(width, device=device)[None, :] < lens[:, None]
        got = F.scaled_dot_product_attention(query[idx].unsqueeze(2), kv[0], kv[1], attn_mask=mask[:, None, None, :],
                                             scale=scale, enable_gqa=True)
        out[idx] = got[:, :, 0]
    return out


def prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                      scale: float) -> torch.Tensor:
    """The last ``len(query)`` positions of one sequence, causally over its ``seq_len`` context tokens.

    bf16 on a CPU with AMX or AVX512-BF16: the C++ op (``cpu_prefill_attention.cpp``: q.k and p.v on AMX
    tiles, else on VDPBF16PS; a tile's scores kept in cache); otherwise `prefill_attention_tiled`, which
    rounds where the op does."""
    if query.dtype == torch.bfloat16 and kv_cache.dtype == torch.bfloat16 and kv_cache.device.type == "cpu":
        op = cpu_ops.amx_prefill() or cpu_ops.bf16_prefill()
        if op is not None and query.shape[-1] % 64 == 0:
            return op(query.contiguous(), kv_cache, block_table.to(torch.int32).contiguous(), seq_len, scale)
    return prefill_attention_tiled(query, kv_cache, block_table, seq_len, scale)


def prefill_attention_tiled(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                            scale: float) -> torch.Tensor:
    """`prefill_attention` on torch ops.

    ``PREFILL_TILE`` query rows at a time, each tile over only the keys it can see: the scores stay a
    few MB (they fit in cache), and the causal half of the work is skipped. One SDPA call over the whole
    prompt materialises every score -- 80 MB at 1,500 tokens -- and was 3-6x slower on CPU
    (benchmarks/attention_cost.py --prefill). Scores and softmax are float32. With a bf16 cache the
    probabilities are rounded to bf16 for the product with V, as flash attention does on GPUs: that bmm
    then runs at the bf16 rate (2x float32's with AVX512-BF16), and the output is rounded to bf16 anyway."""
    q_len = query.shape[0]
    q_heads, dim = query.shape[1], query.shape[2]
    k, v = gather_context(kv_cache, block_table, seq_len)            # [seq_len, kv_heads, dim]
    kv_heads = k.shape[1]
    group = q_heads // kv_heads
    k_t = k.float().transpose(0, 1).transpose(1, 2)                   # [kv_heads, dim, seq_len]
    pv_dtype = torch.bfloat16 if kv_cache.dtype == torch.bfloat16 else torch.float32
    v_t = v.to(pv_dtype).transpose(0, 1)                              # [kv_heads, seq_len, dim]
    # [kv_heads, group, q_len, dim]: a kv head's query heads side by side, so one bmm serves the group
    q_t = (query.float() * scale).view(q_len, kv_heads, group, dim).permute(1, 2, 0, 3)
    out = torch.empty(kv_heads, group, q_len, dim, dtype=torch.float32, device=query.device)
    first_key = seq_len - q_len   # query row j sees keys 0 .. first_key + j (bottom-right causal)
    for a in range(0, q_len, PREFILL_TILE):
        b = min(q_len, a + PREFILL_TILE)
        n, visible = b - a, first_key + b
        scores = torch.bmm(q_t[:, :, a:b].reshape(kv_heads, group * n, dim), k_t[:, :, :visible])
        scores = scores.view(kv_heads, group, n, visible)
        # every key before the tile's own diagonal is visible to all its rows; mask the triangle
        future = torch.ones(n, n, dtype=torch.bool, device=query.device).triu_(1)
        scores[..., visible - n:].masked_fill_(future, float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(kv_heads, group * n, visible).to(pv_dtype)
        out[:, :, a:b] = torch.bmm(probs, v_t[:, :visible]).view(kv_heads, group, n, dim)
    return out.view(q_heads, q_len, dim).transpose(0, 1).to(query.dtype)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention for a mixed batch (see AttentionMetadata); ``query`` is ``[T, q_heads, dim]``."""
    plan = plan_rows(meta)
    if plan.row_index is None:
        return rows_attention(query, kv_cache, meta.block_tables, plan, scale)
    out = torch.empty_like(query)
    if plan.row_index.numel():
        out[plan.row_index] = rows_attention(query[plan.row_index], kv_cache, meta.block_tables, plan, scale)
    for i, start, q_len, s_len in plan.long_seqs:
        out[start:start + q_len] = prefill_attention(query[start:start + q_len], kv_cache, meta.block_tables[i],
                                                     s_len, scale)
    return out

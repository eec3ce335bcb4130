"""Pure-torch paged attention: the CPU path, and the oracle the Triton kernels are tested against.

KV cache layout, one tensor per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(index 0 = keys, 1 = values). Contiguous, so a block is one ``block_size * heads * dim`` run
and a slot index ``block * block_size + offset`` addresses one token's K (or V) row.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention_metadata import AttentionMetadata


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K/V rows ``[T, kv_heads, dim]`` into their cache slots (-1 = skip)."""
    _, num_blocks, block_size, heads, dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, heads, dim)
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def copy_blocks(kv_caches: list[torch.Tensor], src_dst: torch.Tensor) -> None:
    """Copy whole blocks ``src -> dst`` (pairs ``[N, 2]``) in every layer: the copy-on-write op."""
    if src_dst.numel() == 0:
        return
    src, dst = src_dst[:, 0].long(), src_dst[:, 1].long()
    for cache in kv_caches:
        cache[:, dst] = cache[:, src]


def _gather_context(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's contiguous K and V, ``[seq_len, kv_heads, dim]`` each."""
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = kv_cache[:, block_table[:num_blocks].long()]  # [2, n, bs, H, D]
    kv = blocks.reshape(2, num_blocks * block_size, *kv_cache.shape[3:])[:, :seq_len]
    return kv[0], kv[1]


def _decode_batch(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
    """All one-token rows at once: pad contexts to ``max_len``, mask each row past its own length.

    The mask comes from the device tensor ``seq_lens``; the host value ``max_len`` only sizes the
    gather and may be any upper bound (a CUDA-graph capture passes max-model-len), so a replay
    with shorter contexts stays exact."""
    bsz, q_heads, dim = query.shape
    _, _, block_size, kv_heads, _ = kv_cache.shape
    group = q_heads // kv_heads
    num_blocks = (max_len + block_size - 1) // block_size
    kv = kv_cache[:, block_tables[:, :num_blocks].long()]  # [2, B, n, bs, H, D]
    kv = kv.reshape(2, bsz, num_blocks * block_size, kv_heads, dim)
    k, v = kv[0].float(), kv[1].float()
    q = query.float().view(bsz, kv_heads, group, dim)
    scores = torch.einsum("bhgd,blhd->bhgl", q, k) * scale
    pad = torch.arange(num_blocks * block_size, device=query.device)[None, :] >= seq_lens[:, None]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgl,blhd->bhgd", probs, v)
    return out.reshape(bsz, q_heads, dim).to(query.dtype)


def _prefill_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last ``len(q)`` positions over a context of ``len(k)``."""
    q_len, q_heads, _ = q.shape
    seq_len, kv_heads, _ = k.shape
    group = q_heads // kv_heads
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    q_t, k_t, v_t = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if q_len == seq_len:
        out = F.scaled_dot_product_attention(q_t, k_t, v_t, is_causal=True, scale=scale)
    else:
        # bottom-right aligned causal mask: row j sees keys up to seq_len - q_len + j
        rows = torch.arange(q_len, device=q.device)[:, None] + (seq_len - q_len)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(q_t, k_t, v_t, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention for a mixed batch (see AttentionMetadata); ``query`` is ``[T, q_heads, dim]``."""
    out = torch.empty_like(query)
    q_lens, s_lens = meta.query_lens_cpu, meta.seq_lens_cpu
    if meta.is_all_decode and q_lens:
        return _decode_batch(query, kv_cache, meta.block_tables, meta.seq_lens, meta.max_seq_len, scale)
    decode_rows: list[int] = []
    decode_seqs: list[int] = []
    start = 0
    for i, (q_len, s_len) in enumerate(zip(q_lens, s_lens)):
        if q_len == 1:
            decode_rows.append(start)
            decode_seqs.append(i)
        elif q_len > 0:
            k, v = _gather_context(kv_cache, meta.block_tables[i], s_len)
            out[start:start + q_len] = _prefill_one(query[start:start + q_len], k, v, scale)
        start += q_len
    if decode_rows:
        rows = torch.tensor(decode_rows, device=query.device)
        seqs = torch.tensor(decode_seqs, device=query.device)
        out[rows] = _decode_batch(query[rows], kv_cache, meta.block_tables[seqs], meta.seq_lens[seqs],
                                  max(s_lens[i] for i in decode_seqs), scale)
    return out

"""The dense reference: paged attention computed the obvious way, slowly, to test the fast paths against.

Every decode row is padded to the longest context of the batch and computed in float32; every
other sequence is gathered and attended on its own. This is what ``torch_attention`` did before it
learned to cost only what the live tokens cost; it stays as the second, independent reference
(``tests/kernels/test_torch_attention.py`` compares the two). Its decode rows are masked by the
device tensor ``seq_lens``, so a host length that is only an upper bound (a CUDA-graph capture)
stays exact there.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention_metadata import AttentionMetadata


def gather_context(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's contiguous K and V, ``[seq_len, kv_heads, dim]`` each."""
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = kv_cache[:, block_table[:num_blocks].long()]  # [2, n, bs, H, D]
    kv = blocks.reshape(2, num_blocks * block_size, *kv_cache.shape[3:])[:, :seq_len]
    return kv[0], kv[1]


def decode_batch(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
    """All one-token rows at once: pad contexts to ``max_len`` (any upper bound), mask each row past
    its own length (from the device tensor ``seq_lens``)."""
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


def prefill_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
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
        return decode_batch(query, kv_cache, meta.block_tables, meta.seq_lens, meta.max_seq_len, scale)
    decode_rows: list[int] = []
    decode_seqs: list[int] = []
    start = 0
    for i, (q_len, s_len) in enumerate(zip(q_lens, s_lens)):
        if q_len == 1:
            decode_rows.append(start)
            decode_seqs.append(i)
        elif q_len > 0:
            k, v = gather_context(kv_cache, meta.block_tables[i], s_len)
            out[start:start + q_len] = prefill_one(query[start:start + q_len], k, v, scale)
        start += q_len
    if decode_rows:
        rows = torch.tensor(decode_rows, device=query.device)
        seqs = torch.tensor(decode_seqs, device=query.device)
        out[rows] = decode_batch(query[rows], kv_cache, meta.block_tables[seqs], meta.seq_lens[seqs],
                                 max(s_lens[i] for i in decode_seqs), scale)
    return out

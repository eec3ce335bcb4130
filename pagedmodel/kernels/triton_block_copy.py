"""Triton block copy: duplicate whole KV blocks ``src -> dst`` in every layer (copy-on-write).

A block of one layer's K (or V) is one contiguous ``block_size * kv_heads * head_dim`` run, so a
program copies one chunk of one run for one pair: grid ``(pairs, K/V, chunks)``, one launch per
layer (layers are separate tensors; copy-on-write is rare, so the launches don't matter).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_launch import require_launchable

_CHUNK = 1024  # elements per program: a few KB, enough to keep the loads wide


@triton.jit
def _copy_blocks_kernel(
    cache_ptr, src_dst_ptr,
    stride_pair, stride_c_kv, stride_c_blk,
    BLOCK_ELEMS: tl.constexpr, CHUNK: tl.constexpr,
):
    pair = tl.program_id(0)
    kv = tl.program_id(1)
    chunk = tl.program_id(2)
    src = tl.load(src_dst_ptr + pair * stride_pair).to(tl.int64)
    dst = tl.load(src_dst_ptr + pair * stride_pair + 1).to(tl.int64)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_ELEMS
    base = cache_ptr + kv * stride_c_kv
    data = tl.load(base + src * stride_c_blk + offs, mask=mask)
    tl.store(base + dst * stride_c_blk + offs, data, mask=mask)


def check_inputs(kv_caches: list[torch.Tensor], src_dst: torch.Tensor) -> None:
    if src_dst.dim() != 2 or src_dst.shape[1] != 2 or src_dst.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"src_dst must be an [N, 2] int32/int64 tensor, got {src_dst.dtype} "
                         f"shape {tuple(src_dst.shape)}")
    for layer, cache in enumerate(kv_caches):
        if cache.dim() != 5 or cache.shape[0] != 2:
            raise ValueError(f"kv_caches[{layer}] must be [2, num_blocks, block_size, kv_heads, head_dim], "
                             f"got shape {tuple(cache.shape)}")
        if cache.device != src_dst.device:
            raise ValueError(f"kv_caches[{layer}] on {cache.device} but src_dst on {src_dst.device}")
        # Each block's run must be contiguous for the flat per-block copy.
        if not cache[0, 0].is_contiguous() or cache.stride(0) == 0:
            raise ValueError(f"kv_caches[{layer}] must have contiguous blocks")
    if src_dst.device.type == "cpu" and src_dst.numel():
        # Pairs run in parallel: a block written by one pair and read (or written) by another
        # would be a race, so reject it instead of producing order-dependent contents.
        src, dst = src_dst[:, 0], src_dst[:, 1]
        if len(set(dst.tolist())) != dst.numel() or set(dst.tolist()) & set(src.tolist()):
            raise ValueError("copy_blocks: destination blocks must be distinct and never a source")
        for layer, cache in enumerate(kv_caches):
            if int(src_dst.min()) < 0 or int(src_dst.max()) >= cache.shape[1]:
                raise ValueError(f"copy_blocks: block ids must be in [0, {cache.shape[1]}) for "
                                 f"kv_caches[{layer}], got {src_dst.tolist()[:4]}")


def copy_blocks(kv_caches: list[torch.Tensor], src_dst: torch.Tensor) -> None:
    """Copy block ``src_dst[i, 0]`` onto ``src_dst[i, 1]`` in every layer's cache."""
    check_inputs(kv_caches, src_dst)
    require_launchable(src_dst.device)
    if src_dst.numel() == 0 or not kv_caches:
        return
    if src_dst.stride(1) != 1:
        src_dst = src_dst.contiguous()
    for cache in kv_caches:
        block_elems = cache[0, 0].numel()
        grid = (src_dst.shape[0], 2, triton.cdiv(block_elems, _CHUNK))
        _copy_blocks_kernel[grid](
            cache, src_dst, src_dst.stride(0), cache.stride(0), cache.stride(1),
            BLOCK_ELEMS=block_elems, CHUNK=_CHUNK,
        )

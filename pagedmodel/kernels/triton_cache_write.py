"""Triton cache write: scatter this step's K/V rows into their paged-cache slots.

One program per new token moves all of its KV heads (one contiguous ``heads * head_dim`` run
in the cache when the cache is contiguous). Slot ``-1`` means "don't write" (padding, or a
token whose KV is already cached). The row is cast to the cache's dtype on the way in.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_launch import next_pow2, require_launchable


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, cache_ptr, slot_mapping_ptr,
    stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_c_kv, stride_c_blk, stride_c_off, stride_c_h,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads < NUM_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    dst = cache_ptr + block * stride_c_blk + offset * stride_c_off + heads[:, None] * stride_c_h + dims[None, :]
    k = tl.load(key_ptr + token * stride_k_t + heads[:, None] * stride_k_h + dims[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_v_t + heads[:, None] * stride_v_h + dims[None, :], mask=mask)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def check_inputs(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Shapes, dtypes and devices always; slot values only when they are on the host, where the
    check costs no device sync (on GPUs the engine's block manager is trusted for them)."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError("kv_cache must be [2, num_blocks, block_size, kv_heads, head_dim], "
                         f"got shape {tuple(kv_cache.shape)}")
    _, num_blocks, block_size, heads, dim = kv_cache.shape
    for name, t in (("key", key), ("value", value)):
        if tuple(t.shape) != (slot_mapping.shape[0], heads, dim):
            raise ValueError(f"{name} must be [{slot_mapping.shape[0]}, {heads}, {dim}] "
                             f"(tokens, kv_heads, head_dim), got {tuple(t.shape)}")
        if t.device != kv_cache.device:
            raise ValueError(f"{name} on {t.device} but kv_cache on {kv_cache.device}")
        if not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.numel() and t.stride(2) != 1:
            raise ValueError(f"{name} needs a contiguous head_dim (stride 1)")
    if not kv_cache.dtype.is_floating_point or kv_cache.stride(4) != 1:
        raise ValueError("kv_cache must be floating point with a contiguous head_dim")
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be a 1-D int32/int64 tensor, got {slot_mapping.dtype} "
                         f"shape {tuple(slot_mapping.shape)}")
    if slot_mapping.device != kv_cache.device:
        raise ValueError(f"slot_mapping on {slot_mapping.device} but kv_cache on {kv_cache.device}")
    if slot_mapping.device.type == "cpu" and slot_mapping.numel():
        bad = (slot_mapping < -1) | (slot_mapping >= num_blocks * block_size)
        if bool(bad.any()):
            raise ValueError(f"slot_mapping values must be -1 or in [0, {num_blocks * block_size}), "
                             f"got {slot_mapping[bad][:4].tolist()}")


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter ``[T, kv_heads, dim]`` K/V rows into ``kv_cache`` at ``slot_mapping`` (-1 = skip)."""
    check_inputs(key, value, kv_cache, slot_mapping)
    require_launchable(kv_cache.device)
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _, _, block_size, heads, dim = kv_cache.shape
    _write_kv_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_HEADS=heads, HEADS_PAD=next_pow2(heads), HEAD_DIM=dim, HEAD_DIM_PAD=next_pow2(dim),
        BLOCK_SIZE=block_size,
    )

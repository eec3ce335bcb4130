"""Compile every Triton kernel for an H100/H200 (sm_90) without a GPU: Triton's full pipeline,
down to a cubin through the ptxas bundled with the triton wheel.

The interpreter checks the kernels' arithmetic but not what only the compiler enforces (types
of loop-carried values, layouts, dot operand shapes, shared-memory limits). Run as a script,
without TRITON_INTERPRET, by test_triton_sm90_compile.py; prints one line per kernel variant
and exits non-zero if any fails to compile.
"""
from __future__ import annotations

import os
import sys
import traceback

if os.environ.get("TRITON_INTERPRET"):
    sys.exit("run without TRITON_INTERPRET: the interpreter wraps kernels so they can't be compiled")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pagedmodel.kernels import triton_block_copy, triton_cache_write, triton_paged_attention  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def compile_kernel(fn, pointers: dict[str, str], constexprs: dict, floats: tuple[str, ...] = ()) -> None:
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        elif name in floats:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    missing = set(pointers) - set(fn.arg_names)
    if missing:
        raise ValueError(f"unknown pointer arguments {missing}")
    triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=TARGET)


def attention_variants():
    # (dtype, head_dim, block_size, group, group_pad, block_q, block_n, splits) as plan_launch picks
    # them on GPUs: rows per tile (block_q * group_pad) and head_dim_pad >= 16.
    yield "bf16", 64, 16, 3, 16, 1, 64, 1      # SmolLM2 decode
    yield "bf16", 64, 16, 3, 4, 16, 64, 1      # SmolLM2 prefill / mixed
    yield "bf16", 128, 16, 4, 16, 1, 64, 8     # 8B-class long decode, split-KV
    yield "fp16", 96, 8, 1, 1, 64, 64, 1       # head_dim 96 padded to 128
    yield "fp32", 64, 1, 2, 2, 32, 64, 2       # fp32 (ieee dots), block size 1, split
    yield "bf16", 16, 128, 2, 2, 32, 64, 1     # tiny head_dim padded to 16, block 128


def main() -> int:
    failures = 0
    jobs = []
    for dtype, head_dim, block_size, group, group_pad, block_q, block_n, splits in attention_variants():
        part = "*fp32" if splits > 1 else f"*{dtype}"
        jobs.append((f"paged_attention {dtype} d{head_dim} bs{block_size} group {group}/{group_pad} "
                     f"block_q {block_q} splits {splits}",
                     triton_paged_attention._paged_attention_kernel,
                     dict(out_ptr=f"*{dtype}", part_out_ptr=part, part_lse_ptr=part, q_ptr=f"*{dtype}",
                          cache_ptr=f"*{dtype}", block_tables_ptr="*i32", seq_lens_ptr="*i32",
                          query_start_loc_ptr="*i32"),
                     dict(BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
                          HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)), GROUP=group, GROUP_PAD=group_pad,
                          BLOCK_Q=block_q, BLOCK_N=block_n, NUM_SPLITS=splits, UPCAST=False,
                          DOT_PRECISION="ieee" if dtype == "fp32" else "tf32"),
                     ("scale_log2",)))
    # the JIT turns integer arguments equal to 1 into constants: one sequence, a one-column
    # block table and (block size 1) a unit offset stride must still compile
    jobs.append(("paged_attention bf16 one sequence, unit strides", triton_paged_attention._paged_attention_kernel,
                 dict(out_ptr="*bf16", part_out_ptr="*fp32", part_lse_ptr="*fp32", q_ptr="*bf16", cache_ptr="*bf16",
                      block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_loc_ptr="*i32"),
                 dict(num_seqs=1, stride_bt=1, BLOCK_SIZE=1, HEAD_DIM=64, HEAD_DIM_PAD=64, GROUP=1, GROUP_PAD=16,
                      BLOCK_Q=1, BLOCK_N=16, NUM_SPLITS=2, UPCAST=False, DOT_PRECISION="tf32"),
                 ("scale_log2",)))
    for splits in (2, 16):
        jobs.append((f"merge_splits splits {splits}", triton_paged_attention._merge_splits_kernel,
                     dict(out_ptr="*bf16", part_out_ptr="*fp32", part_lse_ptr="*fp32"),
                     dict(HEAD_DIM=96, HEAD_DIM_PAD=128, NUM_SPLITS=splits), ()))
    for src, dst in (("bf16", "bf16"), ("fp32", "fp16")):
        jobs.append((f"write_kv {src} -> {dst}", triton_cache_write._write_kv_kernel,
                     dict(key_ptr=f"*{src}", value_ptr=f"*{src}", cache_ptr=f"*{dst}", slot_mapping_ptr="*i64"),
                     dict(NUM_HEADS=3, HEADS_PAD=4, HEAD_DIM=64, HEAD_DIM_PAD=64, BLOCK_SIZE=16), ()))
    jobs.append(("copy_blocks bf16", triton_block_copy._copy_blocks_kernel,
                 dict(cache_ptr="*bf16", src_dst_ptr="*i64"), dict(BLOCK_ELEMS=1440, CHUNK=1024), ()))
    for name, fn, pointers, constexprs, floats in jobs:
        try:
            compile_kernel(fn, pointers, constexprs, floats)
            print(f"ok    {name}", flush=True)
        except Exception:
            failures += 1
            print(f"FAIL  {name}\n{traceback.format_exc()}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""What the host CPU can do natively, for defaults that depend on it (the CPU dtype).

bf16 matmuls are only fast where the CPU has bf16 instructions: AMX (``amx_bf16``) or AVX512-BF16
(``avx512_bf16``); elsewhere (e.g. AVX2-only CPUs) torch emulates bf16 and float32 is both faster
and exact, so ``--dtype auto`` picks bf16 on CPU only where one of those flags is present.
"""
from __future__ import annotations

import torch

from .cpu_isa import cpu_flags

NATIVE_BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def has_native_bf16(flags: frozenset[str] | None = None, capability: str | None = None) -> bool:
    """True on CPUs with AMX-BF16 or AVX512-BF16. Without ``/proc/cpuinfo`` (not Linux), torch's own
    dispatch level decides: only its AMX/BF16 levels count."""
    flags = cpu_flags() if flags is None else flags
    if flags:
        return bool(NATIVE_BF16_FLAGS & flags)
    capability = (torch.backends.cpu.get_cpu_capability() if capability is None else capability).upper()
    return "AMX" in capability or "BF16" in capability

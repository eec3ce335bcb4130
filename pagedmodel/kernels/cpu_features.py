"""What the host CPU can do natively, for defaults that depend on it (the CPU dtype).

bf16 matmuls are only fast where the CPU has bf16 instructions: AMX (``amx_bf16``) or AVX512-BF16
(``avx512_bf16``); elsewhere (e.g. AVX2-only CPUs) torch emulates bf16 and float32 is both faster
and exact, so ``--dtype auto`` picks bf16 on CPU only where one of those flags is present.
"""
from __future__ import annotations

from pathlib import Path

import torch

NATIVE_BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The ``flags`` line of ``/proc/cpuinfo`` (or of ``cpuinfo``'s text), empty if there is none."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def has_native_bf16(flags: frozenset[str] | None = None, capability: str | None = None) -> bool:
    """True on CPUs with AMX-BF16 or AVX512-BF16. Without ``/proc/cpuinfo`` (not Linux), torch's own
    dispatch level decides: only its AMX/BF16 levels count."""
    flags = cpu_flags() if flags is None else flags
    if flags:
        return bool(NATIVE_BF16_FLAGS & flags)
    capability = (torch.backends.cpu.get_cpu_capability() if capability is None else capability).upper()
    return "AMX" in capability or "BF16" in capability

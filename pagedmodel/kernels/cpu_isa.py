"""The x86-64 instruction-set levels the CPU ops are built for, and which one this CPU runs.

One wheel or image must serve any x86-64 node, so ``setup.py`` compiles the C++ sources in ``kernels/``
once per level (``-march=native`` would tie a build to the machine that made it) and the loader
(``cpu_ops.py``) picks the highest level whose instructions this CPU has. The sources choose their
code paths with the compiler's feature macros (``__AVX512F__``, ``__AVX512BF16__``, ``__AMX_TILE__``).

Stdlib only: ``setup.py`` reads ``LEVELS`` from this file before torch or the package is importable.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

# Every level: optimised, no debug info and no -fwrapv (Python's own flags add both), vectorised loops,
# float contractions, no errno from libm.
COMMON_CFLAGS = ("-O3", "-g0", "-fno-wrapv", "-fopenmp-simd", "-ffp-contract=fast", "-fno-math-errno")
# /proc/cpuinfo's names for x86-64-v3 (lzcnt is "abm" there)
V3_FLAGS = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
V4_FLAGS = V3_FLAGS | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True)
class IsaLevel:
    name: str
    cpu_flags: frozenset[str]       # what /proc/cpuinfo must list for this build to run here
    cflags: tuple[str, ...]         # what the compiler is told it may use

    @property
    def extension(self) -> str:
        """The extension module's name inside ``pagedmodel.kernels``."""
        return f"_cpu_ops_{self.name}"

    def runs_on(self, flags: frozenset[str]) -> bool:
        return self.cpu_flags <= flags

    def missing(self, flags: frozenset[str]) -> list[str]:
        return sorted(self.cpu_flags - flags)

    def sources_digest(self, kernels: Path, torch_version: str) -> str:
        """What this level's build depends on besides the compiler: every file in ``kernels``, the flags and
        torch's version. ``setup.py`` records it; the loader recomputes it in a source checkout."""
        digest = hashlib.sha256()
        for path in sorted(kernels.iterdir()):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        digest.update(" ".join((*COMMON_CFLAGS, *self.cflags)).encode() + b"\0" + torch_version.encode())
        return digest.hexdigest()


# Lowest first. AVX2 is the baseline (x86-64-v3: Haswell, Zen 1 and later); the AVX-512 levels prefer
# 512-bit vectors, which the ops' row loops are written for.
LEVELS: tuple[IsaLevel, ...] = (
    IsaLevel("avx2", V3_FLAGS, ("-march=x86-64-v3", "-mtune=generic")),
    IsaLevel("avx512", V4_FLAGS, ("-march=x86-64-v4", "-mtune=generic", "-mprefer-vector-width=512")),
    IsaLevel("avx512_bf16", V4_FLAGS | {"avx512_bf16"},
             ("-march=x86-64-v4", "-mavx512bf16", "-mtune=generic", "-mprefer-vector-width=512")),
    IsaLevel("amx", V4_FLAGS | {"avx512_bf16", "amx_tile", "amx_bf16"},
             ("-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mtune=sapphirerapids",
              "-mprefer-vector-width=512")),
)
BY_NAME = {level.name: level for level in LEVELS}


def _cpuinfo_field(key: str, cpuinfo: str | None) -> str | None:
    """The first ``key`` line's value in ``/proc/cpuinfo`` (or in ``cpuinfo``'s text); None if there is none."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == key:
            return value
    return None


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The ``flags`` line of ``/proc/cpuinfo`` (or of ``cpuinfo``'s text), empty if there is none."""
    return frozenset((_cpuinfo_field("flags", cpuinfo) or "").split())


def cpu_vendor(cpuinfo: str | None = None) -> str:
    """``vendor_id`` of ``/proc/cpuinfo`` (GenuineIntel, AuthenticAMD, ...), empty if there is none."""
    return (_cpuinfo_field("vendor_id", cpuinfo) or "").strip()


def supported(flags: frozenset[str], built: set[str] | None = None) -> list[IsaLevel]:
    """The levels this CPU runs (of those ``built``, when given), lowest first."""
    return [level for level in LEVELS if level.runs_on(flags) and (built is None or level.name in built)]


def choose(request: str, flags: frozenset[str], built: set[str]) -> IsaLevel | None:
    """The level to load for ``PAGEDMODEL_CPU_OPS=request``: ``auto``, the highest built level this CPU
    runs (None if none); ``off``, None; a level's name, that level. Raises ValueError on anything this
    CPU or this install cannot run, since loading it anyway would die on an illegal instruction."""
    if request == "off":
        return None
    if request == "auto":
        runnable = supported(flags, built)
        return runnable[-1] if runnable else None
    if request not in BY_NAME:
        raise ValueError(f"PAGEDMODEL_CPU_OPS must be auto, off or one of {', '.join(BY_NAME)}; got {request!r}")
    level = BY_NAME[request]
    if not level.runs_on(flags):
        raise ValueError(f"PAGEDMODEL_CPU_OPS={request}: this CPU lacks {', '.join(level.missing(flags))}")
    if request not in built:
        raise ValueError(f"PAGEDMODEL_CPU_OPS={request}: that level was not built at install "
                         f"(built: {', '.join(sorted(built)) or 'none'})")
    return level

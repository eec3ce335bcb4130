"""glibc malloc settings for the engine process, applied before the model loads, and the heap trims that
keep them from growing.

A step's large CPU tensors (activations, logits, KV copies: hundreds of KiB to tens of MiB, a different
size every step) can come from two places, and each has a cost:

- fresh mappings (a fixed 128 KiB mmap threshold, what serve used to set): every one is zero-filled page
  by page on first touch and unmapped on free. The engine thread of `pagedmodel serve` spent about 30 %
  of its time in the kernel (mmap, munmap, page faults), and serving the mixed workload at full load
  delivered 81 % of the offline engine's tokens/s on the same requests (2026-12-04, docs/benchmarks.md).
- the heap (glibc's default dynamic threshold, which raises itself after the first large free): no kernel
  time, but the holes between differently sized tensors stay resident: 3 minutes into a SmolLM2 run glibc
  held 488 MiB of heap arenas, 87 MiB of them free (docs/reliability.md).

So buffers up to glibc's largest threshold (32 MiB) come from the heap, the heap's top is trimmed only
past 64 MiB (not handed back and faulted in again on every free), at most two arenas serve all threads
(engine loop, event loop, executor), and ``HeapTrimmer`` gives the free pages back, holes included
(``malloc_trim(0)``), from the engine's own thread: whenever the engine goes idle, and at most every
30 s under load. A trim costs the next step its page faults once.

An operator's own MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ / MALLOC_ARENA_MAX in the environment
wins (glibc read it at start-up and we leave that setting alone). Nothing happens off glibc.
"""
from __future__ import annotations

import ctypes
import logging
import os
import platform
import time
from typing import Callable

logger = logging.getLogger("pagedmodel.server.api")

M_TRIM_THRESHOLD = -1   # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 32 << 20   # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD_BYTES = 64 << 20
ARENA_MAX = 2
TRIM_INTERVAL_S = 30.0

_SETTINGS = (("MALLOC_MMAP_THRESHOLD_", M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
             ("MALLOC_TRIM_THRESHOLD_", M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
             ("MALLOC_ARENA_MAX", M_ARENA_MAX, ARENA_MAX))


def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def tune_malloc(environ: dict[str, str] | None = None) -> dict[str, int]:
    """Apply the settings the environment does not already pin; returns those applied (name -> value)."""
    environ = dict(os.environ) if environ is None else environ
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallopt"):
        return {}
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    applied = {}
    for env_name, param, value in _SETTINGS:
        if env_name in environ:
            continue
        if mallopt(param, value) == 1:   # mallopt returns 1 on success
            applied[env_name] = value
    if applied:   # debug, not info: a serve that fails to load must print nothing but its one error line
        logger.debug("malloc: %s (step buffers from the heap, trimmed when idle and every %.0f s; set these "
                     "environment variables to override)", ", ".join(f"{k}={v}" for k, v in applied.items()),
                     TRIM_INTERVAL_S)
    return applied


class HeapTrimmer:
    """Decides when the engine loop gives free heap pages back: after a step that leaves the engine idle,
    and after any step ``interval_s`` or more since the last trim."""

    def __init__(self, trim: Callable[[], object], interval_s: float = TRIM_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic):
        self._trim = trim
        self.interval_s = interval_s
        self._clock = clock
        self._last = clock()
        self.trims = 0

    def after_step(self, idle: bool) -> bool:
        """Call on the engine's thread after each step (``idle``: no request left); True if it trimmed."""
        now = self._clock()
        if not idle and now - self._last < self.interval_s:
            return False
        self._trim()
        self._last = now
        self.trims += 1
        return True


def heap_trimmer() -> HeapTrimmer | None:
    """A trimmer calling glibc's ``malloc_trim(0)``; None off glibc."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return None
    malloc_trim = libc.malloc_trim
    malloc_trim.argtypes, malloc_trim.restype = (ctypes.c_size_t,), ctypes.c_int
    return HeapTrimmer(lambda: malloc_trim(0))

"""glibc malloc settings for the engine process, applied before the model loads.

Why: torch's CPU tensors come from malloc. glibc raises its mmap threshold every time a large mmapped
block is freed (up to 32 MiB), so after the first steps every activation, logits and KV-copy buffer of a
real model (SmolLM2: hundreds of KiB to MiBs each, a different size every step) is carved from the heap
arenas instead, and the free holes between differently sized tensors stay resident: SmolLM2 soak
engines grew 250-300 MiB after warm-up, while the tiny test model (small tensors) stayed flat, and
3 minutes into a SmolLM2 run glibc held 488 MiB of heap arenas (87 MiB of it free) against 201 MiB
(22 MiB free) with the settings below (docs/reliability.md). A fixed threshold (which also turns the
dynamic raise off) gives large buffers back to the OS on free; two arenas stop each thread that
allocates (engine loop, event loop, executor threads) from keeping a heap of its own.

An operator's own MALLOC_MMAP_THRESHOLD_ / MALLOC_ARENA_MAX in the environment wins (glibc read it at
start-up and we leave that setting alone). Nothing happens off glibc.
"""
from __future__ import annotations

import ctypes
import logging
import os
import platform

logger = logging.getLogger("pagedmodel.server.api")

M_MMAP_THRESHOLD = -3   # glibc's mallopt parameter numbers (malloc.h)
M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 128 * 1024   # glibc's initial threshold, kept fixed
ARENA_MAX = 2

_SETTINGS = (("MALLOC_MMAP_THRESHOLD_", M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
             ("MALLOC_ARENA_MAX", M_ARENA_MAX, ARENA_MAX))


def tune_malloc(environ: dict[str, str] | None = None) -> dict[str, int]:
    """Apply the settings the environment does not already pin; returns those applied (name -> value)."""
    environ = dict(os.environ) if environ is None else environ
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return {}
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return {}
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    applied = {}
    for env_name, param, value in _SETTINGS:
        if env_name in environ:
            continue
        if mallopt(param, value) == 1:   # mallopt returns 1 on success
            applied[env_name] = value
    if applied:   # debug, not info: a serve that fails to load must print nothing but its one error line
        logger.debug("malloc: %s (fixed mmap threshold and few arenas keep engine RSS from creeping; "
                    "set these environment variables to override)", ", ".join(f"{k}={v}" for k, v in applied.items()))
    return applied

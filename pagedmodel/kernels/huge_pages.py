"""CPU tensors on 2 MB pages: the KV cache and the packed weights that a decode step streams.

Why: every decode step reads all of the weights the step's GEMMs use (SmolLM2-135M: 269 MB) and the
running sequences' KV blocks, scattered over a cache of a gigabyte or more. On 4 KB pages that is a
TLB miss every 4 KB, a page walk the core waits on. Linux maps 2 MB pages into a region only when
asked (``madvise(MADV_HUGEPAGE)``, with ``/sys/kernel/mm/transparent_hugepage/enabled`` at
``madvise``, as on most distributions) or everywhere (``always``); torch's CPU allocator asks only
when ``THP_MEM_ALLOC_ENABLE`` is set before its first large allocation, which an engine imported
into a user's process cannot count on. Measured on an AMX Xeon guest (one thread, the same data on
4 KB and on 2 MB pages in one process, alternated): 30 layers' AMX linears streamed at 4-16 rows
16.6-17.0 -> 15.0-15.1 ms a step, at 32 rows 19.5 -> 18.3, at 64 alike; a decode attention call
over SmolLM2's 27-row mixed batch (11,030 context tokens, DRAM-resident) 0.747 -> 0.723 ms, over
64 short rows 0.217 -> 0.201 ms.

``empty`` and ``zeros`` allocate one tensor on 2 MB pages; ``gather`` moves several into one such
region. Where the kernel offers no transparent huge pages (or not Linux, or
``PAGEDMODEL_HUGE_PAGES=0``), they return ordinary tensors: the pages are a speed-up, never a need.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import os
import sys

import torch

log = logging.getLogger("pagedmodel.kernels.huge_pages")

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
HUGE_PAGES_ENV = "PAGEDMODEL_HUGE_PAGES"
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
ALIGN = 64   # each tensor gather places starts on a cache line


@functools.lru_cache(maxsize=1)
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


@functools.lru_cache(maxsize=1)
def _madvise():
    libc = _libc()
    if libc is None:
        return None
    fn = libc.madvise
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def available(env: str | None = None, setting_path: str = THP_SETTING) -> bool:
    """Whether allocations here ask for 2 MB pages: Linux with transparent huge pages at ``always`` or
    ``madvise``, and ``PAGEDMODEL_HUGE_PAGES`` not ``0``."""
    choice = (os.environ.get(HUGE_PAGES_ENV, "") if env is None else env).strip().lower() or "1"
    if choice not in ("0", "1"):
        raise ValueError(f"{HUGE_PAGES_ENV} must be 0 or 1, got {choice!r}")
    if choice == "0" or _madvise() is None:
        return False
    try:
        with open(setting_path) as f:
            setting = f.read()
    except OSError:
        return False
    return "[always]" in setting or "[madvise]" in setting


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose memory starts on a 2 MB boundary and is advised to be mapped on
    2 MB pages (an ordinary ``torch.empty`` where ``available()`` is false). The advice takes effect as
    the pages are first written, so it must come before any write: this is the place for that."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not available() or nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    raw = torch.empty(span + HUGE_PAGE, dtype=torch.uint8)   # never written outside the aligned span
    offset = -raw.data_ptr() % HUGE_PAGE
    if _madvise()(raw.data_ptr() + offset, span, MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) refused (errno %d); 4 KB pages", ctypes.get_errno())
    # the view keeps `raw`'s storage alive
    return raw[offset:offset + nbytes].view(dtype).view(shape)


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``empty`` filled with zeros."""
    return empty(shape, dtype).zero_()


def gather(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of CPU ``tensors`` (contiguous, any dtypes) side by side in one ``empty`` region, each
    starting on a cache line; the caller swaps them in for the originals, which are then freed."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.nbytes // ALIGN) * ALIGN
    region = empty((total,), torch.uint8)
    copies = []
    for t, at in zip(tensors, offsets):
        copy = region[at:at + t.nbytes].view(t.dtype).view(t.shape)
        copy.copy_(t)
        copies.append(copy)
    return copies


def return_freed_memory() -> None:
    """Hands the heap's free memory back to the kernel (glibc's ``malloc_trim``; a no-op elsewhere). Tensors
    of a few megabytes come from the heap, and the originals ``gather`` replaced stay resident there
    otherwise: on SmolLM2 the process kept 140-490 MB more than before the move."""
    trim = getattr(_libc(), "malloc_trim", None)   # None off Linux, or without glibc
    if trim is not None:
        trim(0)

"""The engine's malloc settings (pagedmodel.server.api.allocator): after them, a large buffer freed and a
smaller large one allocated still goes to mmap (given back to the OS on free) instead of the heap, where
glibc's default dynamic threshold would put it; an operator's environment setting wins."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from pagedmodel.server.api.allocator import tune_malloc

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

# Free a 4 MiB block (mmapped: over the initial 128 KiB threshold), then allocate 1 MiB and report
# whether that one was mmapped too (mallinfo2's mmapped bytes grew by it) or came from the heap.
PROBE = """
import ctypes, json, sys
from pagedmodel.server.api.allocator import tune_malloc
applied = tune_malloc() if sys.argv[1] == "tuned" else {}
libc = ctypes.CDLL(None)
class MI(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = MI
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.free(libc.malloc(4 << 20))
before = libc.mallinfo2().hblkhd
p = libc.malloc(1 << 20)
grew = libc.mallinfo2().hblkhd - before
libc.free(p)
print(json.dumps({"applied": applied, "mmapped": grew >= (1 << 20)}))
"""


def _probe(mode: str, **env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_default_glibc_moves_large_buffers_to_the_heap_after_a_free():
    """Guards the premise: without the settings, glibc's dynamic threshold sends the 1 MiB buffer to the heap."""
    assert _probe("default") == {"applied": {}, "mmapped": False}


def test_tuned_malloc_keeps_large_buffers_mmapped():
    """Guards: with the engine's settings, large buffers stay mmapped (returned to the OS when freed)."""
    got = _probe("tuned")
    assert got["mmapped"] is True
    assert got["applied"] == {"MALLOC_MMAP_THRESHOLD_": 128 * 1024, "MALLOC_ARENA_MAX": 2}


def test_operator_environment_wins():
    """Guards: a MALLOC_* variable the operator set is left to glibc, not overridden."""
    assert tune_malloc({"MALLOC_ARENA_MAX": "8", "MALLOC_MMAP_THRESHOLD_": "65536"}) == {}
    got = _probe("tuned", MALLOC_ARENA_MAX="4")
    assert got["applied"] == {"MALLOC_MMAP_THRESHOLD_": 128 * 1024}

"""The engine's malloc settings and heap trims (pagedmodel.server.api.allocator).

After the settings, a step-sized buffer (1 MiB, say) comes from the heap at once instead of a fresh
mapping (no page faults on every step), a buffer over 32 MiB is still mapped, and a trim gives a freed
hole in the middle of the heap back to the OS. The trimmer trims when the engine goes idle and at most
every interval under load. An operator's environment setting wins.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from pagedmodel.server.api.allocator import MMAP_THRESHOLD_BYTES, HeapTrimmer, tune_malloc

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

# Allocate 1 MiB and 40 MiB (each: mmapped or from the heap?), then free a touched 16 MiB heap hole
# below a live small block, and report the RSS before and after one trim.
PROBE = """
import ctypes, json, sys
from pagedmodel.server.api.allocator import heap_trimmer, tune_malloc
applied = tune_malloc() if sys.argv[1] == "tuned" else {}
libc = ctypes.CDLL(None)
class MI(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = MI
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def mapped(size):
    before = libc.mallinfo2().hblkhd
    p = libc.malloc(size)
    grew = libc.mallinfo2().hblkhd - before >= size
    libc.free(p)
    return grew
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
small_mapped, large_mapped = mapped(1 << 20), mapped(40 << 20)
hole = libc.malloc(16 << 20)
ctypes.memset(hole, 1, 16 << 20)
pin = libc.malloc(4096)                  # keeps the hole off the heap's top
libc.free(hole)
before = rss()
trimmed = heap_trimmer().after_step(idle=True)
print(json.dumps({"applied": applied, "small_mapped": small_mapped, "large_mapped": large_mapped,
                  "trimmed": trimmed, "released": before - rss()}))
"""


def _probe(mode: str, **env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_glibc_default_maps_a_first_large_buffer():
    """Guards the premise: before any large free, glibc's default 128 KiB threshold maps 1 MiB afresh."""
    got = _probe("default")
    assert got["applied"] == {} and got["small_mapped"] is True


def test_tuned_malloc_serves_step_buffers_from_the_heap_and_trims_its_holes():
    got = _probe("tuned")
    assert got["applied"] == {"MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD_BYTES, "MALLOC_TRIM_THRESHOLD_": 64 << 20,
                              "MALLOC_ARENA_MAX": 2}
    assert got["small_mapped"] is False and got["large_mapped"] is True
    assert got["trimmed"] is True and got["released"] >= 12 << 20, got   # the 16 MiB hole went back


def test_operator_environment_wins():
    """Guards: a MALLOC_* variable the operator set is left to glibc, not overridden."""
    assert tune_malloc({"MALLOC_ARENA_MAX": "8", "MALLOC_MMAP_THRESHOLD_": "65536",
                        "MALLOC_TRIM_THRESHOLD_": "0"}) == {}
    got = _probe("tuned", MALLOC_ARENA_MAX="4", MALLOC_MMAP_THRESHOLD_="131072")
    assert got["applied"] == {"MALLOC_TRIM_THRESHOLD_": 64 << 20}
    assert got["small_mapped"] is True        # the operator's 128 KiB threshold, not ours


def test_trimmer_trims_when_idle_and_every_interval_under_load():
    now = [0.0]
    calls: list[float] = []
    trimmer = HeapTrimmer(lambda: calls.append(now[0]), interval_s=30, clock=lambda: now[0])
    decisions = []
    for t, idle in ((1, False), (29, False), (31, False), (40, True), (41, True), (60, False), (71, False)):
        now[0] = t
        decisions.append(trimmer.after_step(idle))
    assert decisions == [False, False, True, True, True, False, True]
    assert calls == [31, 40, 41, 71] and trimmer.trims == 4

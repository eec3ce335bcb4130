"""Launch-side helpers shared by the Triton kernels: interpreter detection and device checks."""
from __future__ import annotations

import torch
from triton import knobs

INTERPRET_ENV = "TRITON_INTERPRET"


def interpreting() -> bool:
    """True when Triton runs kernels in its numpy interpreter (``TRITON_INTERPRET=1``)."""
    return bool(knobs.runtime.interpret)


def require_launchable(device: torch.device) -> None:
    """Fail with a clear message instead of Triton's driver error when no backend can run."""
    if device.type == "cuda" or interpreting():
        return
    raise RuntimeError(f"the Triton attention kernels need CUDA tensors, or {INTERPRET_ENV}=1 set "
                       f"before triton is imported to run them on {device.type} tensors; "
                       "use PAGEDMODEL_ATTENTION_BACKEND=torch for the pure-torch path")


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (tl.arange extents must be powers of two)."""
    return 1 << max(0, (n - 1).bit_length())

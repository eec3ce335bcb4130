"""The Triton attention backend: same entry points and signatures as ``torch_attention``.

``backend.select_backend`` imports this module lazily (only when the Triton path is chosen),
so CPU-only installs never need triton. Under ``TRITON_INTERPRET=1`` (set before triton is
first imported) the same kernels run on CPU tensors, which is how the tests check them
against the pure-torch oracle.
"""
from __future__ import annotations

from .triton_block_copy import copy_blocks
from .triton_cache_write import write_kv
from .triton_paged_attention import paged_attention

__all__ = ["write_kv", "paged_attention", "copy_blocks"]

"""The CPU ops, built on first use: the attention op for short query rows (decode, small chunks), the
per-row argmax + log-sum-exp and the random draws a sampling step needs, a decoder layer's fused
elementwise ops, and bf16-weight linears.

``cpu_paged_attention.cpp`` reads each row's own K/V blocks in place from the paged cache (no
gather, no padding to the batch's longest context, no float32 copy of the cache).
``cpu_logits_stats.cpp`` gives each logits row's argmax and log-sum-exp in two passes (the sampler's
greedy tokens and chosen-token logprobs without a full log_softmax). ``cpu_layer_ops.cpp`` fuses the
residual add with RMSNorm, SiLU(gate) x up, and rotary embedding. ``cpu_bf16_linear.cpp`` multiplies
bf16 weights in float32 (small steps of ``cpu_linear.PackedLinear`` on CPUs without AMX).
``cpu_sampling.cpp`` draws the random rows' tokens (temperature, top-k, min-p, top-p, without a sort).
``cpu_prefill_attention.cpp`` runs long prompt chunks' causal attention over a bf16 cache on VDPBF16PS
(built only where the CPU has AVX512-BF16). ``cpu_cache_write.cpp`` writes a step's K/V rows into their
cache slots. ``cpu_amx_linear.cpp`` multiplies bf16 weights on AMX tiles (small steps of ``PackedLinear`` on
CPUs with AMX; built only there). All eight are compiled into one extension with
``torch.utils.cpp_extension`` the first time a process needs it
(tens of seconds, once per machine: the build is cached under ``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``, keyed by the sources, flags, torch version and CPU flags, since
``-march=native`` code must not run on another CPU). Without a C++ compiler, or with
``PAGEDMODEL_CPU_ATTENTION_OP=off``, ``load()``, ``logits_stats()``, ``layer_ops()``, ``bf16_linear()``,
``amx_linear()``, ``sampling()``, ``bf16_prefill()`` and ``cache_write()`` return None and torch ops do the
same work (``torch_attention``, the sampler's fallbacks, the
model's torch path, oneDNN's linears).
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from .cpu_features import cpu_flags

log = logging.getLogger("pagedmodel.kernels.cpu_op")

OP_ENV = "PAGEDMODEL_CPU_ATTENTION_OP"
OP_ENV_VALUES = ("auto", "off")
HERE = Path(__file__).parent
SOURCES = (HERE / "cpu_paged_attention.cpp", HERE / "cpu_logits_stats.cpp", HERE / "cpu_layer_ops.cpp",
           HERE / "cpu_bf16_linear.cpp", HERE / "cpu_sampling.cpp", HERE / "cpu_prefill_attention.cpp",
           HERE / "cpu_cache_write.cpp", HERE / "cpu_amx_linear.cpp")
HEADERS = (HERE / "cpu_vector_math.h", HERE / "cpu_amx_tiles.h", HERE / "cpu_cache_write.h")
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp-simd", "-ffp-contract=fast",
          "-fno-math-errno"]

STALE_LOCK_S = 900.0   # a build takes 1-3 minutes on 2 cores; an older lock was left by a killed one

_lock = threading.Lock()
_state: dict[str, object] = {}   # "op": the loaded op or None, "error": why it is None


def _cpu_description() -> str:
    """What the ``-march=native`` binary depends on: the CPU's flags, or torch's dispatch level."""
    return " ".join(sorted(cpu_flags())) or torch.backends.cpu.get_cpu_capability()


def build_name() -> str:
    """The extension's name: a digest of everything that changes the binary."""
    digest = hashlib.sha256()
    parts = [path.read_bytes() for path in (*SOURCES, *HEADERS)]
    for part in (*parts, " ".join(CFLAGS).encode(), torch.__version__.encode(), _cpu_description().encode()):
        digest.update(part)
        digest.update(b"\0")
    return f"pagedmodel_cpu_attention_{digest.hexdigest()[:16]}"


def enabled(env: str | None = None) -> bool:
    choice = (os.environ.get(OP_ENV, "") if env is None else env).strip().lower() or "auto"
    if choice not in OP_ENV_VALUES:
        raise ValueError(f"{OP_ENV} must be one of {OP_ENV_VALUES}, got {choice!r}")
    return choice == "auto"


def load() -> Callable[..., torch.Tensor] | None:
    """``torch.ops.pagedmodel.paged_rows_attention``, building it on first call; None if unavailable."""
    if not enabled():
        return None
    with _lock:
        if "op" not in _state:
            _state["op"] = _build()
        return _state["op"]  # type: ignore[return-value]


def logits_stats() -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """``torch.ops.pagedmodel.logits_argmax_logsumexp`` (built with the attention op); None if unavailable."""
    return None if load() is None else torch.ops.pagedmodel.logits_argmax_logsumexp


def layer_ops() -> object | None:
    """``torch.ops.pagedmodel``, holding ``fused_add_rms_norm``, ``silu_and_mul`` and ``rotary_embedding``
    (``cpu_layer_ops.cpp``), built with the attention op; None if unavailable."""
    return None if load() is None else torch.ops.pagedmodel


def bf16_linear() -> Callable[..., torch.Tensor] | None:
    """``torch.ops.pagedmodel.bf16_weight_linear`` (``cpu_bf16_linear.cpp``, built with the attention op);
    None if unavailable."""
    return None if load() is None else torch.ops.pagedmodel.bf16_weight_linear


def amx_linear() -> Callable[..., torch.Tensor] | None:
    """``torch.ops.pagedmodel.amx_bf16_linear`` (``cpu_amx_linear.cpp``, built with the attention op where the
    build targets AMX-BF16); None if unavailable, or if this process may not use AMX tiles."""
    return _amx_op("amx_bf16_linear")


def amx_tiles_permitted(linear_op: Callable[..., torch.Tensor]) -> bool:
    """Whether the AMX ops run in this process: Linux hands out tile state only on request (arch_prctl), which
    a sandbox's seccomp policy may refuse, and the ops then raise on every call. One call on one tile tells."""
    try:
        linear_op(torch.zeros(1, 32, dtype=torch.bfloat16), torch.zeros(1, 1, 512, dtype=torch.int16), 16, None, False)
        return True
    except RuntimeError as exc:
        log.warning("AMX tiles refused here (%s); VDPBF16PS and oneDNN serve instead", str(exc).strip()[:200])
        return False


def _amx_op(name: str) -> Callable[..., torch.Tensor] | None:
    if load() is None or getattr(torch.ops.pagedmodel, "amx_bf16_linear", None) is None:
        return None
    with _lock:
        if "amx_permitted" not in _state:
            _state["amx_permitted"] = amx_tiles_permitted(torch.ops.pagedmodel.amx_bf16_linear)
    return getattr(torch.ops.pagedmodel, name, None) if _state["amx_permitted"] else None


def sampling() -> Callable[..., torch.Tensor] | None:
    """``torch.ops.pagedmodel.sample_from_logits`` (``cpu_sampling.cpp``, built with the attention op);
    None if unavailable."""
    return None if load() is None else torch.ops.pagedmodel.sample_from_logits


def bf16_prefill() -> Callable[..., torch.Tensor] | None:
    """``torch.ops.pagedmodel.bf16_prefill_attention`` (``cpu_prefill_attention.cpp``, built with the attention
    op where the build has AVX512-BF16); None if unavailable."""
    return None if load() is None else getattr(torch.ops.pagedmodel, "bf16_prefill_attention", None)


def amx_prefill() -> Callable[..., torch.Tensor] | None:
    """``torch.ops.pagedmodel.amx_prefill_attention`` (``cpu_prefill_attention.cpp`` on AMX tiles, built with the
    attention op where the build targets AMX-BF16); None if unavailable, or if this process may not use AMX tiles."""
    return _amx_op("amx_prefill_attention")


def cache_write() -> Callable[..., None] | None:
    """``torch.ops.pagedmodel.write_kv`` (``cpu_cache_write.cpp``, built with the attention op); None if unavailable."""
    return None if load() is None else torch.ops.pagedmodel.write_kv


def load_error() -> str | None:
    """Why ``load()`` returned None (None if it has not failed)."""
    return _state.get("error")  # type: ignore[return-value]


def _registered() -> Callable[..., torch.Tensor] | None:
    """The op if this process has loaded it already (e.g. through another import path)."""
    return getattr(torch.ops.pagedmodel, "paged_rows_attention", None)


def clear_stale_lock(build_dir: Path, now: float | None = None) -> bool:
    """Removes ``build_dir/lock`` if it is older than ``STALE_LOCK_S``; True if it did.

    torch's extension builder waits, without a timeout, while another process holds that lock file, so a
    build killed half-way (a test run stopped with Ctrl-C) left every later process hanging at its first
    CPU op until someone deleted the file by hand."""
    lock = build_dir / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < STALE_LOCK_S:
        return False
    log.warning("removing %s, left %.0f s ago by a build that did not finish", lock, age)
    lock.unlink(missing_ok=True)
    return True


def _build() -> Callable[..., torch.Tensor] | None:
    if (op := _registered()) is not None:
        return op
    try:
        from torch.utils import cpp_extension

        clear_stale_lock(Path(cpp_extension._get_build_directory(build_name(), verbose=False)))
        cpp_extension.load(name=build_name(), sources=[str(p) for p in SOURCES], extra_cflags=CFLAGS,
                           extra_include_paths=[str(HERE)], is_python_module=False, verbose=False)
        return torch.ops.pagedmodel.paged_rows_attention
    except Exception as exc:   # an optimisation: without it the pure-torch path serves
        _state["error"] = f"{type(exc).__name__}: {str(exc).strip()[:500]}"
        log.warning("CPU attention op unavailable (%s); attention runs on torch ops", _state["error"])
        return None

"""The CPU ops, compiled at install and loaded here: one build per x86-64 level, the highest this CPU runs.

The C++ sources live in the repository's top-level ``kernels/``; ``setup.py`` compiles them once per level
of ``cpu_isa.LEVELS`` (AVX2, AVX-512, AVX-512 BF16, AMX) into ``pagedmodel/kernels/_cpu_ops_<level>*.so``
and records the outcome in ``cpu_ops_build.json``. A process loads exactly one level (they register the
same op names) with ``torch.ops.load_library``: nothing is compiled when a process starts, nothing is
written, no lock is taken.

The ops (all in ``torch.ops.pagedmodel``):

- ``cpu_paged_attention.cpp``: attention for short query rows (decode, small chunks), reading each row's
  own K/V blocks in place from the paged cache (no gather, no padding, no float32 copy of the cache);
- ``cpu_logits_stats.cpp``: each logits row's argmax and log-sum-exp in two passes;
- ``cpu_layer_ops.cpp``: residual add + RMSNorm, SiLU(gate) x up, rotary embedding (with the cache write);
- ``cpu_bf16_linear.cpp``: bf16-weight linears in float32 for small steps (``cpu_linear.PackedLinear``);
- ``cpu_sampling.cpp``: the random rows' draws (temperature, top-k, min-p, top-p, without a sort);
- ``cpu_prefill_attention.cpp``: long prompt chunks' causal attention on VDPBF16PS (AVX-512 BF16 levels)
  and on AMX tiles (AMX level);
- ``cpu_cache_write.cpp``: a step's K/V rows into their cache slots;
- ``cpu_amx_linear.cpp``: bf16 weights on AMX tiles (AMX level).

``PAGEDMODEL_CPU_OPS``: ``auto`` (default: the highest level built and runnable here), ``off`` (torch ops
only), or a level's name (tests run each level the CPU supports against the torch reference this way).
Where no level was built (no C++ compiler at install) or none runs here, every accessor returns None, the
engine logs one warning, and torch ops do the same work (``torch_attention``, the sampler's fallbacks,
the model's torch path, oneDNN's linears).
"""
from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from . import cpu_isa

log = logging.getLogger("pagedmodel.kernels.cpu_ops")

OPS_ENV = "PAGEDMODEL_CPU_OPS"
HERE = Path(__file__).resolve().parent
MANIFEST = HERE / "cpu_ops_build.json"
SOURCE_KERNELS = HERE.parent.parent / "kernels"    # present in a source checkout, absent in a wheel
REBUILD_HINT = "rebuild them with `pip install -e .`"

_lock = threading.Lock()


@dataclass(frozen=True)
class LoadedOps:
    level: cpu_isa.IsaLevel
    path: Path


_state: dict[str, object] = {}   # "ops": LoadedOps or None, "error": why it is None


def request(env: str | None = None) -> str:
    """``PAGEDMODEL_CPU_OPS`` (or ``env``), lowered; ``auto`` when unset. ValueError on anything else than
    ``auto``, ``off`` or a level's name."""
    choice = (os.environ.get(OPS_ENV, "") if env is None else env).strip().lower() or "auto"
    if choice not in ("auto", "off", *cpu_isa.BY_NAME):
        raise ValueError(f"{OPS_ENV} must be auto, off or one of {', '.join(cpu_isa.BY_NAME)}; got {choice!r}")
    return choice


def enabled(env: str | None = None) -> bool:
    return request(env) != "off"


def built_levels(manifest: Path | None = None) -> dict[str, dict]:
    """The install's record of each level: ``file`` where it built, ``error`` where it did not."""
    try:
        return json.loads((manifest or MANIFEST).read_text())["levels"]
    except FileNotFoundError:
        return {}


def stale_levels(manifest: Path | None = None, sources: Path = SOURCE_KERNELS) -> list[str]:
    """In a source checkout, the built levels whose sources, flags or torch changed since: a developer who
    edited ``kernels/`` and did not reinstall would otherwise test the old binary. Empty in a wheel."""
    return [name for name, entry in built_levels(manifest).items() if "file" in entry and _stale(name, entry, sources)]


def _stale(name: str, entry: dict, sources: Path) -> bool:
    """Whether ``entry``'s build differs from the sources of a checkout (False where there are none)."""
    return (sources / "cpu_paged_attention.cpp").is_file() and \
        entry["digest"] != cpu_isa.BY_NAME[name].sources_digest(sources, torch.__version__)


def load() -> LoadedOps | None:
    """The loaded build, loading the chosen level at the first call; None (and ``load_error()``) if none can be,
    or while ``PAGEDMODEL_CPU_OPS=off``. One level per process: the builds register the same op names."""
    choice = request()
    if choice == "off":
        return None
    with _lock:
        if "ops" not in _state:
            _state["ops"] = _load(choice)
        ops = _state["ops"]
    if ops is not None and choice not in ("auto", ops.level.name):  # type: ignore[union-attr]
        raise ValueError(f"{OPS_ENV}={choice}, but this process loaded the {ops.level.name} build "  # type: ignore[union-attr]
                         "(one level per process)")
    return ops  # type: ignore[return-value]


def _load(choice: str) -> LoadedOps | None:
    levels = built_levels()
    built = {name for name, entry in levels.items() if "file" in entry}
    level = cpu_isa.choose(choice, cpu_isa.cpu_flags(), built)   # ValueError: asked for what cannot run here
    if level is None:
        return _unavailable(_why_none(levels))
    path = HERE / levels[level.name]["file"]
    # the loaded level alone: hashing kernels/ for every level at each start is work nobody reads
    if _stale(level.name, levels[level.name], SOURCE_KERNELS):
        log.warning("the CPU ops' %s build is older than the sources in %s: %s", level.name, SOURCE_KERNELS,
                    REBUILD_HINT)
    try:
        torch.ops.load_library(str(path))
    except Exception as exc:   # noqa: BLE001 - a broken build must not stop the engine: torch ops serve
        return _unavailable(f"loading {path.name} failed: {type(exc).__name__}: {str(exc).strip()[:300]}")
    log.info("CPU ops: the %s build (%s)", level.name, path.name)
    return LoadedOps(level, path)


def _why_none(levels: dict[str, dict]) -> str:
    if not levels:
        return f"no CPU ops were built at install (no {MANIFEST.name}): {REBUILD_HINT}"
    failures = "; ".join(f"{name}: {entry['error']}" for name, entry in levels.items() if "error" in entry)
    if failures and not any("file" in entry for entry in levels.values()):
        return f"the CPU ops did not build at install ({failures[:400]}); {REBUILD_HINT} and a C++ compiler"
    lowest = cpu_isa.LEVELS[0]
    return f"this CPU runs none of the built levels (the lowest, {lowest.name}, needs {', '.join(sorted(lowest.cpu_flags))})"


def _unavailable(reason: str) -> None:
    _state["error"] = reason
    log.warning("CPU ops unavailable: %s; torch ops serve instead (slower)", reason)
    return None


def load_error() -> str | None:
    """Why ``load()`` returned None (None if it has not failed)."""
    return _state.get("error")  # type: ignore[return-value]


def level() -> cpu_isa.IsaLevel | None:
    """The loaded build's level, None when no build is loaded."""
    ops = load()
    return None if ops is None else ops.level


def level_flags() -> frozenset[str]:
    """The CPU flags the loaded build was compiled for (empty when none is loaded): what decides which of our
    ops exist in this process, where the CPU's own flags may name more."""
    ops = load()
    return frozenset() if ops is None else ops.level.cpu_flags


def _op(name: str) -> Callable | None:
    return None if load() is None else getattr(torch.ops.pagedmodel, name, None)


def paged_attention() -> Callable[..., torch.Tensor] | None:
    """``paged_rows_attention`` (``cpu_paged_attention.cpp``); None if unavailable."""
    return _op("paged_rows_attention")


def logits_stats() -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """``logits_argmax_logsumexp`` (``cpu_logits_stats.cpp``); None if unavailable."""
    return _op("logits_argmax_logsumexp")


def layer_ops() -> object | None:
    """``torch.ops.pagedmodel``, holding ``fused_add_rms_norm``, ``silu_and_mul``, ``rotary_embedding`` and
    ``rotary_and_write_kv`` (``cpu_layer_ops.cpp``); None if unavailable."""
    return None if load() is None else torch.ops.pagedmodel


def bf16_linear() -> Callable[..., torch.Tensor] | None:
    """``bf16_weight_linear`` (``cpu_bf16_linear.cpp``); None if unavailable."""
    return _op("bf16_weight_linear")


def sampling() -> Callable[..., torch.Tensor] | None:
    """``sample_from_logits`` (``cpu_sampling.cpp``); None if unavailable."""
    return _op("sample_from_logits")


def bf16_prefill() -> Callable[..., torch.Tensor] | None:
    """``bf16_prefill_attention`` (``cpu_prefill_attention.cpp``, AVX-512 BF16 and AMX levels); None elsewhere."""
    return _op("bf16_prefill_attention")


def cache_write() -> Callable[..., None] | None:
    """``write_kv`` (``cpu_cache_write.cpp``); None if unavailable."""
    return _op("write_kv")


def amx_linear() -> Callable[..., torch.Tensor] | None:
    """``amx_bf16_linear`` (``cpu_amx_linear.cpp``, AMX level); None elsewhere, or if this process may not use
    AMX tiles."""
    return _amx_op("amx_bf16_linear")


def amx_prefill() -> Callable[..., torch.Tensor] | None:
    """``amx_prefill_attention`` (``cpu_prefill_attention.cpp`` on AMX tiles, AMX level); None elsewhere, or if
    this process may not use AMX tiles."""
    return _amx_op("amx_prefill_attention")


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
    linear = _op("amx_bf16_linear")
    if linear is None:
        return None
    with _lock:
        if "amx_permitted" not in _state:
            _state["amx_permitted"] = amx_tiles_permitted(linear)
    return _op(name) if _state["amx_permitted"] else None

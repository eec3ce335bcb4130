"""Linear layers with oneDNN-prepacked weights: the fp32 CPU path for the model's projections.

Why: on an AVX2 CPU at the engine's shapes (M = tokens in the step, K/N = 576/960/1536/3072/49,152)
oneDNN's matmul over a weight reordered once into its blocked layout beats MKL's ``F.linear``,
which re-reads the row-major weight on every call, by 15-50 % on the large weights (gate/up and the
tied 49,152-wide lm_head) once a step has more than a few rows; for one row it is slower, so steps
under ``MIN_ROWS`` rows keep ``F.linear`` (the weight stays, so both paths are exact float32 GEMMs).
This is what vLLM's CPU backend does for unquantized linears on x86 (a prepacked oneDNN matmul
handle per layer). The reorder needs fp32 (bf16 needs AVX512/AVX-NE-CONVERT), a CPU tensor and
torch built with mkldnn; anything else keeps the plain layers.

``PAGEDMODEL_CPU_LINEAR=packed|off`` (default ``packed`` where it applies) turns it off.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("pagedmodel.kernels.cpu_linear")

LINEAR_ENV = "PAGEDMODEL_CPU_LINEAR"
LINEAR_ENV_VALUES = ("packed", "off")
MIN_ROWS = 8   # below this many rows F.linear's unpacked GEMM is as fast or faster (measured at M = 1)


def enabled(env: str | None = None) -> bool:
    choice = (os.environ.get(LINEAR_ENV, "") if env is None else env).strip().lower() or "packed"
    if choice not in LINEAR_ENV_VALUES:
        raise ValueError(f"{LINEAR_ENV} must be one of {LINEAR_ENV_VALUES}, got {choice!r}")
    return choice == "packed"


def applies(weight: torch.Tensor) -> bool:
    """Whether oneDNN can prepack this weight here (fp32, CPU, torch built with mkldnn)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and torch.backends.mkldnn.is_available())


class PackedLinear(nn.Module):
    """``y = x @ weight.T + bias`` through a oneDNN-packed copy of ``weight`` for steps of ``MIN_ROWS``+ rows."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = bias
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] >= MIN_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def pack_linears(model: nn.Module) -> int:
    """Replaces every fp32 CPU ``nn.Linear`` in ``model`` by a ``PackedLinear`` sharing its parameters;
    returns how many were replaced (0 when turned off or not applicable)."""
    if not enabled():
        return 0
    targets = [(name, mod) for name, mod in model.named_modules() if type(mod) is nn.Linear and applies(mod.weight)]
    for name, mod in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, PackedLinear(mod.weight, mod.bias))
    if targets:
        log.info("%d linear layers use oneDNN-prepacked weights (%s=off turns it off)", len(targets), LINEAR_ENV)
    return len(targets)

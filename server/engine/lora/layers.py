"""The projections' LoRA wrappers: the base matmul once for the whole step, then each adapter's
low-rank update on its own rows only (gathered matmuls per row group), so one step serves rows of
several adapters and of the base model together.

Our q/k/v and gate/up projections are fused; an adapter's q_proj update lands on the q slice of
``qkv_proj``'s output, and so on. The update is computed in PEFT's order, ``((x @ A.T) @ B.T) * scaling``,
so greedy outputs match HF + peft.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .adapter import LoRAAdapter

# our fused module -> the HF projections it holds, in output order
FUSED = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "self_attn.o_proj": ("o_proj",),
         "mlp.gate_up_proj": ("gate_proj", "up_proj"), "mlp.down_proj": ("down_proj",)}


@dataclass
class LoRABatch:
    """A step's rows by adapter slot: (slot, row indices, or None when every row uses that slot)."""

    groups: list[tuple[int, torch.Tensor | None]]


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, slices: list[tuple[str, int]], num_slots: int, state: "LoRAState"):
        super().__init__()
        self.base = base
        self.names = [name for name, _ in slices]
        self.spans, offset = [], 0
        for _, size in slices:
            self.spans.append((offset, size))
            offset += size
        # slot -> per slice (A [r, in], B [out, r]) on the device, or None where the adapter skips it
        self.weights: list[list[tuple[torch.Tensor, torch.Tensor] | None]] = [[None] * len(slices) for _ in range(num_slots)]
        self.scaling = [0.0] * num_slots
        self.state = state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.state.batch
        if batch is None:
            return y
        for slot, rows in batch.groups:
            per_slice = self.weights[slot]
            if not any(per_slice):
                continue
            xs = x if rows is None else x.index_select(0, rows)
            for (offset, size), ab in zip(self.spans, per_slice):
                if ab is None:
                    continue
                a, b = ab
                delta = ((xs @ a.t()) @ b.t()) * self.scaling[slot]
                if rows is None:
                    y[:, offset:offset + size] += delta
                else:
                    y[rows, offset:offset + size] += delta
        return y


class LoRAState:
    """The model's LoRA wrappers, the adapters' weights in its slots, and the current step's batch."""

    def __init__(self, model: nn.Module, num_slots: int):
        self.num_slots = num_slots
        self.batch: LoRABatch | None = None
        self.device = next(model.parameters()).device
        self._wrappers: dict[tuple[int, str], tuple[LoRALinear, int]] = {}   # (layer, HF name) -> (wrapper, slice)
        for i, layer in enumerate(model.layers):
            for fused, names in FUSED.items():
                parent_name, _, attr = fused.rpartition(".")
                parent = layer.get_submodule(parent_name)
                base = getattr(parent, attr)
                sizes = _slice_sizes(base, len(names), layer, fused)
                wrapper = LoRALinear(base, list(zip(names, sizes)), num_slots, self)
                setattr(parent, attr, wrapper)
                for j, name in enumerate(names):
                    self._wrappers[(i, name)] = (wrapper, j)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Puts the adapter's weights in ``slot``, replacing whatever was there."""
        self.clear(slot)
        for (layer, name), (a, b) in adapter.weights.items():
            wrapper, j = self._wrappers[(layer, name)]
            wrapper.weights[slot][j] = (a.to(self.device), b.to(self.device))
        for wrapper, _ in self._wrappers.values():
            wrapper.scaling[slot] = adapter.scaling

    def clear(self, slot: int) -> None:
        for wrapper, j in self._wrappers.values():
            wrapper.weights[slot][j] = None


def _slice_sizes(base: nn.Module, parts: int, layer: nn.Module, fused: str) -> list[int]:
    out = base.out_features if hasattr(base, "out_features") else base.weight.shape[0]
    if fused == "self_attn.qkv_proj":
        attn = layer.self_attn
        return [attn.q_size, attn.kv_size, attn.kv_size]
    if fused == "mlp.gate_up_proj":
        return [layer.mlp.intermediate, layer.mlp.intermediate]
    assert parts == 1
    return [out]

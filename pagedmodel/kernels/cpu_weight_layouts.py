"""The packed weight layouts the C++ CPU GEMMs read: 32-column panels (cpu_bf16_linear.cpp) and AMX tiles
(cpu_amx_linear.cpp). A leaf: the packed layer (cpu_linear.py) and the plan's measurements
(cpu_linear_plan.py) both pack with it.
"""
from __future__ import annotations

import torch

PANEL = 32                          # output columns per panel (cpu_bf16_linear.cpp)
AMX_TILE_COLS, AMX_TILE_DEPTH = 16, 32   # a weight tile's output and input columns (cpu_amx_linear.cpp)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ([N, K] bf16) in ``cpu_bf16_linear.cpp``'s layout: [panels, K/2, 64] int16, zero-padded to
    whole 32-column panels and an even K; in a panel, per input pair (k, k+1), two blocks of 16 columns
    of (W[n][k], W[n][k+1]) pairs."""
    n, k = weight.shape
    rows, cols = -(-n // PANEL) * PANEL, k + k % 2
    padded = weight.new_zeros(rows, cols, dtype=torch.bfloat16)
    padded[:n, :k] = weight
    blocks = padded.view(torch.int16).view(rows // PANEL, 2, PANEL // 2, cols // 2, 2)
    return blocks.permute(0, 3, 1, 2, 4).contiguous().view(rows // PANEL, cols // 2, 2 * PANEL)


def pack_amx_tiles(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ([N, K] bf16) in ``cpu_amx_linear.cpp``'s layout: [N/16, K/32, 512] int16, zero-padded to whole
    tiles; tile (n, d) holds, for each input pair (k, k+1) of its 32 columns, the 16 columns' (W[n][k], W[n][k+1])."""
    n, k = weight.shape
    rows, cols = -(-n // AMX_TILE_COLS) * AMX_TILE_COLS, -(-k // AMX_TILE_DEPTH) * AMX_TILE_DEPTH
    padded = weight.new_zeros(rows, cols, dtype=torch.bfloat16)
    padded[:n, :k] = weight
    tiles = padded.view(torch.int16).view(rows // AMX_TILE_COLS, AMX_TILE_COLS, cols // AMX_TILE_DEPTH, AMX_TILE_DEPTH // 2, 2)
    return tiles.permute(0, 2, 3, 1, 4).contiguous().view(rows // AMX_TILE_COLS, cols // AMX_TILE_DEPTH, -1)

"""Fused multi-head attention for inference and training, written in cuTile: api.py has the
public functions and their contract."""

from tilegym.ops.attention.api import (
    fmha_forward_with_lse,
    tile_fmha,
    tile_fmha_functional,
    tile_fmha_varlen,
    tile_fmha_with_backward,
)
from tilegym.ops.attention.block_mask import BlockMask, create_block_mask
from tilegym.ops.attention.programmable import UserFunctionError

__all__ = [
    "tile_fmha",
    "fmha_forward_with_lse",
    "tile_fmha_with_backward",
    "tile_fmha_functional",
    "tile_fmha_varlen",
    "create_block_mask",
    "BlockMask",
    "UserFunctionError",
]

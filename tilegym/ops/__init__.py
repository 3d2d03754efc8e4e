"""Public entry points of every op."""

from tilegym.ops.attention import (
    BlockMask,
    UserFunctionError,
    create_block_mask,
    fmha_forward_with_lse,
    tile_fmha,
    tile_fmha_functional,
    tile_fmha_varlen,
    tile_fmha_with_backward,
)

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

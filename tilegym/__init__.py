"""TileGym-style GPU kernels written in cuTile, used from PyTorch.

Importing this package touches no GPU: kernels compile on first use.
"""

from tilegym.ops import (
    BlockMask,
    UserFunctionError,
    create_block_mask,
    fmha_forward_with_lse,
    tile_fmha,
    tile_fmha_functional,
    tile_fmha_varlen,
    tile_fmha_with_backward,
)

__version__ = "0.1.0"
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

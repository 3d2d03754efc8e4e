"""TileGym-style GPU kernels written in cuTile, used from PyTorch.

Importing this package touches no GPU: kernels compile on first use.
"""

from tilegym import ops
from tilegym.ops import *  # noqa: F403  (the names of ops.__all__)

__version__ = "0.1.0"
__all__ = list(ops.__all__)

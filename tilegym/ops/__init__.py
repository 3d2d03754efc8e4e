"""Public entry points of every op."""

from tilegym.ops import attention
from tilegym.ops.attention import *  # noqa: F403  (the names of attention.__all__)

__all__ = list(attention.__all__)

"""The head dim of Q and K as one tile, or as a main tile and a tail: D = 192 runs as 128 + 64
instead of a 256-wide tile padded with zeros, a quarter less work in every matmul over D.

A HeadParts holds the rows of a Q-, K-, dQ- or dK-shaped array split that way; with no tail
(Tiling.block_d_tail 0, a compile-time constant) each function here compiles to the single-tile
code it stands for.
"""

import cuda.tile as ct

from tilegym.ops.attention.kernels.state import HeadParts
from tilegym.ops.attention.kernels.tiles import (
    ConstBool,
    ConstInt,
    add_rows,
    load_rows,
    load_tile,
    store_rows,
    store_tile,
)


@ct.function
def _tail_index(tiling):
    """The tail's tile index along D, in tiles of its own width: it starts at column block_d."""
    return tiling.block_d // tiling.block_d_tail


@ct.function
def load_head(array, b, h, tile_index, rows: ConstInt, tiling, bulk: ConstBool = True):
    """bulk: as tiles.load_tile."""
    tail = 0
    if tiling.block_d_tail > 0:
        tail = load_tile(array, (b, h, tile_index, _tail_index(tiling)), (rows, tiling.block_d_tail), bulk)
    return HeadParts(load_rows(array, b, h, tile_index, rows, tiling.block_d, bulk), tail)


@ct.function
def store_head(array, b, h, tile_index, parts, rows: ConstInt, tiling, bulk: ConstBool = True):
    store_rows(array, b, h, tile_index, parts.main, rows, tiling.block_d, bulk)
    if tiling.block_d_tail > 0:
        store_tile(array, (b, h, tile_index, _tail_index(tiling)), parts.tail, (rows, tiling.block_d_tail), bulk)


@ct.function
def add_head(array, b, h, tile_index, parts, rows: ConstInt, tiling):
    """parts added into a tile-padded fp32 sum (tiles.add_rows), each part a TMA reduction."""
    add_rows(array, b, h, tile_index, parts.main, rows, tiling.block_d)
    if tiling.block_d_tail > 0:
        view = array.tiled_view((1, 1, rows, tiling.block_d_tail))
        view.atomic_store_add(
            (b, h, tile_index, _tail_index(tiling)), parts.tail.reshape((1, 1, rows, tiling.block_d_tail))
        )


@ct.function
def head_zeros(rows: ConstInt, tiling, dtype):
    tail = 0
    if tiling.block_d_tail > 0:
        tail = ct.zeros((rows, tiling.block_d_tail), dtype)
    return HeadParts(ct.zeros((rows, tiling.block_d), dtype), tail)


@ct.function
def head_dot(x, y, acc, tiling):
    """acc + x y^T, summed over the head dim: the scores (q k^T, or k q^T key-major)."""
    acc = ct.mma(x.main, ct.transpose(y.main), acc)
    if tiling.block_d_tail > 0:
        acc = ct.mma(x.tail, ct.transpose(y.tail), acc)
    return acc


@ct.function
def head_product(p, y, acc, tiling):
    """acc + p y for each part of y: dQ = dS K, dK = dS^T Q."""
    tail = 0
    if tiling.block_d_tail > 0:
        tail = ct.mma(p, y.tail, acc.tail)
    return HeadParts(ct.mma(p, y.main, acc.main), tail)


@ct.function
def head_scaled(parts, factor, tiling):
    tail = 0
    if tiling.block_d_tail > 0:
        tail = parts.tail * factor
    return HeadParts(parts.main * factor, tail)

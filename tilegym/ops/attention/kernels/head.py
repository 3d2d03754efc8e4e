"""A head dim as one tile, or as a main tile and a tail: D = 192 runs as 128 + 64 and D = 96
as 64 + 32 instead of one tile padded with zeros to the next power of two (256, 128), a quarter
less work in every matmul over D.

A HeadSplit (Tiling.qk for Q and K, Tiling.value for V) says how; a HeadParts holds the rows of
an array split that way. With no tail (HeadSplit.tail 0, a compile-time constant) each function
here compiles to the single-tile code it stands for.
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
def head_width(split):
    """The columns a split covers: the head dim, rounded up to its tiles."""
    return split.width + split.tail


@ct.function
def _tail_index(split):
    """The tail's tile index along D, in tiles of its own width: it starts at column width."""
    return split.width // split.tail


@ct.function
def load_head(array, b, h, tile_index, rows: ConstInt, split, bulk: ConstBool = True):
    """bulk: as tiles.load_tile."""
    tail = 0
    if split.tail > 0:
        tail = load_tile(array, (b, h, tile_index, _tail_index(split)), (rows, split.tail), bulk)
    return HeadParts(load_rows(array, b, h, tile_index, rows, split.width, bulk), tail)


@ct.function
def store_head(array, b, h, tile_index, parts, rows: ConstInt, split, bulk: ConstBool = True):
    store_rows(array, b, h, tile_index, parts.main, rows, split.width, bulk)
    if split.tail > 0:
        store_tile(array, (b, h, tile_index, _tail_index(split)), parts.tail, (rows, split.tail), bulk)


@ct.function
def add_head(array, b, h, tile_index, parts, rows: ConstInt, split):
    """parts added into a tile-padded fp32 sum (tiles.add_rows), each part a TMA reduction."""
    add_rows(array, b, h, tile_index, parts.main, rows, split.width)
    if split.tail > 0:
        view = array.tiled_view((1, 1, rows, split.tail))
        view.atomic_store_add((b, h, tile_index, _tail_index(split)), parts.tail.reshape((1, 1, rows, split.tail)))


@ct.function
def head_zeros(rows: ConstInt, split, dtype):
    tail = 0
    if split.tail > 0:
        tail = ct.zeros((rows, split.tail), dtype)
    return HeadParts(ct.zeros((rows, split.width), dtype), tail)


@ct.function
def head_dot(x, y, acc, split):
    """acc + x y^T, summed over the head dim: the scores (q k^T, or k q^T key-major), or dP
    (dO v^T, or v dO^T key-major)."""
    acc = ct.mma(x.main, ct.transpose(y.main), acc)
    if split.tail > 0:
        acc = ct.mma(x.tail, ct.transpose(y.tail), acc)
    return acc


@ct.function
def head_product(p, y, acc, split):
    """acc + p y for each part of y: out = P v, dQ = dS K, dK = dS^T Q, dV = P^T dO."""
    tail = 0
    if split.tail > 0:
        tail = ct.mma(p, y.tail, acc.tail)
    return HeadParts(ct.mma(p, y.main, acc.main), tail)


@ct.function
def head_scaled(parts, factor, split):
    """parts times factor: a scalar, or a [rows, 1] column that scales each row."""
    tail = 0
    if split.tail > 0:
        tail = parts.tail * factor
    return HeadParts(parts.main * factor, tail)


@ct.function
def head_row_dot(x, y, split, dtype):
    """sum_d x_id y_id per row, in dtype, as a [rows] tile: Delta = rowsum(Out * dO)."""
    total = ct.sum(x.main.astype(dtype) * y.main.astype(dtype), axis=1)
    if split.tail > 0:
        total = total + ct.sum(x.tail.astype(dtype) * y.tail.astype(dtype), axis=1)
    return total


@ct.function
def head_row_abs_sum(parts, split):
    """sum_d |parts_id| per row, as a [rows, 1] column."""
    total = ct.sum(ct.abs(parts.main), axis=1, keepdims=True)
    if split.tail > 0:
        total = total + ct.sum(ct.abs(parts.tail), axis=1, keepdims=True)
    return total

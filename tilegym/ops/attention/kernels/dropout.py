"""Attention dropout: each probability P_ij that multiplies V is kept with probability 1 - rate
and then scaled by 1 / (1 - rate), or dropped (0).

Whether P_ij is kept is a hash of the call's seed, the sequence (the batch entry, or packed, the
sequence), the query head, the query row i and the key column j (rows and columns count within
the sequence). The forward and backward kernels draw the same choices from it without storing
a mask, whatever their tiles; reference.dropout_kept computes the same hash with torch.

The hash chains a 32-bit integer mixer (xor-shifts and odd multiplies, which avalanche every
input bit over the output): once per program for the seed, sequence and head (a stream), once
per row, and once per probability. A probability is kept where the top 24 bits of its hash are
at or above the threshold, round(rate * 2^24); the host scales by 2^24 / (2^24 - threshold), the
exact inverse of the keep probability.

With dropout, out = (P o M) V / (1 - rate) for the kept mask M, and the backward follows:
dV = (P o M)^T dO / (1 - rate), and dS = P o (M o dP / (1 - rate) - Delta), where Delta =
rowsum(dO o out) as without dropout. The row statistics (LSE) are those of P, undropped.
"""

import cuda.tile as ct

from tilegym.ops.attention.kernels.state import Dropout
from tilegym.ops.attention.kernels.tiles import ConstBool, scale

# Multipliers of the mixer, and the odd steps that spread rows, columns, heads and sequences
# over the 32-bit space before mixing. reference.py repeats them.
MIX_FIRST = 0x7FEB352D
MIX_SECOND = 0x846CA68B
ROW_STEP = 0x9E3779B9
COLUMN_STEP = 0x85EBCA6B
HEAD_STEP = 0xC2B2AE35
SEQUENCE_STEP = 0x27D4EB2F
KEPT_BITS = 24


@ct.function
def mix32(x):
    """The 32-bit mixer of a uint32 tile."""
    x = x ^ (x >> 16)
    x = x * ct.uint32(MIX_FIRST)
    x = x ^ (x >> 15)
    x = x * ct.uint32(MIX_SECOND)
    return x ^ (x >> 16)


@ct.function
def _as_uint32(values):
    return values.astype(ct.uint32)


@ct.function
def dropout_of(Seed, seq, q_head, threshold, scale_hi, scale_lo, acc_dtype, on: ConstBool):
    """A program's Dropout for one sequence and query head. Seed: int32 [2], values in [0, 2^31)."""
    if on:
        seed = ct.load(Seed, index=(0,), shape=(2,))
        low = _as_uint32(ct.extract(seed, index=(0,), shape=(1,)).reshape((1, 1)))
        high = _as_uint32(ct.extract(seed, index=(1,), shape=(1,)).reshape((1, 1)))
        head = _as_uint32(ct.full((1, 1), q_head, ct.int32))
        sequence = _as_uint32(ct.full((1, 1), seq, ct.int32))
        stream = mix32(low + head * ct.uint32(HEAD_STEP))
        stream = mix32(stream ^ high)
        stream = mix32(stream + sequence * ct.uint32(SEQUENCE_STEP))
        return Dropout(True, stream, threshold, scale(scale_hi, scale_lo, acc_dtype))
    return Dropout(False, 0, 0, 0.0)


@ct.function
def kept(dropout, rows, cols):
    """Whether each probability at (rows, cols) is kept: rows and cols are int32 index tiles that
    broadcast to the probabilities' shape ([m, 1] and [1, n], or transposed)."""
    row_hash = mix32(dropout.stream ^ (_as_uint32(rows) * ct.uint32(ROW_STEP)))
    hashed = mix32(row_hash ^ (_as_uint32(cols) * ct.uint32(COLUMN_STEP)))
    return (hashed >> (32 - KEPT_BITS)).astype(ct.int32) >= dropout.threshold


@ct.function
def dropped(values, dropout, rows, cols):
    """values (probabilities, or dP) where kept, else 0; unscaled: the forward scales its output
    once per row instead. values unchanged without dropout."""
    if dropout.on:
        return ct.where(kept(dropout, rows, cols), values, 0.0)
    return values


@ct.function
def dropped_scaled(values, dropout, kept_mask):
    """values / (1 - rate) where kept_mask (kept), else 0; values unchanged without dropout."""
    if dropout.on:
        return ct.where(kept_mask, values * dropout.scale, 0.0)
    return values


@ct.function
def kept_or_none(dropout, rows, cols):
    """kept() with dropout, else 0 (nothing computed)."""
    if dropout.on:
        return kept(dropout, rows, cols)
    return 0


@ct.function
def output_scale(dropout):
    """The forward output's factor: 1 / (1 - rate) with dropout, else 1."""
    if dropout.on:
        return dropout.scale
    return 1.0

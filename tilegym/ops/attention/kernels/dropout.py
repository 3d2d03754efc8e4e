"""Attention dropout: each probability P_ij that multiplies V is kept with probability 1 - rate
and then scaled by 1 / (1 - rate), or dropped (0).

Whether P_ij is kept is a hash of the call's seed, the sequence (the batch entry, or packed, the
sequence), the query head, the query row i and the key column j (rows and columns count within
the sequence). The forward and backward kernels draw the same choices from it without storing
a mask, whatever their tiles; reference.dropout_kept computes the same hash with torch.

The hash is a 32-bit integer mixer (xor-shifts and odd multiplies, which avalanche every input
bit over the output), applied once per program to the seed, sequence and head (a stream), and
once per pair of probabilities to (stream + row * ROW_STEP) xor (pair * COLUMN_STEP). The row
enters unmixed: a mixer per row cost as much again in the backward, whose threads hold 32 query
rows of P^T each (2 rows of P in the forward). A hash's two 16-bit halves decide its pair's two
probabilities, which halves the integer work per probability (at D=64 that work outweighs the
step's matmuls). A pair is keys j and j + 8 of an aligned block of 16: every key tile starts at
a multiple of its size (16 or more), and in the warpgroup matmul's accumulator one thread holds
both, so no value moves between threads. A probability is kept where its half is at or above
the threshold, round(rate * 2^16) (the rate is rounded to a multiple of 2^-16); the host scales
by 2^16 / (2^16 - threshold), the exact inverse of the keep probability.

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
# The seed tensor: two words of seed, the call's first query row, and a zero (tiles have
# power-of-two shapes).
SEED_WORDS = 4
KEPT_BITS = 16  # the bits of a 32-bit hash that decide one probability: two per hash
PAIR_SHIFT = 3
PAIR_SPAN = 1 << PAIR_SHIFT  # a pair's two keys lie this far apart, in blocks of 2 * PAIR_SPAN keys


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
    """A program's Dropout for one sequence and query head. Seed: int32 [SEED_WORDS]: two words of
    seed in [0, 2^31), then the row of the sequence that the call's query row 0 is (context
    parallelism's chunks of one sequence; else 0). Key columns count from the sequence's first:
    a per-call column offset, one more live value, made the fused backward's masked loop 300
    instructions longer."""
    if on:
        seed = ct.load(Seed, index=(0,), shape=(SEED_WORDS,))
        low = _word(seed, 0)
        high = _word(seed, 1)
        head = _as_uint32(ct.full((1, 1), q_head, ct.int32))
        sequence = _as_uint32(ct.full((1, 1), seq, ct.int32))
        stream = mix32(low + head * ct.uint32(HEAD_STEP))
        stream = mix32(stream ^ high)
        stream = mix32(stream + sequence * ct.uint32(SEQUENCE_STEP))
        # A row enters as stream + row * ROW_STEP (kept): the first row's offset folds into the stream.
        stream = stream + _word(seed, 2) * ct.uint32(ROW_STEP)
        return Dropout(True, stream, threshold, scale(scale_hi, scale_lo, acc_dtype))
    return Dropout(False, 0, 0, 0.0)


@ct.function
def _word(seed, index: int):
    """Word index of the seed tile, as a uint32 [1, 1] tile."""
    return _as_uint32(ct.extract(seed, index=(index,), shape=(1,)).reshape((1, 1)))


@ct.function
def kept(dropout, rows, cols):
    """Whether each probability at (rows, cols) is kept: rows and cols are int32 index tiles,
    [m, 1] and [1, n] (P) or [1, m] and [n, 1] (P^T); n is a multiple of 16 and the columns
    start at a multiple of 16."""
    if cols.shape[0] == 1:
        m, n = rows.shape[0], cols.shape[1]
        blocks = n // (2 * PAIR_SPAN)
        first = ct.extract(cols.reshape((1, blocks, 2, PAIR_SPAN)), index=(0, 0, 0, 0), shape=(1, blocks, 1, PAIR_SPAN))
        row_hash = dropout.stream + _as_uint32(rows) * ct.uint32(ROW_STEP)
        hashed = mix32(row_hash.reshape((m, 1, 1, 1)) ^ (_pair_of(first) * ct.uint32(COLUMN_STEP)))
        # The pair's first key reads the low half, moved up, its second the high half: both
        # compare in the high bits, unsigned. (Joined by ct.cat instead of a select, the halves
        # kept the compiler busy for minutes on programs of two-CTA clusters.)
        pair = ct.broadcast_to(hashed, (m, blocks, 2, PAIR_SPAN))
        second = ct.arange(2, dtype=ct.int32).reshape((1, 1, 2, 1)) == 1
        halves = ct.where(second, pair, pair << KEPT_BITS)
        return (halves >= (dropout.threshold.astype(ct.uint32) << KEPT_BITS)).reshape((m, n))
    # P^T: the mask of P, transposed. Paired along axis 0 directly, the compiler moved the
    # halves through shared memory; the transpose costs no instruction.
    m, n = rows.shape[1], cols.shape[0]
    return ct.transpose(kept(dropout, rows.reshape((m, 1)), cols.reshape((1, n))))


@ct.function
def _pair_of(first_cols):
    """The pair number of the first keys of pairs (uint32): PAIR_SPAN pairs per block of 2 * PAIR_SPAN keys."""
    # Shifts and a mask: signed // and % took 120 more instructions a step (every thread holds
    # 16 pairs' columns).
    return _as_uint32(((first_cols >> (PAIR_SHIFT + 1)) << PAIR_SHIFT) | (first_cols & (PAIR_SPAN - 1)))


@ct.function
def dropped(values, dropout, rows, cols):
    """values (probabilities) where kept, else 0; unscaled: the forward scales its output once
    per row instead. values unchanged without dropout."""
    if dropout.on:
        return ct.where(kept(dropout, rows, cols), values, 0.0)
    return values


@ct.function
def kept_scaled(values, dropout, rows, cols):
    """values / (1 - rate) where kept, else 0 (dP in the dQ kernel); unchanged without dropout."""
    if dropout.on:
        return ct.where(kept(dropout, rows, cols), values * dropout.scale, 0.0)
    return values


@ct.function
def dropped_cast(probs, dropout, rows, cols, dtype):
    """kept_scaled's probs as dtype: dV's operand, and with dropout what kept_gradient reads the
    mask from."""
    return kept_scaled(probs, dropout, rows, cols).astype(dtype)


@ct.function
def kept_gradient(d_probs, dropout, dropped_probs):
    """d_probs / (1 - rate) where dropped_cast kept the probability, else 0; unchanged without
    dropout. The mask is read back from dropped_cast's values, not held beside them: holding it
    across the step's matmuls spilled registers. A kept probability that rounds to 0 in dtype
    counts as dropped; its dS, P * (dP / (1 - rate) - Delta), is then wrong by P * dP / (1 -
    rate), where P / (1 - rate) is under half of dtype's smallest subnormal: of the order of dS's
    own rounding to dtype."""
    if dropout.on:
        return ct.where(dropped_probs != 0, d_probs * dropout.scale, 0.0)
    return d_probs


@ct.function
def output_scale(dropout):
    """The forward output's factor: 1 / (1 - rate) with dropout, else 1."""
    if dropout.on:
        return dropout.scale
    return 1.0

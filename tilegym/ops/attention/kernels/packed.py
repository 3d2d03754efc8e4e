"""Packed variable-length batches: arrays hold every sequence's rows one after another along the
sequence axis ([1, H, total, ...] views of [total, H, ...] tensors), and grid axis 2 counts
sequences instead of batch entries. A program reads its sequence's rows from the cumulative
lengths and slices each array it touches to them, so the rest of a kernel sees one ordinary
sequence at batch index 0: lengths, masks and tile loops are those of the dense path.

The grid covers the longest sequence's tiles for every sequence: a program whose tile starts
past its own sequence's end returns at once (past_the_end). A sequence with no keys (or no
queries) has an empty slice of them, which its programs' loops never visit.

Outputs and gradients are allocated uninitialized: the rows outside every sequence are zeroed
by the kernel that writes the array, one program per sequence and head taking the rows before
its sequence and, for the last sequence, after it (zero_rows_around).

The backward's row statistics (Delta, the base-2 LSE) are arrays of its own, laid out so that
each sequence's rows start at a multiple of STAT_ALIGN, itself a multiple of every query tile
(stat_rows): the fused backward's dK/dV loop loads them from the whole array at a tile index
(stat_first_tile), with no slice of them; the two-kernel one from a slice declared aligned
(stat_rows_of); both by bulk copy, as the dense loop does.

Lengths are clamped on the GPU, so inconsistent cumulative lengths (decreasing, past the end,
longer than the maximum the grid was sized for) can never make a program read or write outside
the arrays; the host checks them only on request (TILEGYM_CHECK_VARLEN).
"""

from dataclasses import dataclass

import cuda.tile as ct

from tilegym.ops.attention.kernels.head import head_width, head_zeros, store_head
from tilegym.ops.attention.kernels.state import Value
from tilegym.ops.attention.kernels.tiles import NEG_INF, ConstBool, ConstInt
from tilegym.ops.attention.packing import STAT_ALIGN

# Rows per tile of the rows outside every sequence that a program zeros (zero_rows_around).
GAP_ROWS = 16


@dataclass(frozen=True)
class Rows:
    """One sequence's rows [start, end) in a packed array."""

    start: Value
    end: Value


@ct.function
def sequence_rows(CuSeqlens, seq, packed, max_len):
    """Rows of sequence seq in packed, from CuSeqlens ([N + 1] int32), clamped so that
    0 <= start <= end <= total and end - start <= max_len (the grid covers max_len rows)."""
    return clamped_rows(CuSeqlens, seq, ct.astype(packed.shape[2], ct.int32), max_len)


@ct.function
def clamped_rows(CuSeqlens, seq, total, max_len):
    """sequence_rows of an array of total rows: the one clamping rule of every kernel."""
    start = _clamped_start(CuSeqlens, seq, total)
    end = min(max(ct.gather(CuSeqlens, seq + 1), start), min(total, start + max_len))
    return Rows(start, end)


@ct.function
def _clamped_start(CuSeqlens, seq, total):
    """Where sequence seq (a scalar, or a tile of them) starts in an array of total rows,
    clamped into [0, total] (clamped_rows)."""
    return ct.minimum(ct.maximum(ct.gather(CuSeqlens, seq), 0), total)


@ct.function
def stat_rows(seq, rows):
    """Where sequence seq's rows (Rows, clamped) lie in a backward row statistic: from the first
    multiple of STAT_ALIGN at or after rows.start + (STAT_ALIGN - 1) * seq. A sequence's rows
    move by at most STAT_ALIGN - 1 more than the previous one's, so with consistent lengths no
    two overlap, and with any lengths every row lies below total + (STAT_ALIGN - 1) * N
    (packing.stat_rows_total)."""
    start = _stat_start(seq, rows.start)
    return Rows(start, start + rows.end - rows.start)


@ct.function
def _stat_start(seq, start):
    """stat_rows' first row of sequence seq (a scalar, or a tile of them) that starts at start."""
    return (start + (STAT_ALIGN - 1) * (seq + 1)) // STAT_ALIGN * STAT_ALIGN


@ct.function
def stat_first_tile(seq, rows, block_m: ConstInt):
    """The tile index, in a backward row statistic tiled by block_m rows (a divisor of
    STAT_ALIGN), of sequence seq's first row (stat_rows)."""
    return _stat_start(seq, rows.start) // block_m


@ct.function
def stat_rows_of(stat, seq, rows):
    """A backward row statistic's rows of sequence seq (stat_rows) as a view whose start the
    compiler knows to be a multiple of STAT_ALIGN."""
    aligned = stat_rows(seq, rows)
    return stat.slice(2, ct.assume_divisible_by(aligned.start, STAT_ALIGN), aligned.end)


@ct.function
def stat_rows_of_rows(CuSeqlens, rows, total, search_steps):
    """For a tile of rows of a packed array of total rows, each row's row in a backward row
    statistic (stat_rows): found by its sequence, the last s in [0, N) with CuSeqlens[s] <= row,
    by search_steps halvings of [0, N) (at least log2 N). Any CuSeqlens contents give an s in
    [0, N) and a row in [0, total + (STAT_ALIGN - 1) * N); a row outside every sequence gets one
    outside every sequence's rows there (with consistent lengths)."""
    low = ct.zeros(rows.shape, ct.int32)
    high = ct.full(rows.shape, CuSeqlens.shape[0] - 1, ct.int32)
    for _ in range(search_steps):
        middle = (low + high) // 2
        below = ct.gather(CuSeqlens, middle) <= rows
        low = ct.where(below, middle, low)
        high = ct.where(below, high, middle)
    start = _clamped_start(CuSeqlens, low, total)
    return _stat_start(low, start) + rows - start


@ct.function
def past_the_end(tile_start, rows):
    """Whether a program's tile starts past the end of its sequence's rows: it has nothing to do
    and returns at once. (A slice of no rows must never be loaded from: its bulk-copy descriptor
    would be invalid.)"""
    return tile_start >= rows.end - rows.start


@ct.function
def has_no_rows(rows):
    """Whether a sequence has no rows (of queries, or of keys)."""
    return rows.end <= rows.start


@ct.function
def rows_of(array, rows):
    """array's rows of one sequence: a view, nothing copied."""
    return array.slice(2, rows.start, rows.end)


@ct.function
def bulk_once(varlen: ConstBool, tiling):
    """Whether the tiles a forward or dQ program loads or stores once go by bulk copy
    (tiles.load_tile).

    Dense: always. Packed: a bulk copy from a slice first writes the slice's descriptor to
    global memory and waits for it, a round trip that costs these short programs a share of
    their time, so up to 128-wide heads they load those tiles without one. Wider heads keep bulk
    copies, since a plain load holds its tile in registers, which then spill (sm_90, D=192: up
    to 207 local loads and stores in the dQ kernel). The dK/dV kernel keeps them too for its
    loads: its programs are long, and without them its D=128 kernel spilled (its stores:
    bulk_dkdv_stores).
    """
    narrow = head_width(tiling.qk) <= 128 and head_width(tiling.value) <= 128
    return not (varlen and narrow)


@ct.function
def bulk_dkdv_stores(varlen: ConstBool, sum_dq: ConstBool, tiling):
    """Whether a dK/dV program stores its dK and dV by bulk copy (tiles.load_tile): not the packed
    fused backward's at heads up to 64 wide, whose copies from slices each built a descriptor
    after the loop, and whose causal 128x128 form spilled 16 local loads with them and none
    without (perf-notes#packed-fused-plain-stores). Wider, the plain stores spilled instead."""
    narrow = head_width(tiling.qk) <= 64 and head_width(tiling.value) <= 64
    return not (varlen and sum_dq and narrow)


@ct.function
def _zero_head_rows(array, head, gap, split):
    """Zeros in one head's rows gap (Rows) of a packed array [1, H, total, D] (D tiled as split),
    by plain stores: a bulk copy from a slice would first build its descriptor."""
    if gap.end > gap.start:
        rows = rows_of(array, gap)
        zeros = head_zeros(GAP_ROWS, split, array.dtype)
        for tile in range(ct.cdiv(gap.end - gap.start, GAP_ROWS)):
            store_head(rows, 0, head, tile, zeros, GAP_ROWS, split, False)


@ct.function
def _fill_head_stat(stat, head, gap, value):
    """value in one head's rows gap (Rows) of a packed row statistic [1, H, total]."""
    if gap.end > gap.start:
        rows = rows_of(stat, gap)
        values = ct.full((1, 1, GAP_ROWS), value, stat.dtype)
        for tile in range(ct.cdiv(gap.end - gap.start, GAP_ROWS)):
            ct.store(rows, index=(0, head, tile), tile=values, allow_tma=False)


@ct.function
def _gaps_around(CuSeqlens, seq, rows, total, max_len):
    """(before, after): the rows no sequence holds next to sequence seq, given its rows (see
    zero_rows_around): from the end of sequence seq - 1 (row 0 for the first) to rows.start,
    and from rows.end to the end after the last sequence (empty after any other)."""
    start = 0
    if seq > 0:
        start = clamped_rows(CuSeqlens, seq - 1, total, max_len).end
    end = rows.end
    if seq == CuSeqlens.shape[0] - 2:
        end = total
    return Rows(start, rows.start), Rows(rows.end, end)


@ct.function
def zero_rows_around(array, CuSeqlens, seq, head, rows, max_len, split):
    """Zeros in one head's rows of a packed array [1, H, total, D] that no sequence holds next to
    sequence seq (_gaps_around). rows: sequence seq's clamped rows, or an empty range at their
    end where the kernel writes none of them (keys without queries).

    One program of each sequence and head calls it (its first tile's, before any return), so
    that the kernel writing the array leaves no row unwritten: walking from row 0 to the end
    through each sequence's start and end in turn, every row is crossed by a forward step,
    which is a sequence's rows or one of these gaps. With inconsistent lengths a gap may
    overlap another sequence's rows; the results are then undefined, but finite.
    """
    before, after = _gaps_around(CuSeqlens, seq, rows, ct.astype(array.shape[2], ct.int32), max_len)
    _zero_head_rows(array, head, before, split)
    _zero_head_rows(array, head, after, split)


@ct.function
def empty_lse_around(Lse, CuSeqlens, seq, head, rows, max_len):
    """-inf in the LSE [1, H, total] of the rows zero_rows_around zeros: rows that see no key."""
    before, after = _gaps_around(CuSeqlens, seq, rows, ct.astype(Lse.shape[2], ct.int32), max_len)
    _fill_head_stat(Lse, head, before, NEG_INF)
    _fill_head_stat(Lse, head, after, NEG_INF)

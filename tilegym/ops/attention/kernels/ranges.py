"""Which tiles a program visits and which pairs inside a tile are masked.

Causal masking is bottom-right aligned: query i sees key j iff j <= i + (Sk - Sq). A sliding
window (left, right) lets query i see keys [i + d - left, i + d + right], d = Sk - Sq. Both
give each program Segments: tiles that need no mask, tiles that do, tiles skipped entirely.
"""

import cuda.tile as ct

from tilegym.ops.attention.kernels.state import Segments
from tilegym.ops.attention.kernels.tiles import ConstBool, ConstInt
from tilegym.ops.attention.kernels.user import user_visible


@ct.function
def key_segments(q_tile, scoring):
    """Segments of the key tiles a query tile visits."""
    if scoring.switches.windowed:
        return _window_key_tiles(q_tile, scoring)
    return _causal_key_tiles(q_tile, scoring.seqlens, scoring.tiling.block_m, scoring.tiling.block_n, scoring.causal)


@ct.function
def query_segments(kv_tile, scoring):
    """Segments of the query tiles that see a key tile."""
    if scoring.switches.windowed:
        return _window_query_tiles(kv_tile, scoring)
    return _causal_query_tiles(kv_tile, scoring.seqlens, scoring.tiling.block_m, scoring.tiling.block_n, scoring.causal)


@ct.function
def over_segments(loop, segments, state, program):
    """state after loop(first, last, state, program, masked) over every segment, in order."""
    if segments.masked_before:
        state = loop(segments.start, segments.full_start, state, program, True)
    state = loop(segments.full_start, segments.full_end, state, program, False)
    if segments.masked_after:
        state = loop(segments.full_end, segments.end, state, program, True)
    return state


@ct.function
def _causal_key_tiles(q_tile, seqlens, block_m: ConstInt, block_n: ConstInt, causal: ConstBool):
    """Key tiles [0, num_full) need no mask, [num_full, num_end) do.

    A key tile needs a mask when it crosses the causal diagonal or the end of the keys.
    Key tiles past the last key the tile's bottom row sees are skipped entirely.
    """
    num_tail_free = seqlens.k // block_n
    if causal:
        diagonal = seqlens.k - seqlens.q
        first_row = q_tile * block_m
        keys_seen_by_all_rows = max(first_row + diagonal + 1, 0)
        keys_seen_by_last_row = min(max(first_row + block_m + diagonal, 0), seqlens.k)
        num_full = min(keys_seen_by_all_rows // block_n, num_tail_free)
        num_end = ct.cdiv(keys_seen_by_last_row, block_n)
    else:
        num_full = num_tail_free
        num_end = ct.cdiv(seqlens.k, block_n)
    return Segments(0, 0, num_full, num_end, False, True)


@ct.function
def _causal_query_tiles(kv_tile, seqlens, block_m: ConstInt, block_n: ConstInt, causal: ConstBool):
    """Query tiles [masked_start, full_start) need a mask, [full_start, num_q_tiles) do not;
    tiles before masked_start see none of the key tile's keys and are skipped."""
    num_q_tiles = ct.cdiv(seqlens.q, block_m)
    if causal:
        diagonal = seqlens.k - seqlens.q
        # First query row that sees the tile's first key, and first row that sees all its keys.
        first_seeing = max(kv_tile * block_n - diagonal, 0)
        first_seeing_all = max(kv_tile * block_n + block_n - 1 - diagonal, 0)
        masked_start = min(first_seeing // block_m, num_q_tiles)
        full_start = min(ct.cdiv(first_seeing_all, block_m), num_q_tiles)
    else:
        masked_start = 0
        full_start = 0
    return Segments(masked_start, full_start, num_q_tiles, num_q_tiles, True, False)


@ct.function
def _band_tiles(first_seen, last_seen, first_seen_by_all, last_seen_by_all, length, block: ConstInt):
    """Segments of the tiles of a band of indices along one axis.

    The band is [first_seen, last_seen] (inclusive, unclipped); [first_seen_by_all,
    last_seen_by_all] is where every row (or column) of the other side sees it.
    """
    start = min(max(first_seen, 0), length) // block
    end = max(ct.cdiv(min(max(last_seen + 1, 0), length), block), start)
    full_start = min(max(ct.cdiv(min(max(first_seen_by_all, 0), length), block), start), end)
    full_end = max(min(min(max(last_seen_by_all + 1, 0), length) // block, end), full_start)
    return Segments(start, full_start, full_end, end, True, True)


@ct.function
def _window_key_tiles(q_tile, scoring):
    """Key tiles of a query tile under a sliding window: query i sees keys
    [i + d - left, i + d + right] with d = Sk - Sq."""
    mods, seqlens, block_m = scoring.mods, scoring.seqlens, scoring.tiling.block_m
    first_row = q_tile * block_m + (seqlens.k - seqlens.q)
    last_row = first_row + block_m - 1
    return _band_tiles(
        first_row - mods.window_left, last_row + mods.window_right, last_row - mods.window_left,
        first_row + mods.window_right, seqlens.k, scoring.tiling.block_n,
    )  # fmt: skip


@ct.function
def _window_query_tiles(kv_tile, scoring):
    """Query tiles that see a key tile under a sliding window: key j is seen by queries
    [j - d - right, j - d + left]."""
    mods, seqlens, block_n = scoring.mods, scoring.seqlens, scoring.tiling.block_n
    first_col = kv_tile * block_n - (seqlens.k - seqlens.q)
    last_col = first_col + block_n - 1
    return _band_tiles(
        first_col - mods.window_right, last_col + mods.window_left, last_col - mods.window_right,
        first_col + mods.window_left, seqlens.q, scoring.tiling.block_m,
    )  # fmt: skip


@ct.function
def visible(rows, cols, scoring):
    """Which (query, key) pairs a row attends to; rows and cols broadcast against each other."""
    seqlens = scoring.seqlens
    if scoring.causal:
        # The diagonal and the end of the keys as one limit per row: one comparison per pair.
        inside = cols <= ct.minimum(rows + (seqlens.k - seqlens.q), seqlens.k - 1)
    else:
        inside = cols < seqlens.k
    if scoring.switches.windowed:
        mods = scoring.mods
        offset = cols - rows - (seqlens.k - seqlens.q)
        inside = inside & (offset >= -mods.window_left) & (offset <= mods.window_right)
    return user_visible(inside, rows, cols, scoring.switches, scoring.user)


@ct.function
def tile_columns(kv_tile, block_n: ConstInt):
    """[1, block_n] key indices of a key tile."""
    return kv_tile * block_n + ct.arange(block_n, dtype=ct.int32)[None, :]


@ct.function
def key_columns(kv_tile, block_n: ConstInt, masked: ConstBool, switches):
    """tile_columns when the mask, ALiBi or a score function needs them."""
    if masked or switches.alibi or switches.user.score_mod is not None:
        return tile_columns(kv_tile, block_n)
    return 0

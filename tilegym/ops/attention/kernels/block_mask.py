"""The kernel that sorts a block mask's tiles: for each (query tile, key tile) of one tiling,
whether no pair is visible (skipped), some are (masked), or every pair of the tile's rows is
(run without a mask). Visible means what the attention kernels' masked steps test: the
causal or window rule, the end of the keys, and the caller's mask_mod (user.py).
"""

import cuda.tile as ct

from tilegym.kernel_cache import CachedKernel
from tilegym.ops.attention.kernels.packed import clamped_rows
from tilegym.ops.attention.kernels.ranges import visible
from tilegym.ops.attention.kernels.state import HeadMods, HeadSplit, Scoring, SeqLens, Switches, Tiling
from tilegym.ops.attention.kernels.tiles import ConstBool, ConstInt
from tilegym.ops.attention.kernels.user import (
    AUX_GRAD,
    MASK_MOD,
    SCORE_MOD,
    SCORE_MOD_GRAD,
    user_args,
    user_functions,
)
from tilegym.ops.attention.score_mods import BIAS_NONE

TILE_EMPTY = 0
TILE_PARTIAL = 1
TILE_FULL = 2


@CachedKernel
def block_mask_kernel(
    Kinds,
    MaskAux0,
    MaskAux1,
    MaskAux2,
    MaskAux3,
    CuSeqlensQ,
    CuSeqlensK,
    seqlen_q: int,
    seqlen_k: int,
    total_q: int,
    total_k: int,
    window_left: int,
    window_right: int,
    block_m: ConstInt,
    block_n: ConstInt,
    causal: ConstBool,
    windowed: ConstBool,
    varlen: ConstBool,
):
    """Kinds[b, h, query tile, key tile] (int8): TILE_EMPTY, TILE_PARTIAL or TILE_FULL. Grid:
    (query tiles, key tiles, B * H) of Kinds' B and H, each 1 where the mask broadcasts
    (mask_mod is then called with index 0 there). Rows past the queries are not counted: the
    kernels compute them and store nothing of them.

    varlen: b counts the sequences of a packed batch, whose lengths come from the cumulative
    lengths, clamped as the attention kernels clamp them (arrays of total_q and total_k rows,
    at most seqlen_q and seqlen_k each: packed.clamped_rows); tiles past a sequence's end are
    empty."""
    q_tile, kv_tile, entry = ct.bid(0), ct.bid(1), ct.bid(2)
    heads = Kinds.shape[1]
    b = entry // heads
    h = entry - b * heads
    if varlen:
        q_rows = clamped_rows(CuSeqlensQ, b, total_q, seqlen_q)
        k_rows = clamped_rows(CuSeqlensK, b, total_k, seqlen_k)
        seqlen_q = q_rows.end - q_rows.start
        seqlen_k = k_rows.end - k_rows.start
    switches = Switches(
        windowed, False, BIAS_NONE, False, user_functions(SCORE_MOD, SCORE_MOD_GRAD, AUX_GRAD, MASK_MOD)
    )
    mods = HeadMods(Kinds, 0, 0, 0.0, 0.0, 0.0, window_left, window_right)
    user = user_args(b, h, MaskAux0, MaskAux1, MaskAux2, MaskAux3, MaskAux0, MaskAux1, MaskAux2, MaskAux3)
    tiling = Tiling(block_m, block_n, HeadSplit(0, 0), HeadSplit(0, 0))
    scoring = Scoring(1.0, SeqLens(seqlen_q, seqlen_k), mods, switches, tiling, causal, user, 0)
    rows = q_tile * block_m + ct.arange(block_m, dtype=ct.int32)[:, None]
    cols = kv_tile * block_n + ct.arange(block_n, dtype=ct.int32)[None, :]
    real_rows = rows < seqlen_q
    seen = ct.sum(ct.where(visible(rows, cols, scoring) & real_rows, 1, 0))
    pairs = max(min(block_m, seqlen_q - q_tile * block_m), 0) * block_n
    kind = ct.where(seen == 0, TILE_EMPTY, ct.where(seen == pairs, TILE_FULL, TILE_PARTIAL))
    ct.scatter(Kinds, (b, h, q_tile, kv_tile), ct.astype(kind, ct.int8))

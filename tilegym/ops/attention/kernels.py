"""cuTile kernels of fused multi-head attention: forward, forward with LSE and backward.

Pure device code. Host logic (validation, allocation, grids, tuning) lives in launch.py.

Layout: q, out, d_out [B, Hq, Sq, D]; k, v [B, Hkv, Sk, D]; lse, delta [B, Hq, Sq].
Every kernel is launched on a 3-D grid (sequence tile, head, batch). Tiles are loaded with
zero padding, so sequence lengths and head dims need not be multiples of a tile, and
stores past the end of an array are dropped: nothing outside the tensors is touched.

Causal masking is bottom-right aligned: query i sees key j iff j <= i + (Sk - Sq).
Scores are kept in base 2 (scaled by softmax_scale * log2(e)) so exp2 does the softmax; the
plain forward keeps raw products and applies the scale inside exp2's argument instead.

Score modifiers (bias, sliding window, softcap, ALiBi; see score_mods.py) are compile-time
switches: with all of them off, each kernel compiles to the code it had without them.
"""

import cuda.tile as ct

from tilegym.kernel_cache import CachedKernel
from tilegym.ops.attention.score_mods import BIAS_NONE, BIAS_ONE_ROW, BIAS_PER_ROW

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]

NEG_INF = float("-inf")
POS_INF = float("inf")
LN2 = 0.6931471805599453
LOG2E = 1.4426950408889634
ZERO_PAD = ct.PaddingMode.ZERO


@ct.function
def _load_rows(array, b, h, tile_index, rows: ConstInt, cols: ConstInt):
    """A [rows, cols] tile of a [B, H, S, D] array, zero beyond S and D."""
    tile = ct.load(array, index=(b, h, tile_index, 0), shape=(1, 1, rows, cols), padding_mode=ZERO_PAD)
    return tile.reshape((rows, cols))


@ct.function
def _store_rows(array, b, h, tile_index, tile, rows: ConstInt, cols: ConstInt):
    ct.store(array, index=(b, h, tile_index, 0), tile=tile.reshape((1, 1, rows, cols)).astype(array.dtype))


@ct.function
def _load_row_stat(array, b, h, tile_index, rows: ConstInt):
    """A [rows] slice of a per-row statistic [B, H, S] (LSE or Delta)."""
    tile = ct.load(array, index=(b, h, tile_index), shape=(1, 1, rows), padding_mode=ZERO_PAD)
    return tile.reshape((rows,))


@ct.function
def _seqlens(Q, K):
    """(Sq, Sk) as int32 also where the arrays are indexed with int64 (index_width.wide): the
    host keeps Sq + Sk below 2**29, so positions and tile numbers stay 32-bit."""
    return ct.astype(Q.shape[2], ct.int32), ct.astype(K.shape[2], ct.int32)


@ct.function
def _accumulator_dtype(dtype):
    return ct.float64 if dtype == ct.float64 else ct.float32


@ct.function
def _scale(hi, lo, acc_dtype):
    # Float kernel arguments arrive as fp32; fp64 kernels rebuild the exact scale from hi + lo.
    if acc_dtype == ct.float64:
        return hi.astype(ct.float64) + lo.astype(ct.float64)
    return hi


@ct.function
def _ln2(dtype):
    # Float literals reach the kernel rounded to fp32: fp64 kernels compute log(2) instead.
    if dtype == ct.float64:
        return ct.log(ct.full((1,), 2.0, ct.float64))
    return LN2


@ct.function
def _log2e(dtype):
    if dtype == ct.float64:
        return 1.0 / _ln2(dtype)
    return LOG2E


@ct.function
def _exp2(x):
    # Flushing subnormal results to zero lets exp2 compile to the bare hardware instruction
    # (without it every element pays a range test and two predicated multiplies). A
    # probability below 2^-126 of its row's maximum changes no sum we form.
    if x.dtype == ct.float64:
        return ct.exp2(x)
    return ct.exp2(x, flush_to_zero=True)


@ct.function
def _query_program(query_group_size, causal: ConstBool):
    """(query tile, query head, batch, K/V head) of a program on a (query tiles, heads, batch) grid."""
    q_tile = ct.bid(0)
    if causal:
        # Causal tiles near the end of the sequence do the most work: start them first.
        q_tile = ct.num_blocks(0) - 1 - q_tile
    q_head = ct.bid(1)
    return q_tile, q_head, ct.bid(2), q_head // query_group_size


# The fused causal backward hands out its programs heaviest first across about this many
# programs at a time; see _heaviest_first.
HEAVIEST_FIRST_PROGRAMS = 256


@ct.function
def _heaviest_first():
    """(tile, head, batch) of this program on a (tiles, heads, batch) grid whose tile 0 is the
    heaviest of each head and whose programs grow lighter with the tile.

    The GPU starts programs in grid order, so in (tile, head, batch) order the last heads' tile
    0 starts last and runs on while other SMs idle. Here programs go by tile across a group of
    heads (every head's tile 0, then every head's tile 1, ...) so the programs started last are
    the lightest. A group spans about HEAVIEST_FIRST_PROGRAMS programs, so as many heads are in
    flight at once (their Q and dO shared in L2) as in grid order. Groups hold heads of one
    batch index. Measured in the fused causal backward (one CTA per SM): +1-4% at 4096-8192
    keys. At two CTAs per SM (the forward, the two-kernel backward) it lost up to 6% at 1024
    keys, where the integer divisions below weigh on short programs and a CTA left alone on an
    SM runs faster (perf-notes section 33).
    """
    tiles = ct.num_blocks(0)
    group = ct.cdiv(HEAVIEST_FIRST_PROGRAMS, tiles)  # at least 1
    program = ct.bid(0) + tiles * ct.bid(1)
    first = program // (group * tiles) * group  # the group's first head
    members = min(group, ct.num_blocks(1) - first)
    within = program - first * tiles
    tile = within // members
    return tile, first + within - tile * members, ct.bid(2)


@ct.function
def _head_mods(
    Bias, Slopes, b, q_head, softcap_in, softcap_log2, window_left, window_right, acc_dtype, alibi: ConstBool
):
    """The score modifiers' runtime values for one (batch, query head), as one tuple.

    A bias dimension of size 1 is shared by every batch or head: its index is clamped to 0.
    """
    bias_b = min(b, Bias.shape[0] - 1)
    bias_h = min(q_head, Bias.shape[1] - 1)
    slope_log2 = 0.0
    if alibi:
        slope = ct.load(Slopes, index=(min(b, Slopes.shape[0] - 1), q_head), shape=(1, 1))
        slope_log2 = slope.astype(acc_dtype) * _log2e(acc_dtype)
    return Bias, bias_b, bias_h, slope_log2, softcap_in, softcap_log2, window_left, window_right


@ct.function
def _bias_tile(mods, q_tile, kv_tile, block_m: ConstInt, block_n: ConstInt, bias_mode: ConstInt, transposed: ConstBool):
    """The bias under a [block_m, block_n] score tile ([block_n, block_m] when transposed)."""
    Bias, bias_b, bias_h, _, _, _, _, _ = mods
    if bias_mode == BIAS_ONE_ROW:
        tile = ct.load(Bias, index=(bias_b, bias_h, 0, kv_tile), shape=(1, 1, 1, block_n), padding_mode=ZERO_PAD)
        tile = tile.reshape((1, block_n))
    else:
        shape = (1, 1, block_m, block_n)
        tile = ct.load(Bias, index=(bias_b, bias_h, q_tile, kv_tile), shape=shape, padding_mode=ZERO_PAD)
        tile = tile.reshape((block_m, block_n))
    if transposed:
        tile = ct.transpose(tile)
    return tile


@ct.function
def _scores(
    raw,
    rows,
    cols,
    q_tile,
    kv_tile,
    qk_scale_log2,
    seqlen_q,
    seqlen_k,
    input_dtype,
    mods,
    switches,
    block_m: ConstInt,
    block_n: ConstInt,
    transposed: ConstBool,
):
    """(base-2 scores, tanh of the softcap) of raw products q.k, with the switched-on modifiers.

    In natural units: s = scale * q.k, then s = softcap * tanh(s / softcap), then
    s += bias - slope * |i + Sk - Sq - j|. Plain attention is one multiply.
    """
    _, _, _, slope_log2, softcap_in, softcap_log2, _, _ = mods
    _, capped, bias_mode, alibi = switches
    if capped:
        if input_dtype == ct.float16 or input_dtype == ct.bfloat16:
            # The hardware tanh is good to 2^-11, below what 16-bit inputs carry.
            capped_tanh = ct.tanh(raw * softcap_in, rounding_mode=ct.RoundingMode.APPROX)
        else:
            capped_tanh = ct.tanh(raw * softcap_in)
        scores = capped_tanh * softcap_log2
    else:
        capped_tanh = raw
        scores = raw * qk_scale_log2
    if bias_mode != BIAS_NONE:
        bias = _bias_tile(mods, q_tile, kv_tile, block_m, block_n, bias_mode, transposed)
        scores = scores + bias.astype(raw.dtype) * _log2e(raw.dtype)
    if alibi:
        distance = ct.abs(rows + (seqlen_k - seqlen_q) - cols).astype(raw.dtype)
        scores = scores - slope_log2 * distance
    return scores, capped_tanh


@ct.function
def _pre_cap_gradient(d_scores, capped_tanh, capped: ConstBool):
    """The gradient with respect to scale * q.k from the gradient with respect to the scores."""
    if capped:
        return d_scores * (1.0 - capped_tanh * capped_tanh)
    return d_scores


@ct.function
def _causal_key_tiles(q_tile, seqlen_q, seqlen_k, block_m: ConstInt, block_n: ConstInt, causal: ConstBool):
    """Key tiles a query tile visits: [0, num_full) need no mask, [num_full, num_end) do.

    A key tile needs a mask when it crosses the causal diagonal or the end of the keys.
    Key tiles past the last key the tile's bottom row sees are skipped entirely.
    """
    num_tail_free = seqlen_k // block_n
    if causal:
        diagonal = seqlen_k - seqlen_q
        first_row = q_tile * block_m
        keys_seen_by_all_rows = max(first_row + diagonal + 1, 0)
        keys_seen_by_last_row = min(max(first_row + block_m + diagonal, 0), seqlen_k)
        num_full = min(keys_seen_by_all_rows // block_n, num_tail_free)
        num_end = ct.cdiv(keys_seen_by_last_row, block_n)
    else:
        num_full = num_tail_free
        num_end = ct.cdiv(seqlen_k, block_n)
    return num_full, num_end


@ct.function
def _band_tiles(first_seen, last_seen, first_seen_by_all, last_seen_by_all, length, block: ConstInt):
    """(start, full_start, full_end, end) of the tiles of a band of indices along one axis.

    The band is [first_seen, last_seen] (inclusive, unclipped); [first_seen_by_all,
    last_seen_by_all] is where every row (or column) of the other side sees it. Tiles in
    [full_start, full_end) need no mask; [start, full_start) and [full_end, end) do; the
    rest are outside the band and skipped.
    """
    start = min(max(first_seen, 0), length) // block
    end = max(ct.cdiv(min(max(last_seen + 1, 0), length), block), start)
    full_start = min(max(ct.cdiv(min(max(first_seen_by_all, 0), length), block), start), end)
    full_end = max(min(min(max(last_seen_by_all + 1, 0), length) // block, end), full_start)
    return start, full_start, full_end, end


@ct.function
def _window_key_tiles(q_tile, seqlen_q, seqlen_k, mods, block_m: ConstInt, block_n: ConstInt):
    """Key tiles of a query tile under a sliding window: query i sees keys
    [i + d - left, i + d + right] with d = Sk - Sq."""
    _, _, _, _, _, _, window_left, window_right = mods
    first_row = q_tile * block_m + (seqlen_k - seqlen_q)
    last_row = first_row + block_m - 1
    return _band_tiles(
        first_row - window_left, last_row + window_right, last_row - window_left, first_row + window_right,
        seqlen_k, block_n,
    )  # fmt: skip


@ct.function
def _window_query_tiles(kv_tile, seqlen_q, seqlen_k, mods, block_m: ConstInt, block_n: ConstInt):
    """Query tiles that see a key tile under a sliding window: key j is seen by queries
    [j - d - right, j - d + left]."""
    _, _, _, _, _, _, window_left, window_right = mods
    first_col = kv_tile * block_n - (seqlen_k - seqlen_q)
    last_col = first_col + block_n - 1
    return _band_tiles(
        first_col - window_right, last_col + window_left, last_col - window_right, first_col + window_left,
        seqlen_q, block_m,
    )  # fmt: skip


@ct.function
def _visible(rows, cols, seqlen_q, seqlen_k, causal: ConstBool, mods, switches):
    """Which (query, key) pairs a row attends to; rows and cols broadcast against each other."""
    if causal:
        # The diagonal and the end of the keys as one limit per row: one comparison per pair.
        inside = cols <= ct.minimum(rows + (seqlen_k - seqlen_q), seqlen_k - 1)
    else:
        inside = cols < seqlen_k
    windowed, _, _, _ = switches
    if windowed:
        _, _, _, _, _, _, window_left, window_right = mods
        offset = cols - rows - (seqlen_k - seqlen_q)
        inside = inside & (offset >= -window_left) & (offset <= window_right)
    return inside


@ct.function
def _key_columns(kv_tile, block_n: ConstInt, masked: ConstBool, switches):
    """[1, block_n] key indices of a tile, when the mask or ALiBi needs them."""
    _, _, _, alibi = switches
    if masked or alibi:
        return kv_tile * block_n + ct.arange(block_n, dtype=ct.int32)[None, :]
    return 0


@ct.function
def _forward_keeps_raw_scores(switches):
    """Whether the forward keeps raw products q.k and their running max, scaling inside exp2.

    True for plain attention (masks aside), whose launcher makes the scale positive, so the
    largest product is the largest score.
    """
    _, capped, bias_mode, alibi = switches
    return not capped and bias_mode == BIAS_NONE and not alibi


@ct.function
def _forward_step(
    q,
    K,
    V,
    b,
    kv_head,
    q_tile,
    kv_tile,
    row_max,
    row_sum,
    acc,
    rows,
    qk_scale_log2,
    seqlen_q,
    seqlen_k,
    mods,
    switches,
    block_m: ConstInt,
    block_n: ConstInt,
    block_d: ConstInt,
    causal: ConstBool,
    masked: ConstBool,
):
    """One online-softmax update of a query tile with one key/value tile.

    row_max is in raw units or base-2 scores, as _forward_keeps_raw_scores says.
    """
    acc_dtype = _accumulator_dtype(q.dtype)
    k = _load_rows(K, b, kv_head, kv_tile, block_n, block_d)
    raw = ct.mma(q, ct.transpose(k), ct.zeros((block_m, block_n), acc_dtype))
    cols = _key_columns(kv_tile, block_n, masked, switches)
    raw_units = _forward_keeps_raw_scores(switches)
    if raw_units:
        scores = raw
    else:
        scores, _ = _scores(
            raw, rows, cols, q_tile, kv_tile, qk_scale_log2, seqlen_q, seqlen_k, q.dtype, mods, switches,
            block_m, block_n, False,
        )  # fmt: skip
    if masked:
        scores = ct.where(_visible(rows, cols, seqlen_q, seqlen_k, causal, mods, switches), scores, NEG_INF)
    new_max = ct.maximum(row_max, ct.max(scores, axis=1, keepdims=True))
    _, _, bias_mode, _ = switches
    if masked or bias_mode != BIAS_NONE:
        # A row that has seen no key yet (or only -inf biases) keeps max -inf; subtract 0
        # instead to avoid inf - inf.
        new_max_safe = ct.where(new_max == NEG_INF, 0.0, new_max)
    else:
        new_max_safe = new_max
    if raw_units:
        # The scale enters exp2's argument as one fused multiply-add per score.
        probs = _exp2(scores * qk_scale_log2 - new_max_safe * qk_scale_log2)
        rescale = _exp2((row_max - new_max_safe) * qk_scale_log2)
    else:
        probs = _exp2(scores - new_max_safe)
        rescale = _exp2(row_max - new_max_safe)
    row_sum = row_sum * rescale + ct.sum(probs, axis=1, keepdims=True)
    v = _load_rows(V, b, kv_head, kv_tile, block_n, block_d)
    acc = ct.mma(probs.astype(v.dtype), v, acc * rescale)
    return new_max, row_sum, acc


@ct.function
def _forward_loop(
    first,
    last,
    state,
    tile,
    block_m: ConstInt,
    block_n: ConstInt,
    block_d: ConstInt,
    causal: ConstBool,
    masked: ConstBool,
):
    """Online-softmax updates of a query tile with key tiles [first, last).

    state is (row_max, row_sum, acc); tile holds what every step of the query tile shares.
    """
    row_max, row_sum, acc = state
    q, K, V, b, kv_head, q_tile, rows, qk_scale_log2, seqlen_q, seqlen_k, mods, switches = tile
    for kv_tile in range(first, last):
        row_max, row_sum, acc = _forward_step(
            q, K, V, b, kv_head, q_tile, kv_tile, row_max, row_sum, acc, rows, qk_scale_log2,
            seqlen_q, seqlen_k, mods, switches, block_m, block_n, block_d, causal, masked,
        )  # fmt: skip
    return row_max, row_sum, acc


@ct.function
def _forward_first_step_fixed_max(first, state, tile, block_m: ConstInt, block_n: ConstInt, block_d: ConstInt):
    """The first unmasked step of a fixed-max forward, if there is one (first is 0 or 1): its
    scores' row max (raw units) becomes the tile's fixed max, and its sums start from zero.

    A running-max step from the empty state gives the same values but rescales its zero sums;
    with that step here, ptxas found too few registers to pipeline the D=64 kernel's matmuls
    and waited for each one alone (perf-notes section 43).
    """
    q, K, V, b, kv_head, _, _, qk_scale_log2, _, _, _, _ = tile
    acc_dtype = _accumulator_dtype(q.dtype)
    for kv_tile in range(0, first):
        k = _load_rows(K, b, kv_head, kv_tile, block_n, block_d)
        raw = ct.mma(q, ct.transpose(k), ct.zeros((block_m, block_n), acc_dtype))
        row_max = ct.max(raw, axis=1, keepdims=True)
        probs = _exp2(raw * qk_scale_log2 - row_max * qk_scale_log2)
        v = _load_rows(V, b, kv_head, kv_tile, block_n, block_d)
        acc = ct.mma(probs.astype(v.dtype), v, ct.zeros((block_m, block_d), acc_dtype))
        state = (row_max, ct.sum(probs, axis=1, keepdims=True), acc)
    return state


@ct.function
def _forward_loop_fixed_max(first, last, state, tile, block_m: ConstInt, block_n: ConstInt, block_d: ConstInt):
    """Unmasked steps of plain attention against a fixed row max: no running max, no rescale.

    state's row max (raw units) is that of the first key tile. Later scores may exceed it, so
    probabilities may exceed 1; fp32 sums and P hold them with the same relative precision
    until something overflows (bf16 P shares fp32's range, fp16 P ends at 65504, 2^16 above
    the first tile's max), which _overflowed tells after the loops.
    """
    row_max, row_sum, acc = state
    q, K, V, b, kv_head, _, _, qk_scale_log2, _, _, _, _ = tile
    max_log2 = row_max * qk_scale_log2
    for kv_tile in range(first, last):
        k = _load_rows(K, b, kv_head, kv_tile, block_n, block_d)
        raw = ct.mma(q, ct.transpose(k), ct.zeros((block_m, block_n), acc.dtype))
        probs = _exp2(raw * qk_scale_log2 - max_log2)
        row_sum = row_sum + ct.sum(probs, axis=1, keepdims=True)
        v = _load_rows(V, b, kv_head, kv_tile, block_n, block_d)
        acc = ct.mma(probs.astype(v.dtype), v, acc)
    return row_max, row_sum, acc


@ct.function
def _overflowed(state):
    """Whether a row sum or an accumulator element of a query tile is inf or NaN.

    Each row folds its own elements first (within a warp), so only one value per row crosses
    warps: summing the whole tile's flags at once cost nine CTA barriers instead of two.
    A finite |acc| sum that overflows only asks for a recompute that was not needed.
    """
    _, row_sum, acc = state
    row_total = row_sum + ct.sum(ct.abs(acc), axis=1, keepdims=True)
    return ct.sum(ct.where(row_total < POS_INF, 0, 1)) > 0


@ct.function
def _running_max_loops(
    num_full, num_end, state, tile, block_m: ConstInt, block_n: ConstInt, block_d: ConstInt, causal: ConstBool
):
    """Updates of a query tile with key tiles [0, num_full) unmasked, then [num_full, num_end) masked."""
    state = _forward_loop(0, num_full, state, tile, block_m, block_n, block_d, causal, False)
    return _forward_loop(num_full, num_end, state, tile, block_m, block_n, block_d, causal, True)


@ct.function
def _forward_key_loops(
    num_full,
    num_end,
    state,
    tile,
    block_m: ConstInt,
    block_n: ConstInt,
    block_d: ConstInt,
    causal: ConstBool,
    fixed_max: ConstBool,
):
    """_running_max_loops, or with fixed_max (plain attention, fp32 accumulators) the unmasked
    steps after the first against its row max; should anything overflow, the tile is computed
    again with a running max. The check costs every program a cross-warp reduction."""
    if fixed_max:
        first = min(num_full, 1)
        fast = _forward_first_step_fixed_max(first, state, tile, block_m, block_n, block_d)
        fast = _forward_loop_fixed_max(first, num_full, fast, tile, block_m, block_n, block_d)
        fast = _forward_loop(num_full, num_end, fast, tile, block_m, block_n, block_d, causal, True)
        if _overflowed(fast):
            state = _running_max_loops(num_full, num_end, state, tile, block_m, block_n, block_d, causal)
        else:
            state = fast
    else:
        state = _running_max_loops(num_full, num_end, state, tile, block_m, block_n, block_d, causal)
    return state


@ct.function
def _forward_tile(
    Q,
    K,
    V,
    Out,
    Lse,
    qk_scale_log2,
    qk_scale_log2_lo,
    query_group_size,
    Bias,
    Slopes,
    softcap_in,
    softcap_in_lo,
    softcap,
    softcap_lo,
    window_left,
    window_right,
    block_m: ConstInt,
    block_n: ConstInt,
    block_d: ConstInt,
    causal: ConstBool,
    switches,
    write_lse: ConstBool,
    fixed_max: ConstBool,
):
    q_tile, q_head, b, kv_head = _query_program(query_group_size, causal)
    seqlen_q, seqlen_k = _seqlens(Q, K)
    acc_dtype = _accumulator_dtype(Q.dtype)
    qk_scale_log2 = _scale(qk_scale_log2, qk_scale_log2_lo, acc_dtype)
    windowed, capped, bias_mode, alibi = switches
    mods = _head_mods(
        Bias, Slopes, b, q_head, _scale(softcap_in, softcap_in_lo, acc_dtype),
        _scale(softcap, softcap_lo, acc_dtype) * _log2e(acc_dtype), window_left, window_right, acc_dtype, alibi,
    )  # fmt: skip

    q = _load_rows(Q, b, q_head, q_tile, block_m, block_d)
    rows = q_tile * block_m + ct.arange(block_m, dtype=ct.int32)[:, None]
    row_max = ct.full((block_m, 1), NEG_INF, acc_dtype)
    row_sum = ct.zeros((block_m, 1), acc_dtype)
    acc = ct.zeros((block_m, block_d), acc_dtype)

    state = (row_max, row_sum, acc)
    tile = (q, K, V, b, kv_head, q_tile, rows, qk_scale_log2, seqlen_q, seqlen_k, mods, switches)
    if windowed:
        start, full_start, full_end, end = _window_key_tiles(q_tile, seqlen_q, seqlen_k, mods, block_m, block_n)
        state = _forward_loop(start, full_start, state, tile, block_m, block_n, block_d, causal, True)
        state = _forward_loop(full_start, full_end, state, tile, block_m, block_n, block_d, causal, False)
        state = _forward_loop(full_end, end, state, tile, block_m, block_n, block_d, causal, True)
    else:
        num_full, num_end = _causal_key_tiles(q_tile, seqlen_q, seqlen_k, block_m, block_n, causal)
        state = _forward_key_loops(num_full, num_end, state, tile, block_m, block_n, block_d, causal, fixed_max)
    row_max, row_sum, acc = state

    # Rows that saw no key (causal with Sq > Sk) have row_sum 0: output 0, LSE -inf.
    # One reciprocal per row, not a division per element: the division's slow-path checks
    # cost the epilogue a share of a short sequence's time.
    out = acc * (1.0 / ct.where(row_sum == 0.0, 1.0, row_sum))
    _store_rows(Out, b, q_head, q_tile, out, block_m, block_d)
    if write_lse:
        if _forward_keeps_raw_scores(switches):
            row_max = row_max * qk_scale_log2
        lse = (row_max + ct.log2(row_sum)) * _ln2(acc_dtype)
        ct.store(Lse, index=(b, q_head, q_tile), tile=lse.reshape((1, 1, block_m)).astype(Lse.dtype))


@CachedKernel
def attention_forward_kernel(
    Q,
    K,
    V,
    Out,
    qk_scale_log2: float,
    qk_scale_log2_lo: float,
    query_group_size: int,
    Bias,
    Slopes,
    softcap_in: float,
    softcap_in_lo: float,
    softcap: float,
    softcap_lo: float,
    window_left: int,
    window_right: int,
    block_m: ConstInt,
    block_n: ConstInt,
    block_d: ConstInt,
    causal: ConstBool,
    windowed: ConstBool,
    capped: ConstBool,
    bias_mode: ConstInt,
    alibi: ConstBool,
    fixed_max: ConstBool,
):
    """Inference forward: out = softmax(q k^T * scale) v, no LSE written.

    fixed_max (plain attention, fp32 accumulators only): see _forward_key_loops.
    """
    _forward_tile(
        Q, K, V, Out, Out, qk_scale_log2, qk_scale_log2_lo, query_group_size,
        Bias, Slopes, softcap_in, softcap_in_lo, softcap, softcap_lo, window_left, window_right,
        block_m, block_n, block_d, causal, (windowed, capped, bias_mode, alibi), False, fixed_max,
    )  # fmt: skip


@CachedKernel
def attention_forward_lse_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    qk_scale_log2: float,
    qk_scale_log2_lo: float,
    query_group_size: int,
    Bias,
    Slopes,
    softcap_in: float,
    softcap_in_lo: float,
    softcap: float,
    softcap_lo: float,
    window_left: int,
    window_right: int,
    block_m: ConstInt,
    block_n: ConstInt,
    block_d: ConstInt,
    causal: ConstBool,
    windowed: ConstBool,
    capped: ConstBool,
    bias_mode: ConstInt,
    alibi: ConstBool,
    fixed_max: ConstBool,
):
    """Training forward: also writes lse = log(sum_j exp(score_ij)), the backward's statistic."""
    _forward_tile(
        Q, K, V, Out, Lse, qk_scale_log2, qk_scale_log2_lo, query_group_size,
        Bias, Slopes, softcap_in, softcap_in_lo, softcap, softcap_lo, window_left, window_right,
        block_m, block_n, block_d, causal, (windowed, capped, bias_mode, alibi), True, fixed_max,
    )  # fmt: skip


@ct.function
def _row_stats(out, d_out, Lse, Delta, LseBase2, b, q_head, q_tile, block_m: ConstInt):
    """The per-row statistics of the dK/dV and dQ kernels for one query tile, stored and
    returned as [block_m] tiles in fp32 (fp64 for fp64 inputs): Delta_i = sum_d Out_id * dOut_id,
    and the LSE in base 2.

    The base-2 LSE is +inf for a row that saw no key (LSE -inf), which makes its
    probabilities exp2(s - inf) = 0. Converting it here, once per row, keeps that select
    and multiply out of every step of the dK/dV loop.
    """
    acc_dtype = _accumulator_dtype(out.dtype)
    delta = ct.sum(out.astype(acc_dtype) * d_out.astype(acc_dtype), axis=1)
    ct.store(Delta, index=(b, q_head, q_tile), tile=delta.reshape((1, 1, block_m)).astype(Delta.dtype))
    lse = _load_row_stat(Lse, b, q_head, q_tile, block_m)
    lse_base2 = ct.where(lse == NEG_INF, POS_INF, lse * _log2e(lse.dtype))
    ct.store(LseBase2, index=(b, q_head, q_tile), tile=lse_base2.reshape((1, 1, block_m)).astype(LseBase2.dtype))
    return delta, lse_base2  # already in the statistics' dtype: that of the accumulators


@CachedKernel
def attention_backward_preprocess_kernel(
    Out, dOut, Lse, Delta, LseBase2, block_m: ConstInt, block_d: ConstInt
):  # fmt: skip
    """The row statistics (_row_stats) for the fused backward, whose dK/dV programs each need
    those of every query tile. The two-kernel backward's dQ kernel writes them instead."""
    q_tile = ct.bid(0)
    q_head = ct.bid(1)
    b = ct.bid(2)
    out = _load_rows(Out, b, q_head, q_tile, block_m, block_d)
    d_out = _load_rows(dOut, b, q_head, q_tile, block_m, block_d)
    _row_stats(out, d_out, Lse, Delta, LseBase2, b, q_head, q_tile, block_m)


@ct.function
def _dkdv_step(
    k,
    v,
    Q,
    dOut,
    LseBase2,
    Delta,
    DBias,
    DQSum,
    dq_scale,
    b,
    q_head,
    q_tile,
    kv_tile,
    d_key,
    d_value,
    d_bias_row,
    pending_dq,
    pending_tile,
    cols,
    qk_scale_log2,
    seqlen_q,
    seqlen_k,
    mods,
    switches,
    block_m: ConstInt,
    block_n: ConstInt,
    block_d: ConstInt,
    causal: ConstBool,
    masked: ConstBool,
    bias_grad: ConstInt,
    sum_dq: ConstBool,
):
    """Adds one query tile's contribution to a key tile's dK and dV (in key-major form).

    With bias_grad, also writes the tile's dBias (BIAS_PER_ROW) or adds its column sums to
    d_bias_row (BIAS_ONE_ROW). With sum_dq, also adds this key tile's share of dQ (scaled)
    into the fp32 DQSum, a whole tile at a time (a TMA reduction on sm_90). Returns
    (d_key, d_value, d_bias_row, pending_dq): see _holds_dq_share for pending_dq.
    """
    acc_dtype = _accumulator_dtype(k.dtype)
    q = _load_rows(Q, b, q_head, q_tile, block_m, block_d)
    d_out = _load_rows(dOut, b, q_head, q_tile, block_m, block_d)
    lse = _load_row_stat(LseBase2, b, q_head, q_tile, block_m)[None, :]
    delta = _load_row_stat(Delta, b, q_head, q_tile, block_m)[None, :]

    rows = q_tile * block_m + ct.arange(block_m, dtype=ct.int32)[None, :]
    raw_t = ct.mma(k, ct.transpose(q), ct.zeros((block_n, block_m), acc_dtype))
    if sum_dq:
        if _holds_dq_share(block_d):
            # The previous step's share, summed while this step's matmuls run.
            _add_tile(DQSum, b, q_head, pending_tile, pending_dq, block_m, block_d)
    scores_t, capped_tanh_t = _scores(
        raw_t, rows, cols, q_tile, kv_tile, qk_scale_log2, seqlen_q, seqlen_k, k.dtype, mods, switches,
        block_m, block_n, True,
    )  # fmt: skip
    if block_d > 64 and not sum_dq:
        # The D=128 dK/dV kernel runs two CTAs per SM, where the flushed exp2's schedule spills
        # and gained nothing (perf-notes section 14); the fused kernel, at one CTA per SM,
        # gains 1-3% from it (section 25).
        probs_t = ct.exp2(scores_t - lse)
    else:
        probs_t = _exp2(scores_t - lse)
    if masked:
        probs_t = ct.where(_visible(rows, cols, seqlen_q, seqlen_k, causal, mods, switches), probs_t, 0.0)
    # See the second load of Q below; masked steps (few) keep one load: with two, the causal
    # kernel spilled a register.
    reload_q = sum_dq and not masked
    if not reload_q:
        d_value = ct.mma(probs_t.astype(d_out.dtype), d_out, d_value)
    d_probs_t = ct.mma(v, ct.transpose(d_out), ct.zeros((block_n, block_m), acc_dtype))
    d_scores_t = probs_t * (d_probs_t - delta)
    if bias_grad == BIAS_PER_ROW:
        d_bias = ct.transpose(d_scores_t).reshape((1, 1, block_m, block_n)).astype(DBias.dtype)
        ct.store(DBias, index=(b, q_head, q_tile, kv_tile), tile=d_bias)
    elif bias_grad == BIAS_ONE_ROW:
        d_bias_row = d_bias_row + ct.sum(d_scores_t, axis=1, keepdims=True)
    _, capped, _, _ = switches
    d_scores_t = _pre_cap_gradient(d_scores_t, capped_tanh_t, capped).astype(q.dtype)
    if reload_q:
        # The compiler gives each load one buffer, freed after its last use. Loaded once, Q
        # stays busy until dK, so the next step's Q could only be loaded while this step
        # computes dQ, and arrived late (at one CTA per SM nothing covers the wait). Loaded
        # again for dK, the first buffer is free after K Q^T. dK before dV in the source
        # keeps the two matmuls issued back to back (perf-notes section 26).
        d_key = ct.mma(d_scores_t, _load_rows(Q, b, q_head, q_tile, block_m, block_d), d_key)
        d_value = ct.mma(probs_t.astype(d_out.dtype), d_out, d_value)
    else:
        d_key = ct.mma(d_scores_t, q, d_key)
    if sum_dq:
        d_query = ct.mma(ct.transpose(d_scores_t), k, ct.zeros((block_m, block_d), acc_dtype)) * dq_scale
        if _holds_dq_share(block_d):
            pending_dq = d_query
        else:
            _add_tile(DQSum, b, q_head, q_tile, d_query, block_m, block_d)
    return d_key, d_value, d_bias_row, pending_dq


@ct.function
def _holds_dq_share(block_d: ConstInt):
    """Whether the fused backward holds a step's dQ share until the next step, which sums it
    after its first matmul, so the reduction overlaps that step's matmuls instead of stalling
    between steps. Measured on sm_90 (perf-notes section 19): 9-15% faster at D=128 from 4096
    keys (even at 16384 keys without a mask); at D=64 (128x128 tiles) up to 6% slower."""
    return block_d > 64


@ct.function
def _add_tile(array, b, h, tile_index, tile, rows: ConstInt, cols: ConstInt):
    """Adds a rows x cols fp32 tile into a tile-padded fp32 sum [B, H, S, D], a whole tile at
    once (one TMA reduction on sm_90, where a per-element atomic add is one REDG per value)."""
    view = array.tiled_view((1, 1, rows, cols))
    view.atomic_store_add((b, h, tile_index, 0), tile.reshape((1, 1, rows, cols)))


@ct.function
def _dkdv_loop(
    first,
    last,
    state,
    tile,
    block_m: ConstInt,
    block_n: ConstInt,
    block_d: ConstInt,
    causal: ConstBool,
    masked: ConstBool,
    bias_grad: ConstInt,
    sum_dq: ConstBool,
):
    """state (d_key, d_value, d_bias_row, pending_dq, pending_tile) plus the contributions of
    query tiles [first, last); pending_dq is the dQ share of query tile pending_tile not yet summed."""
    d_key, d_value, d_bias_row, pending_dq, pending_tile = state
    (k, v, Q, dOut, LseBase2, Delta, DBias, DQSum, dq_scale, b, q_head, kv_tile, cols,
     qk_scale_log2, seqlen_q, seqlen_k, mods, switches) = tile  # fmt: skip
    for q_tile in range(first, last):
        d_key, d_value, d_bias_row, pending_dq = _dkdv_step(
            k, v, Q, dOut, LseBase2, Delta, DBias, DQSum, dq_scale, b, q_head, q_tile, kv_tile, d_key, d_value,
            d_bias_row, pending_dq, pending_tile, cols, qk_scale_log2, seqlen_q, seqlen_k, mods, switches,
            block_m, block_n, block_d, causal, masked, bias_grad, sum_dq,
        )  # fmt: skip
        pending_tile = q_tile
    return d_key, d_value, d_bias_row, pending_dq, pending_tile


@ct.function
def _causal_query_tiles(kv_tile, seqlen_q, seqlen_k, block_m: ConstInt, block_n: ConstInt, causal: ConstBool):
    """Query tiles that see a key tile: [masked_start, full_start) need a mask, [full_start,
    num_q_tiles) do not; tiles before masked_start see none of its keys and are skipped."""
    num_q_tiles = ct.cdiv(seqlen_q, block_m)
    if causal:
        diagonal = seqlen_k - seqlen_q
        # First query row that sees the tile's first key, and first row that sees all its keys.
        first_seeing = max(kv_tile * block_n - diagonal, 0)
        first_seeing_all = max(kv_tile * block_n + block_n - 1 - diagonal, 0)
        masked_start = min(first_seeing // block_m, num_q_tiles)
        full_start = min(ct.cdiv(first_seeing_all, block_m), num_q_tiles)
    else:
        masked_start = 0
        full_start = 0
    return masked_start, full_start, num_q_tiles


@CachedKernel
def attention_backward_dkdv_kernel(
    Q,
    K,
    V,
    dOut,
    LseBase2,
    Delta,
    dK,
    dV,
    DQSum,
    softmax_scale: float,
    softmax_scale_lo: float,
    qk_scale_log2: float,
    qk_scale_log2_lo: float,
    query_group_size: int,
    Bias,
    Slopes,
    DBias,
    softcap_in: float,
    softcap_in_lo: float,
    softcap: float,
    softcap_lo: float,
    window_left: int,
    window_right: int,
    block_m: ConstInt,
    block_n: ConstInt,
    block_d: ConstInt,
    causal: ConstBool,
    windowed: ConstBool,
    capped: ConstBool,
    bias_mode: ConstInt,
    alibi: ConstBool,
    bias_grad: ConstInt,
    sum_dq: ConstBool,
    sum_dkdv: ConstBool,
):
    """dK and dV (and dBias, with bias_grad) of one key tile of one KV head.

    Loops over every query head of the GQA group and every query tile that sees the key
    tile, so the group's sum happens in registers: no atomics, deterministic.
    dBias goes to a [B, Hq, 1 or Sq, Sk] buffer that the host sums over broadcast dims.
    With sum_dq (the fused backward), the kernel also adds each key tile's share of dQ
    into DQSum ([B, Hq, Sq padded to block_m, D] fp32, zeroed), which makes the dQ kernel
    unnecessary: 5 matmul-equivalents instead of 7, but the order of dQ's sums varies from
    run to run. Without it, DQSum is an unused placeholder.
    With sum_dkdv (the fused backward of grouped-query attention), a program takes one query
    head (grid axis 1 counts query heads), and dK, dV are zeroed fp32 sums ([B, Hkv, Sk
    padded to block_n, D]) that the programs of a group add into: a group's heads run side
    by side instead of one after another in one program, which balances the GPU's load when
    few KV heads make few programs.
    """
    if causal and sum_dq:
        # Causal key tiles near the start of the sequence are seen by the most query tiles.
        kv_tile, head, b = _heaviest_first()
    else:
        kv_tile, head, b = ct.bid(0), ct.bid(1), ct.bid(2)
    if sum_dkdv:
        first_q_head = head
        kv_head = first_q_head // query_group_size
        members = 1
    else:
        kv_head = head
        first_q_head = kv_head * query_group_size
        members = query_group_size
    seqlen_q, seqlen_k = _seqlens(Q, K)
    acc_dtype = _accumulator_dtype(K.dtype)
    qk_scale_log2 = _scale(qk_scale_log2, qk_scale_log2_lo, acc_dtype)
    softmax_scale = _scale(softmax_scale, softmax_scale_lo, acc_dtype)
    softcap_in = _scale(softcap_in, softcap_in_lo, acc_dtype)
    softcap_log2 = _scale(softcap, softcap_lo, acc_dtype) * _log2e(acc_dtype)
    switches = (windowed, capped, bias_mode, alibi)

    k = _load_rows(K, b, kv_head, kv_tile, block_n, block_d)
    v = _load_rows(V, b, kv_head, kv_tile, block_n, block_d)
    cols = kv_tile * block_n + ct.arange(block_n, dtype=ct.int32)[:, None]
    d_key = ct.zeros((block_n, block_d), acc_dtype)
    d_value = ct.zeros((block_n, block_d), acc_dtype)
    holds_dq = sum_dq and _holds_dq_share(block_d)

    for group_member in range(members):
        q_head = first_q_head + group_member
        mods = _head_mods(
            Bias, Slopes, b, q_head, softcap_in, softcap_log2, window_left, window_right, acc_dtype, alibi
        )
        # A held dQ share starts as zeros "for" query tile 0, which always exists: the first
        # step adds them there, so no step needs a branch (one spare reduction per head).
        pending_dq = ct.zeros((block_m, block_d) if holds_dq else (1, 1), acc_dtype)
        state = (d_key, d_value, ct.zeros((block_n, 1), acc_dtype), pending_dq, 0)
        tile = (
            k,
            v,
            Q,
            dOut,
            LseBase2,
            Delta,
            DBias,
            DQSum,
            softmax_scale,
            b,
            q_head,
            kv_tile,
            cols,
            qk_scale_log2,
            seqlen_q,
            seqlen_k,
            mods,
            switches,
        )
        sizes = (block_m, block_n, block_d, causal)
        if windowed:
            start, full_start, full_end, end = _window_query_tiles(kv_tile, seqlen_q, seqlen_k, mods, block_m, block_n)
            state = _dkdv_loop(start, full_start, state, tile, *sizes, True, bias_grad, sum_dq)
            state = _dkdv_loop(full_start, full_end, state, tile, *sizes, False, bias_grad, sum_dq)
            state = _dkdv_loop(full_end, end, state, tile, *sizes, True, bias_grad, sum_dq)
        else:
            masked_start, full_start, num_q_tiles = _causal_query_tiles(
                kv_tile, seqlen_q, seqlen_k, block_m, block_n, causal
            )
            state = _dkdv_loop(masked_start, full_start, state, tile, *sizes, True, bias_grad, sum_dq)
            state = _dkdv_loop(full_start, num_q_tiles, state, tile, *sizes, False, bias_grad, sum_dq)
        d_key, d_value, d_bias_row, pending_dq, pending_tile = state
        if holds_dq:
            _add_tile(DQSum, b, q_head, pending_tile, pending_dq, block_m, block_d)
        if bias_grad == BIAS_ONE_ROW:
            d_bias = d_bias_row.reshape((1, 1, 1, block_n)).astype(DBias.dtype)
            ct.store(DBias, index=(b, q_head, 0, kv_tile), tile=d_bias)

    if sum_dkdv:
        _add_tile(dK, b, kv_head, kv_tile, d_key * softmax_scale, block_n, block_d)
        _add_tile(dV, b, kv_head, kv_tile, d_value, block_n, block_d)
    else:
        _store_rows(dK, b, kv_head, kv_tile, d_key * softmax_scale, block_n, block_d)
        _store_rows(dV, b, kv_head, kv_tile, d_value, block_n, block_d)


@ct.function
def _dq_step(
    q,
    d_out,
    lse,
    delta,
    K,
    V,
    b,
    kv_head,
    q_tile,
    kv_tile,
    d_query,
    rows,
    qk_scale_log2,
    seqlen_q,
    seqlen_k,
    mods,
    switches,
    block_m: ConstInt,
    block_n: ConstInt,
    block_d: ConstInt,
    causal: ConstBool,
    masked: ConstBool,
):
    acc_dtype = _accumulator_dtype(q.dtype)
    k = _load_rows(K, b, kv_head, kv_tile, block_n, block_d)
    v = _load_rows(V, b, kv_head, kv_tile, block_n, block_d)
    raw = ct.mma(q, ct.transpose(k), ct.zeros((block_m, block_n), acc_dtype))
    cols = _key_columns(kv_tile, block_n, masked, switches)
    scores, capped_tanh = _scores(
        raw, rows, cols, q_tile, kv_tile, qk_scale_log2, seqlen_q, seqlen_k, q.dtype, mods, switches,
        block_m, block_n, False,
    )  # fmt: skip
    probs = _exp2(scores - lse)
    if masked:
        probs = ct.where(_visible(rows, cols, seqlen_q, seqlen_k, causal, mods, switches), probs, 0.0)
    d_probs = ct.mma(d_out, ct.transpose(v), ct.zeros((block_m, block_n), acc_dtype))
    _, capped, _, _ = switches
    d_scores = _pre_cap_gradient(probs * (d_probs - delta), capped_tanh, capped)
    return ct.mma(d_scores.astype(k.dtype), k, d_query)


@ct.function
def _dq_loop(
    first,
    last,
    d_query,
    tile,
    block_m: ConstInt,
    block_n: ConstInt,
    block_d: ConstInt,
    causal: ConstBool,
    masked: ConstBool,
):
    """d_query plus the contributions of key tiles [first, last); tile holds what they share."""
    q, d_out, lse, delta, K, V, b, kv_head, q_tile, rows, qk_scale_log2, seqlen_q, seqlen_k, mods, switches = tile
    for kv_tile in range(first, last):
        d_query = _dq_step(
            q, d_out, lse, delta, K, V, b, kv_head, q_tile, kv_tile, d_query, rows, qk_scale_log2,
            seqlen_q, seqlen_k, mods, switches, block_m, block_n, block_d, causal, masked,
        )  # fmt: skip
    return d_query


@CachedKernel
def attention_backward_dq_kernel(
    Q,
    K,
    V,
    dOut,
    Out,
    Lse,
    LseBase2,
    Delta,
    dQ,
    softmax_scale: float,
    softmax_scale_lo: float,
    qk_scale_log2: float,
    qk_scale_log2_lo: float,
    query_group_size: int,
    Bias,
    Slopes,
    softcap_in: float,
    softcap_in_lo: float,
    softcap: float,
    softcap_lo: float,
    window_left: int,
    window_right: int,
    block_m: ConstInt,
    block_n: ConstInt,
    block_d: ConstInt,
    causal: ConstBool,
    windowed: ConstBool,
    capped: ConstBool,
    bias_mode: ConstInt,
    alibi: ConstBool,
):
    """dQ of one query tile, looping over the key tiles it sees; first the tile's row statistics
    (_row_stats), which the dK/dV kernel launched after it reads: no preprocess kernel, and Out
    costs a load of one tile per program instead of a pass of its own over Out and dOut."""
    q_tile, q_head, b, kv_head = _query_program(query_group_size, causal)
    seqlen_q, seqlen_k = _seqlens(Q, K)
    acc_dtype = _accumulator_dtype(Q.dtype)
    qk_scale_log2 = _scale(qk_scale_log2, qk_scale_log2_lo, acc_dtype)
    softmax_scale = _scale(softmax_scale, softmax_scale_lo, acc_dtype)
    switches = (windowed, capped, bias_mode, alibi)
    mods = _head_mods(
        Bias, Slopes, b, q_head, _scale(softcap_in, softcap_in_lo, acc_dtype),
        _scale(softcap, softcap_lo, acc_dtype) * _log2e(acc_dtype), window_left, window_right, acc_dtype, alibi,
    )  # fmt: skip

    q = _load_rows(Q, b, q_head, q_tile, block_m, block_d)
    d_out = _load_rows(dOut, b, q_head, q_tile, block_m, block_d)
    out = _load_rows(Out, b, q_head, q_tile, block_m, block_d)
    delta, lse = _row_stats(out, d_out, Lse, Delta, LseBase2, b, q_head, q_tile, block_m)
    delta, lse = delta[:, None], lse[:, None]
    rows = q_tile * block_m + ct.arange(block_m, dtype=ct.int32)[:, None]
    d_query = ct.zeros((block_m, block_d), acc_dtype)

    tile = (q, d_out, lse, delta, K, V, b, kv_head, q_tile, rows, qk_scale_log2, seqlen_q, seqlen_k, mods, switches)
    if windowed:
        start, full_start, full_end, end = _window_key_tiles(q_tile, seqlen_q, seqlen_k, mods, block_m, block_n)
        d_query = _dq_loop(start, full_start, d_query, tile, block_m, block_n, block_d, causal, True)
        d_query = _dq_loop(full_start, full_end, d_query, tile, block_m, block_n, block_d, causal, False)
        d_query = _dq_loop(full_end, end, d_query, tile, block_m, block_n, block_d, causal, True)
    else:
        num_full, num_end = _causal_key_tiles(q_tile, seqlen_q, seqlen_k, block_m, block_n, causal)
        d_query = _dq_loop(0, num_full, d_query, tile, block_m, block_n, block_d, causal, False)
        d_query = _dq_loop(num_full, num_end, d_query, tile, block_m, block_n, block_d, causal, True)

    _store_rows(dQ, b, q_head, q_tile, d_query * softmax_scale, block_m, block_d)

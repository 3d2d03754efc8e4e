"""The forward kernel: out = softmax(scores) v per query tile, online over key tiles, and with
write_lse the row LSE the backward needs.

Scores are kept in base 2 (scaled by softmax_scale * log2(e)) so exp2 does the softmax; plain
attention keeps raw products instead and applies the scale inside exp2's argument, and a score
function's output stays in natural units, times log2(e) there (modifiers.keeps_scaled_scores).
"""

import cuda.tile as ct

from tilegym.kernel_cache import CachedKernel
from tilegym.ops.attention.kernels.dropout import dropout_of, dropped, output_scale
from tilegym.ops.attention.kernels.head import (
    head_dot,
    head_product,
    head_row_abs_sum,
    head_scaled,
    head_zeros,
    load_head,
    store_head,
)
from tilegym.ops.attention.kernels.modifiers import (
    alibi_true_row_max,
    head_mods,
    keeps_raw_scores,
    keeps_scaled_scores,
    kept_to_log2,
    raw_scores,
    scores,
    scores_log2,
    softcap_values,
)
from tilegym.ops.attention.kernels.packed import (
    bulk_once,
    empty_lse_around,
    past_the_end,
    rows_of,
    sequence_rows,
    zero_rows_around,
)
from tilegym.ops.attention.kernels.ranges import key_columns, key_segments, over_segments, tile_columns, visible
from tilegym.ops.attention.kernels.scheduling import query_program
from tilegym.ops.attention.kernels.state import ForwardState, ForwardTile, HeadSplit, Scoring, Switches, Tiling
from tilegym.ops.attention.kernels.tiles import (
    NEG_INF,
    POS_INF,
    ConstBool,
    ConstInt,
    accumulator_dtype,
    exp2,
    ln2,
    log2e,
    scale,
    seqlens,
    store_row_stat,
)
from tilegym.ops.attention.kernels.user import (
    AUX_GRAD,
    MASK_MOD,
    SCORE_MOD,
    SCORE_MOD_GRAD,
    over_listed_tiles,
    score_modified,
    tile_lists,
    user_args,
    user_functions,
)
from tilegym.ops.attention.score_mods import BIAS_NONE


@ct.function
def _forward_step(tile, kv_tile, state, masked: ConstBool):
    """One online-softmax update of a query tile (ForwardTile) with one key/value tile."""
    scoring = tile.scoring
    tiling = scoring.tiling
    acc_dtype = accumulator_dtype(tile.q.main.dtype)
    k = load_head(tile.K, tile.b, tile.kv_head, kv_tile, tiling.block_n, tiling.qk)
    raw = head_dot(tile.q, k, ct.zeros((tiling.block_m, tiling.block_n), acc_dtype), tiling.qk)
    cols = key_columns(kv_tile, tiling.block_n, masked, scoring.switches)
    raw_units = keeps_raw_scores(scoring.switches)
    if raw_units:
        step_scores = raw_scores(raw, tile.q_tile, kv_tile, scoring, tile.q.main.dtype)
    else:
        step_scores, _, _ = scores(raw, tile.rows, cols, tile.q_tile, kv_tile, tile.q.main.dtype, scoring, False)
    if masked:
        step_scores = ct.where(visible(tile.rows, cols, scoring), step_scores, NEG_INF)
    row_max = state.row_max
    new_max = ct.maximum(row_max, ct.max(step_scores, axis=1, keepdims=True))
    if masked or scoring.switches.bias_mode != BIAS_NONE or scoring.switches.user.score_mod is not None:
        # A row that has seen no key yet (or only -inf scores) keeps max -inf; subtract 0
        # instead to avoid inf - inf.
        new_max_safe = ct.where(new_max == NEG_INF, 0.0, new_max)
    else:
        new_max_safe = new_max
    if keeps_scaled_scores(scoring.switches):
        # The scale enters exp2's argument as one fused multiply-add per score.
        to_log2 = kept_to_log2(scoring, acc_dtype)
        probs = exp2(step_scores * to_log2 - new_max_safe * to_log2)
        rescale = exp2((row_max - new_max_safe) * to_log2)
    else:
        probs = exp2(step_scores - new_max_safe)
        rescale = exp2(row_max - new_max_safe)
    row_sum = state.row_sum * rescale + ct.sum(probs, axis=1, keepdims=True)
    probs = dropped(probs, scoring.dropout, tile.rows, tile_columns(kv_tile, tiling.block_n))
    v = load_head(tile.V, tile.b, tile.kv_head, kv_tile, tiling.block_n, tiling.value)
    acc = head_product(probs.astype(v.main.dtype), v, head_scaled(state.acc, rescale, tiling.value), tiling.value)
    return ForwardState(new_max, row_sum, acc)


@ct.function
def _forward_loop(first, last, state, tile, masked: ConstBool):
    """Online-softmax updates of a query tile with key tiles [first, last)."""
    for kv_tile in range(first, last):
        state = _forward_step(tile, kv_tile, state, masked)
    return state


@ct.function
def _first_step_fixed_max(first, state, tile):
    """The first unmasked step of a fixed-max forward, if there is one (first is 0 or 1): its
    scores' row max (raw units) becomes the tile's fixed max, and its sums start from zero.

    A running-max step from the empty state gives the same values but rescales its zero sums;
    with that step here, ptxas found too few registers to pipeline the D=64 kernel's matmuls
    and waited for each one alone (perf-notes#d64-serialized-matmuls).
    """
    tiling = tile.scoring.tiling
    qk_scale_log2 = tile.scoring.qk_scale_log2
    acc_dtype = accumulator_dtype(tile.q.main.dtype)
    for kv_tile in range(0, first):
        k = load_head(tile.K, tile.b, tile.kv_head, kv_tile, tiling.block_n, tiling.qk)
        raw = head_dot(tile.q, k, ct.zeros((tiling.block_m, tiling.block_n), acc_dtype), tiling.qk)
        row_max = ct.max(raw, axis=1, keepdims=True)
        probs = exp2(raw * qk_scale_log2 - row_max * qk_scale_log2)
        row_sum = ct.sum(probs, axis=1, keepdims=True)
        probs = dropped(probs, tile.scoring.dropout, tile.rows, tile_columns(kv_tile, tiling.block_n))
        v = load_head(tile.V, tile.b, tile.kv_head, kv_tile, tiling.block_n, tiling.value)
        zeros = head_zeros(tiling.block_m, tiling.value, acc_dtype)
        acc = head_product(probs.astype(v.main.dtype), v, zeros, tiling.value)
        state = ForwardState(row_max, row_sum, acc)
    return state


@ct.function
def _loop_fixed_max(first, last, state, tile, masked: ConstBool):
    """Steps of plain attention (ALiBi, a score function or softcap alone) against a fixed row
    max: no running max, no rescale. masked: the steps hide what the tile's rows do not see.

    state's row max (in the units the forward keeps, keeps_scaled_scores) is that of the first
    key tiles visited, or softcap's bound. Later scores may exceed the former, so probabilities
    may exceed 1; fp32 sums and P hold them with the same relative precision until something
    overflows (bf16 P shares fp32's range, fp16 P ends at 65504, 2^16 above the first tile's
    max), which _overflowed tells after the loops.
    """
    scoring = tile.scoring
    tiling = scoring.tiling
    raw_units = keeps_raw_scores(scoring.switches)
    row_max, row_sum, acc = state.row_max, state.row_sum, state.acc
    acc_dtype = row_sum.dtype
    to_log2 = kept_to_log2(scoring, acc_dtype)
    max_log2 = row_max * to_log2 if keeps_scaled_scores(scoring.switches) else row_max
    for kv_tile in range(first, last):
        k = load_head(tile.K, tile.b, tile.kv_head, kv_tile, tiling.block_n, tiling.qk)
        raw = head_dot(tile.q, k, ct.zeros((tiling.block_m, tiling.block_n), acc_dtype), tiling.qk)
        cols = key_columns(kv_tile, tiling.block_n, masked, scoring.switches)
        if raw_units:
            raw = raw_scores(raw, tile.q_tile, kv_tile, scoring, tile.q.main.dtype)
            probs = exp2(raw * to_log2 - max_log2)
        else:
            step_scores, _, _ = scores(raw, tile.rows, cols, tile.q_tile, kv_tile, tile.q.main.dtype, scoring, False)
            probs = exp2(scores_log2(step_scores, scoring) - max_log2)
        if masked:
            probs = ct.where(visible(tile.rows, cols, scoring), probs, 0.0)
        row_sum = row_sum + ct.sum(probs, axis=1, keepdims=True)
        probs = dropped(probs, scoring.dropout, tile.rows, tile_columns(kv_tile, tiling.block_n))
        v = load_head(tile.V, tile.b, tile.kv_head, kv_tile, tiling.block_n, tiling.value)
        acc = head_product(probs.astype(v.main.dtype), v, acc, tiling.value)
    return ForwardState(row_max, row_sum, acc)


@ct.function
def _overflowed(state, value_split):
    """Whether a row sum or an accumulator element of a query tile is inf or NaN.

    Each row folds its own elements first (within a warp), so only one value per row crosses
    warps: summing the whole tile's flags at once cost nine CTA barriers instead of two.
    A finite |acc| sum that overflows only asks for a recompute that was not needed.
    """
    row_total = state.row_sum + head_row_abs_sum(state.acc, value_split)
    return ct.sum(ct.where(row_total < POS_INF, 0, 1)) > 0


@ct.function
def _key_loops(segments, state, tile, fixed_max: ConstBool):
    """The updates of a query tile with every key tile it sees (segments), or with fixed_max
    (plain attention, fp32 accumulators, no window) the unmasked steps after the first against
    its row max, or (causal ALiBi or a causal score function alone) the unmasked steps against
    the row max of the masked ones; should anything overflow, the tile is computed again with a
    running max. The check costs every program a cross-warp reduction. A row that sees no key of
    the masked tiles keeps max -inf, which overflows at its first unmasked step: that tile takes
    the running max. ALiBi or a score function without a mask starts from the key tiles under its
    rows' diagonal instead. Softcap alone needs no check: its fixed max is the cap."""
    if fixed_max and tile.scoring.switches.capped:
        # Softcap alone (bf16, dispatch.bounded_softcap): no score exceeds the cap, every row's
        # fixed max from the first step. Nothing can overflow, so nothing is checked, and a row
        # whose scores all sit near -cap keeps probabilities of at least 2^-100 (the dispatch's
        # bound on the cap), normal in fp32 and bf16.
        bound = ct.full((tile.scoring.tiling.block_m, 1), tile.scoring.mods.softcap_log2, state.row_sum.dtype)
        state = over_segments(_loop_fixed_max, segments, ForwardState(bound, state.row_sum, state.acc), tile)
    elif fixed_max:
        positional = tile.scoring.switches.alibi or score_modified(tile.scoring.switches)
        if positional and tile.scoring.causal:
            # ALiBi lowers scores with distance: the diagonal's tiles (masked, running max) hold
            # each row's largest, which then stays fixed for the rest, farther and lower. A
            # score function (causal, as ALiBi) starts there too: recent keys are where a
            # position-dependent score is likeliest to peak, and any order is right, overflow
            # aside.
            fast = _forward_loop(segments.full_end, segments.end, state, tile, True)
            fast = _loop_fixed_max(0, segments.full_end, fast, tile, False)
        elif positional:
            # Without a mask there are no masked diagonal tiles: the unmasked key tiles under the
            # query tile's diagonal (bottom-right aligned, as causal) set the max, with a running
            # max; the others follow against it, and the keys' ragged end (masked) comes last
            # with a running max. ALiBi peaks on the diagonal; a score function most likely near it.
            tiling = tile.scoring.tiling
            diagonal_key = tile.q_tile * tiling.block_m + tile.scoring.seqlens.k - tile.scoring.seqlens.q
            start = max(min(diagonal_key // tiling.block_n, segments.full_end - 1), 0)
            last = (diagonal_key + tiling.block_m - 1) // tiling.block_n
            start_end = min(max(last + 1, start + 1), segments.full_end)
            fast = _forward_loop(start, start_end, state, tile, False)
            fast = _loop_fixed_max(start_end, segments.full_end, fast, tile, False)
            fast = _loop_fixed_max(0, start, fast, tile, False)
            fast = _forward_loop(segments.full_end, segments.end, fast, tile, True)
        else:
            first = min(segments.full_end, 1)
            fast = _first_step_fixed_max(first, state, tile)
            fast = _loop_fixed_max(first, segments.full_end, fast, tile, False)
            fast = _forward_loop(segments.full_end, segments.end, fast, tile, True)
        if _overflowed(fast, tile.scoring.tiling.value):
            state = over_segments(_forward_loop, segments, state, tile)
        else:
            state = fast
    else:
        state = over_segments(_forward_loop, segments, state, tile)
    return state


@ct.function
def _with_sink(state, Sinks, q_head, scaled: ConstBool, to_log2, value_split):
    """state with the head's sink logit joined to each row's sum, and its row max in base-2
    units (scaled: it was in units that to_log2 converts, keeps_scaled_scores). The sink takes
    probability mass and gives no value: the accumulator is only rescaled to the new max. A row
    that saw no key gets the sink alone: its output stays 0, its LSE is the sink."""
    acc_dtype = state.row_sum.dtype
    sink_log2 = ct.load(Sinks, index=(q_head,), shape=(1,)).astype(acc_dtype).reshape((1, 1)) * log2e(acc_dtype)
    row_max = state.row_max
    if scaled:
        row_max = row_max * to_log2
    new_max = ct.maximum(row_max, sink_log2)
    # A -inf sink on a row that saw no key: subtract 0 instead of -inf.
    new_max_safe = ct.where(new_max == NEG_INF, 0.0, new_max)
    rescale = exp2(row_max - new_max_safe)
    row_sum = state.row_sum * rescale + exp2(sink_log2 - new_max_safe)
    return ForwardState(new_max, row_sum, head_scaled(state.acc, rescale, value_split))


@CachedKernel
def attention_forward_kernel(
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
    block_dv: ConstInt,
    block_d_tail: ConstInt,
    causal: ConstBool,
    windowed: ConstBool,
    capped: ConstBool,
    bias_mode: ConstInt,
    alibi: ConstBool,
    Sinks,
    with_sinks: ConstBool,
    write_lse: ConstBool,
    fixed_max: ConstBool,
    CuSeqlensQ,
    CuSeqlensK,
    max_seqlen_q: int,
    max_seqlen_k: int,
    varlen: ConstBool,
    Aux0,
    Aux1,
    Aux2,
    Aux3,
    MaskAux0,
    MaskAux1,
    MaskAux2,
    MaskAux3,
    MaskCounts,
    MaskTiles,
    block_sparse: ConstBool,
    DropoutSeed,
    dropout_threshold: int,
    dropout_scale: float,
    dropout_scale_lo: float,
    dropout: ConstBool,
):
    """One query tile of out = softmax(scores) v; with write_lse also lse = log(sum_j
    exp(score_ij)) (natural log), the backward's statistic. Without it, Lse is not touched (a
    placeholder). fixed_max (plain attention, fp32 accumulators only): see _key_loops.
    with_sinks: each row's denominator also holds exp(Sinks[q_head]) (_with_sink).
    Layout: q [B, Hq, Sq, D]; k [B, Hkv, Sk, D]; v [B, Hkv, Sk, Dv]; out [B, Hq, Sq, Dv]; lse
    [B, Hq, Sq]; sinks [Hq]. block_d and block_d_tail tile D (head.py); block_dv tiles Dv as one
    tile: split in two, P would multiply two tiles of V, and ptxas then waits for each matmul alone
    (perf-notes#split-head-dim).
    varlen: a packed batch (packed.py); grid axis 2 counts its sequences.
    The caller's functions (user.py) read Aux* and MaskAux*; block_sparse: the key tiles come
    from a block mask's lists (MaskCounts, MaskTiles) instead of the causal or window ranges.
    dropout: the probabilities that multiply V are dropped as dropout.py draws them from
    DropoutSeed, the threshold and the scale; the LSE is that of the undropped ones.
    """
    q_tile, q_head, b, kv_head = query_program(query_group_size, causal)
    seq = b  # the batch entry or, packed, the sequence: it picks ALiBi slopes
    if varlen:
        q_rows = sequence_rows(CuSeqlensQ, seq, Q, max_seqlen_q)
        if q_tile == 0:
            zero_rows_around(Out, CuSeqlensQ, seq, q_head, q_rows, max_seqlen_q, HeadSplit(block_dv, 0))
            if write_lse:
                empty_lse_around(Lse, CuSeqlensQ, seq, q_head, q_rows, max_seqlen_q)
        if past_the_end(q_tile * block_m, q_rows):
            return
        k_rows = sequence_rows(CuSeqlensK, seq, K, max_seqlen_k)
        Q, Out, K, V = rows_of(Q, q_rows), rows_of(Out, q_rows), rows_of(K, k_rows), rows_of(V, k_rows)
        if write_lse:
            Lse = rows_of(Lse, q_rows)
        b = 0
    lengths = seqlens(Q, K)
    acc_dtype = accumulator_dtype(Q.dtype)
    qk_scale_log2 = scale(qk_scale_log2, qk_scale_log2_lo, acc_dtype)
    switches = Switches(
        windowed, capped, bias_mode, alibi, user_functions(SCORE_MOD, SCORE_MOD_GRAD, AUX_GRAD, MASK_MOD)
    )
    softcap_in, softcap_log2 = softcap_values(softcap_in, softcap_in_lo, softcap, softcap_lo, acc_dtype)
    mods = head_mods(Bias, Slopes, seq, q_head, softcap_in, softcap_log2, window_left, window_right, acc_dtype, alibi)
    user = user_args(seq, q_head, Aux0, Aux1, Aux2, Aux3, MaskAux0, MaskAux1, MaskAux2, MaskAux3)
    tiling = Tiling(block_m, block_n, HeadSplit(block_d, block_d_tail), HeadSplit(block_dv, 0))
    drop = dropout_of(DropoutSeed, seq, q_head, dropout_threshold, dropout_scale, dropout_scale_lo, acc_dtype, dropout)
    scoring = Scoring(qk_scale_log2, lengths, mods, switches, tiling, causal, user, drop)

    # A packed batch's program loads its query tile and stores its output once: no bulk copies.
    bulk = bulk_once(varlen, scoring.tiling)
    q = load_head(Q, b, q_head, q_tile, block_m, tiling.qk, bulk)
    rows = q_tile * block_m + ct.arange(block_m, dtype=ct.int32)[:, None]
    state = ForwardState(
        ct.full((block_m, 1), NEG_INF, acc_dtype),
        ct.zeros((block_m, 1), acc_dtype),
        head_zeros(block_m, tiling.value, acc_dtype),
    )
    tile = ForwardTile(q, K, V, b, kv_head, q_tile, rows, scoring)
    if block_sparse:
        state = over_listed_tiles(_forward_step, tile_lists(MaskCounts, MaskTiles, seq, q_head), q_tile, state, tile)
    else:
        state = _key_loops(key_segments(q_tile, scoring), state, tile, fixed_max)
    row_max = alibi_true_row_max(state.row_max, q_tile, scoring, Q.dtype, keeps_raw_scores(switches))
    state = ForwardState(row_max, state.row_sum, state.acc)
    to_log2 = kept_to_log2(scoring, acc_dtype)

    if with_sinks:
        state = _with_sink(state, Sinks, q_head, keeps_scaled_scores(switches), to_log2, tiling.value)

    # Rows that saw no key (causal with Sq > Sk) have row_sum 0: output 0, LSE -inf.
    # One reciprocal per row, not a division per element: the division's slow-path checks
    # cost the epilogue a share of a short sequence's time.
    row_sum = state.row_sum
    out = head_scaled(state.acc, output_scale(drop) / ct.where(row_sum == 0.0, 1.0, row_sum), tiling.value)
    store_head(Out, b, q_head, q_tile, out, block_m, tiling.value, bulk)
    if write_lse:
        row_max = state.row_max
        if keeps_scaled_scores(switches) and not with_sinks:
            row_max = row_max * to_log2
        lse = (row_max + ct.log2(row_sum)) * ln2(acc_dtype)
        store_row_stat(Lse, b, q_head, q_tile, lse, block_m, True)

"""The backward kernels: the row statistics (preprocess), dK and dV per key tile (optionally
with dQ summed in: the fused backward), and dQ per query tile (the two-kernel backward).

The dK/dV kernel works key-major: its tiles are [block_n, block_m] (keys x queries), the
transpose of the forward's, so that dK and dV accumulate as [block_n, block_d] rows.
"""

import cuda.tile as ct

from tilegym.kernel_cache import CachedKernel
from tilegym.ops.attention.kernels.dropout import dropout_of, dropped_cast, kept_gradient, kept_scaled
from tilegym.ops.attention.kernels.head import (
    add_head,
    head_dot,
    head_product,
    head_row_dot,
    head_scaled,
    head_width,
    head_zeros,
    load_head,
    store_head,
)
from tilegym.ops.attention.kernels.modifiers import (
    alibi_shifted_lse,
    head_mods,
    keeps_raw_scores,
    lifts_padded_rows,
    pre_cap_gradient,
    raw_gradient,
    scores,
    scores_log2,
    softcap_values,
)
from tilegym.ops.attention.kernels.packed import (
    Rows,
    bulk_dkdv_stores,
    bulk_once,
    has_no_rows,
    past_the_end,
    rows_of,
    sequence_rows,
    stat_first_tile,
    stat_rows_of,
    stat_rows_of_rows,
    zero_rows_around,
)
from tilegym.ops.attention.kernels.ranges import (
    key_columns,
    key_segments,
    over_segments,
    query_segments,
    tile_columns,
    visible,
)
from tilegym.ops.attention.kernels.scheduling import heaviest_first, query_program
from tilegym.ops.attention.kernels.state import (
    DqTile,
    HeadParts,
    HeadSplit,
    KeyState,
    KeyTile,
    QueryStep,
    RowStats,
    Scoring,
    Switches,
    Tiling,
)
from tilegym.ops.attention.kernels.tiles import (
    NEG_INF,
    POS_INF,
    ConstBool,
    ConstInt,
    accumulator_dtype,
    exp2,
    exp2_split_pipes,
    load_row_stat,
    log2e,
    scale,
    seqlens,
    sixteen_bits,
    store_row_stat,
)
from tilegym.ops.attention.kernels.user import (
    AUX_GRAD,
    MASK_MOD,
    SCORE_MOD,
    SCORE_MOD_GRAD,
    over_listed_tiles,
    tile_lists,
    user_args,
    user_args_with_grads,
    user_functions,
    user_score_gradient,
)
from tilegym.ops.attention.score_mods import BIAS_ONE_ROW, BIAS_PER_ROW
from tilegym.ops.attention.variants import DKDV_KEY, DKDV_VALUE


@ct.function
def _row_stats(
    out, d_out, value_split, Lse, Delta, LseBase2, b, q_head, q_tile, block_m: ConstInt, DLse, lse_grad: ConstBool,
    bulk: ConstBool,
):  # fmt: skip
    """RowStats of one query tile, stored in Delta and LseBase2 at its rows and returned as
    [block_m] tiles in fp32 (fp64 for fp64 inputs), the accumulators' dtype (bulk: as
    tiles.load_tile; a packed program stores them once, from slices)."""
    delta = _tile_delta(out, d_out, value_split, b, q_head, q_tile, block_m, DLse, lse_grad)
    store_row_stat(Delta, b, q_head, q_tile, delta, block_m, bulk)
    lse_base2 = _tile_lse_base2(Lse, b, q_head, q_tile, block_m)
    store_row_stat(LseBase2, b, q_head, q_tile, lse_base2, block_m, bulk)
    return RowStats(delta, lse_base2)


@ct.function
def _tile_delta(out, d_out, value_split, b, q_head, q_tile, block_m: ConstInt, DLse, lse_grad: ConstBool):
    """Delta of one query tile's rows. With lse_grad, Delta_i is sum_d Out_id dOut_id - dLse_i:
    the LSE's gradient adds dLse_i * P_ij to each score's gradient P_ij (dP_ij - Delta_i), since
    dLSE_i/ds_ij = P_ij."""
    delta = head_row_dot(out, d_out, value_split, accumulator_dtype(out.main.dtype))
    if lse_grad:
        delta = delta - load_row_stat(DLse, b, q_head, q_tile, block_m).astype(delta.dtype)
    return delta


@ct.function
def _tile_lse_base2(Lse, b, q_head, q_tile, block_m: ConstInt):
    """The base-2 LSE of one query tile's rows: +inf for a row that saw no key (LSE -inf), which
    makes its probabilities exp2(s - inf) = 0. Converting it here, once per row, keeps that
    select and multiply out of every step of the dK/dV loop."""
    lse = load_row_stat(Lse, b, q_head, q_tile, block_m)
    return ct.where(lse == NEG_INF, POS_INF, lse * log2e(lse.dtype))


@ct.function
def _scatter_row_stats(stats, Delta, LseBase2, CuSeqlens, search_steps, total, q_head, q_tile, block_m: ConstInt):
    """A packed batch's RowStats of one query tile of all its rows (a tile may hold rows of
    several sequences) stored at each row's place in the backward's row statistics
    (packed.stat_rows_of_rows)."""
    rows = q_tile * block_m + ct.arange(block_m, dtype=ct.int32)
    places = stat_rows_of_rows(CuSeqlens, rows, total, search_steps)
    inside = rows < total
    ct.scatter(Delta, (0, q_head, places), stats.delta.astype(Delta.dtype), mask=inside)
    ct.scatter(LseBase2, (0, q_head, places), stats.lse_base2.astype(LseBase2.dtype), mask=inside)


@ct.function
def _sink_gradient_share(stats, Sinks, DSinks, b, q_head, q_tile, seqlen_q, block_m: ConstInt):
    """Adds a query tile's share of dSink: -sum_i P_sink,i Delta_i with P_sink,i =
    exp(sink - LSE_i), into DSinks[b, q_head, q_tile], summed by the host in a fixed order. A row
    whose LSE is -inf has base-2 LSE +inf: P_sink 0. Rows past the sequence (seqlen_q rows) load
    Delta 0 and LSE 0 and are left out: a sink of 89 or more would make their P_sink inf, and
    inf * 0 NaN."""
    acc_dtype = stats.delta.dtype
    sink_log2 = ct.load(Sinks, index=(q_head,), shape=(1,)).astype(acc_dtype) * log2e(acc_dtype)
    rows = q_tile * block_m + ct.arange(block_m, dtype=ct.int32)
    shares = ct.where(rows < seqlen_q, exp2(sink_log2 - stats.lse_base2) * stats.delta, 0.0)
    share = -ct.sum(shares)
    ct.store(DSinks, index=(b, q_head, q_tile), tile=share.reshape((1, 1, 1)).astype(DSinks.dtype))


@CachedKernel
def attention_backward_preprocess_kernel(
    Out, dOut, Lse, Delta, LseBase2, DLse, Sinks, DSinks, CuSeqlensQ, max_seqlen_q: int, block_m: ConstInt,
    block_dv: ConstInt, lse_grad: ConstBool, sinks_grad: ConstBool, varlen: ConstBool,
    stats_by_sequence: ConstBool, search_steps: int,
):  # fmt: skip
    """The row statistics (_row_stats) for the fused backward, whose dK/dV programs each need
    those of every query tile. The two-kernel backward's dQ kernel writes them instead. With
    lse_grad and sinks_grad, and packed (varlen), as the dQ kernel.
    stats_by_sequence: a packed batch run as one dense batch entry of all its rows (varlen off:
    a row's statistics do not depend on its sequence), whose statistics go to the backward's
    layout of them (packed.stat_rows), found from CuSeqlensQ in search_steps halvings."""
    q_tile = ct.bid(0)
    q_head = ct.bid(1)
    b = ct.bid(2)
    seq = b  # the batch entry or, packed, the sequence: DSinks' row
    if varlen:
        q_rows = sequence_rows(CuSeqlensQ, seq, Out, max_seqlen_q)
        if past_the_end(q_tile * block_m, q_rows):
            return
        Out, dOut, Lse = rows_of(Out, q_rows), rows_of(dOut, q_rows), rows_of(Lse, q_rows)
        Delta, LseBase2 = stat_rows_of(Delta, seq, q_rows), stat_rows_of(LseBase2, seq, q_rows)
        if lse_grad:
            DLse = rows_of(DLse, q_rows)
        b = 0
    # A row reduction, memory bound: one tile of Dv padded to a power of two. Packed, each tile
    # is loaded without a bulk copy, whose descriptor of the slice would cost a round trip.
    value_split = HeadSplit(block_dv, 0)
    out = load_head(Out, b, q_head, q_tile, block_m, value_split, not varlen)
    d_out = load_head(dOut, b, q_head, q_tile, block_m, value_split, not varlen)
    if stats_by_sequence:
        delta = _tile_delta(out, d_out, value_split, b, q_head, q_tile, block_m, DLse, lse_grad)
        stats = RowStats(delta, _tile_lse_base2(Lse, b, q_head, q_tile, block_m))
        total = ct.astype(Out.shape[2], ct.int32)
        _scatter_row_stats(stats, Delta, LseBase2, CuSeqlensQ, search_steps, total, q_head, q_tile, block_m)
    else:
        stats = _row_stats(
            out, d_out, value_split, Lse, Delta, LseBase2, b, q_head, q_tile, block_m, DLse, lse_grad, not varlen
        )
    if sinks_grad:
        _sink_gradient_share(stats, Sinks, DSinks, seq, q_head, q_tile, ct.astype(Out.shape[2], ct.int32), block_m)


@ct.function
def _holds_dq_share(qk_split):
    """Whether the fused backward holds a step's dQ share until the next step, which sums it
    after its first matmul, so the reduction overlaps that step's matmuls instead of stalling
    between steps. Measured on sm_90 (perf-notes#dq-share-next-step): 9-15% faster at D=128 from 4096
    keys (even at 16384 keys without a mask); at D=64 (128x128 tiles) up to 6% slower."""
    return head_width(qk_split) > 64


@ct.function
def _exp2_split(sum_dkdv, switches, tiling, dtype):
    """Whether unmasked steps compute half of P on the FMA pipe (tiles.exp2_split_pipes): the
    grouped fused backward (causal GQA) at D=64, 16-bit, without a score function, softcap or
    ALiBi. On its 64x128 tiles that took 6% off the backward; on the ungrouped 128x128 ones a
    half was 1-6% slower, a quarter within the spread, and with ALiBi the kernel spilled
    (perf-notes#grouped-exp2-split)."""
    plain_scores = keeps_raw_scores(switches) and not switches.alibi
    return sum_dkdv and sixteen_bits(dtype) and plain_scores and head_width(tiling.qk) == 64 and tiling.block_m == 64


@ct.function
def _dkdv_step(tile, q_tile, state, masked: ConstBool):
    """Adds one query tile's contribution to a key tile's dK and dV (KeyTile, KeyState).

    With bias_grad, also writes the tile's dBias (BIAS_PER_ROW) or adds its column sums to
    d_bias_row (BIAS_ONE_ROW). With sum_dq, also adds this key tile's share of dQ (scaled)
    into the fp32 DQSum, a whole tile at a time (a TMA reduction on sm_90); see
    _holds_dq_share for the pending share. A program of one part sums only dV (no dP, no dS)
    or only dK (tile.sums_dv, tile.sums_dk).
    """
    scoring = tile.scoring
    tiling = scoring.tiling
    block_m, block_n = tiling.block_m, tiling.block_n
    b, q_head, k = tile.b, tile.q_head, tile.k
    d_value = state.d_value
    acc_dtype = accumulator_dtype(k.main.dtype)
    q = load_head(tile.Q, b, q_head, q_tile, block_m, tiling.qk)  # [block_m, D]
    d_out = load_head(tile.dOut, b, q_head, q_tile, block_m, tiling.value)  # [block_m, Dv]
    sums_dv, sums_dk = tile.sums_dv, tile.sums_dk
    rows = q_tile * block_m + ct.arange(block_m, dtype=ct.int32)[None, :]  # [1, block_m]
    lse = load_row_stat(tile.LseBase2, b, q_head, tile.stat_tile + q_tile, block_m)[None, :]  # [1, block_m]
    if lifts_padded_rows(scoring.switches):
        # Rows past the sequence (Q zero there) load LSE 0, and a score function or a one-row
        # bias may score them above 128 in base 2: exp2 would give inf, and inf * dOut's zero
        # rows NaN in dV. An LSE of +inf gives them probability 0 whatever their scores.
        lse = ct.where(rows < scoring.seqlens.q, lse, POS_INF)
    lse = alibi_shifted_lse(lse, q_tile, tile.kv_tile, scoring, k.main.dtype, True)
    delta = 0.0
    if sums_dk:
        delta = load_row_stat(tile.Delta, b, q_head, tile.stat_tile + q_tile, block_m)[None, :]  # [1, block_m]

    raw_t = head_dot(k, q, ct.zeros((block_n, block_m), acc_dtype), tiling.qk)  # [block_n, block_m]
    if tile.sum_dq:
        if _holds_dq_share(tiling.qk):
            # The previous step's share, summed while this step's matmuls run.
            add_head(tile.DQSum, b, q_head, state.pending_tile, state.pending_dq, block_m, tiling.qk)
    scores_t, capped_tanh_t, natural_t = scores(
        raw_t, rows, tile.cols, q_tile, tile.kv_tile, k.main.dtype, scoring, True
    )
    if head_width(tiling.qk) > 64 and not tile.sum_dq:
        # The D=128 dK/dV kernel runs two CTAs per SM, where the flushed exp2's schedule spills
        # and gained nothing (perf-notes#leaner-softmax-exp2); the fused kernel, at one CTA per SM,
        # gains 1-3% from it (perf-notes#fused-backward-exp2-d128).
        probs_t = ct.exp2(scores_log2(scores_t, scoring) - lse)  # [block_n, block_m]
    elif tile.exp2_split and not masked:
        probs_t = exp2_split_pipes(scores_log2(scores_t, scoring) - lse)
    else:
        probs_t = exp2(scores_log2(scores_t, scoring) - lse)
    if masked:
        probs_t = ct.where(visible(rows, tile.cols, scoring), probs_t, 0.0)
    # See the second load of Q below; masked steps (few) keep one load: with two, the causal
    # kernel spilled a register.
    reload_q = tile.sum_dq and not masked
    # dV's operand. With dropout it is made here even where dV comes later or not at all: dP's
    # mask is read back from it (kept_gradient).
    probs_v_t = 0
    if (sums_dv and not reload_q) or scoring.dropout.on:
        probs_v_t = dropped_cast(probs_t, scoring.dropout, rows, tile.cols, d_out.main.dtype)
    if sums_dv and not reload_q:
        d_value = head_product(probs_v_t, d_out, d_value, tiling.value)  # [block_n, Dv]
    state = KeyState(state.d_key, d_value, state.d_bias_row, state.pending_dq, q_tile)
    if sums_dk:
        step = QueryStep(q_tile, q, d_out, delta, rows, scores_t, capped_tanh_t, natural_t, probs_t, probs_v_t)
        state = _dk_share(tile, step, state, reload_q)
    return state


@ct.function
def _dk_share(tile, step, state, reload_q: ConstBool):
    """state plus _dkdv_step's part after P (QueryStep): dP, dS, dBias, dK, the dQ share, and
    dV where Q is loaded twice (reload_q)."""
    scoring = tile.scoring
    tiling = scoring.tiling
    block_m, block_n = tiling.block_m, tiling.block_n
    b, q_head, k = tile.b, tile.q_head, tile.k
    q_tile, q, d_out, rows, probs_t = step.q_tile, step.q, step.d_out, step.rows, step.probs
    d_key, d_value, d_bias_row, pending_dq = state.d_key, state.d_value, state.d_bias_row, state.pending_dq
    acc_dtype = probs_t.dtype
    d_probs_t = head_dot(tile.v, d_out, ct.zeros((block_n, block_m), acc_dtype), tiling.value)  # [block_n, block_m]
    d_probs_t = kept_gradient(d_probs_t, scoring.dropout, step.probs_v)
    d_scores_t = probs_t * (d_probs_t - step.delta)  # [block_n, block_m]
    # The bias's gradient is that of the scores it is added to: back through the caller's
    # score_mod, applied after it, and not through the softcap, applied before (raw_gradient).
    d_scores_t = user_score_gradient(d_scores_t, step.natural, step.scores, rows, tile.cols, scoring)
    if tile.bias_grad == BIAS_PER_ROW:
        d_bias = ct.transpose(d_scores_t).reshape((1, 1, block_m, block_n)).astype(tile.DBias.dtype)
        ct.store(tile.DBias, index=(b, q_head, q_tile, tile.kv_tile), tile=d_bias)
    elif tile.bias_grad == BIAS_ONE_ROW:
        d_bias_row = d_bias_row + ct.sum(d_scores_t, axis=1, keepdims=True)  # [block_n, 1]
    d_scores_t = pre_cap_gradient(d_scores_t, step.capped_tanh, scoring.switches.capped)
    d_scores_t = d_scores_t.astype(q.main.dtype)
    # Masked steps (few) keep dQ = dS K: with dQ^T their loops kept values in local memory.
    dq_key_major = reload_q and not _holds_dq_share(tiling.qk)  # reload_q: fused, unmasked
    if dq_key_major:
        _add_dq_share_key_major(tile, q_tile, d_scores_t)
    if reload_q:
        # The compiler gives each load one buffer, freed after its last use. Loaded once, Q
        # stays busy until dK, so the next step's Q could only be loaded while this step
        # computes dQ, and arrived late (at one CTA per SM nothing covers the wait). Loaded
        # again for dK, the first buffer is free after K Q^T. dK before dV in the source
        # keeps the two matmuls issued back to back (perf-notes#q-loaded-twice).
        q_again = load_head(tile.Q, b, q_head, q_tile, block_m, tiling.qk)
        d_key = head_product(d_scores_t, q_again, d_key, tiling.qk)
        if tile.sums_dv:
            probs_v_t = step.probs_v
            if not scoring.dropout.on:
                probs_v_t = probs_t.astype(d_out.main.dtype)  # cast here, as late as it is used
            d_value = head_product(probs_v_t, d_out, d_value, tiling.value)
    else:
        d_key = head_product(d_scores_t, q, d_key, tiling.qk)  # [block_n, D]
    if tile.sum_dq and not dq_key_major:
        # [block_m, D]
        d_query = head_product(ct.transpose(d_scores_t), k, head_zeros(block_m, tiling.qk, acc_dtype), tiling.qk)
        d_query = head_scaled(d_query, tile.dq_scale, tiling.qk)
        if _holds_dq_share(tiling.qk):
            pending_dq = d_query
        else:
            add_head(tile.DQSum, b, q_head, q_tile, d_query, block_m, tiling.qk)
    return KeyState(d_key, d_value, d_bias_row, pending_dq, q_tile)


@ct.function
def _add_dq_share_key_major(tile, q_tile, d_scores_t):
    """Adds a step's dQ share (scaled) into DQSum where it is not held for the next step (a head
    of one tile up to 64 wide). It is computed as dQ^T = K^T dS^T, from dS^T as the step holds it:
    dS^T goes to shared memory and both operands are read from there. Computed as dS K, the compiler
    also loaded dS back into registers, transposed, for the matmul (eight 16-byte loads and 64
    byte permutes per thread and step: 924 instructions per step against 794 at D=64,
    perf-notes#dq-transposed). Issued before dK and dV, the dV matmuls stay in one group."""
    tiling = tile.scoring.tiling
    width, block_m = tiling.qk.width, tiling.block_m
    k = tile.k.main  # [block_n, D]
    d_query_t = ct.mma(ct.transpose(k), d_scores_t, ct.zeros((width, block_m), accumulator_dtype(k.dtype)))
    d_query = ct.transpose(d_query_t * tile.dq_scale)  # [block_m, D]
    add_head(tile.DQSum, tile.b, tile.q_head, q_tile, HeadParts(d_query, 0), block_m, tiling.qk)


@ct.function
def _add_pending_dq(DQSum, b, q_head, state, block_m: ConstInt, qk_split, varlen: ConstBool):
    """Adds the share a program still holds after its last step (_holds_dq_share). A packed
    sequence may have no query rows, and a slice of none must never be written: its bulk-copy
    descriptor would be invalid (its program's loop ran no step, the share is zeros). The check
    is compiled only packed: dense programs keep their code (stored SASS fingerprints)."""
    if varlen:
        if DQSum.shape[2] > 0:
            add_head(DQSum, b, q_head, state.pending_tile, state.pending_dq, block_m, qk_split)
    else:
        add_head(DQSum, b, q_head, state.pending_tile, state.pending_dq, block_m, qk_split)


@ct.function
def _dkdv_loop(first, last, state, tile, masked: ConstBool):
    """state plus the contributions of query tiles [first, last)."""
    for q_tile in range(first, last):
        state = _dkdv_step(tile, q_tile, state, masked)
    return state


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
    block_dv: ConstInt,
    block_d_tail: ConstInt,
    block_dv_tail: ConstInt,
    causal: ConstBool,
    windowed: ConstBool,
    capped: ConstBool,
    bias_mode: ConstInt,
    alibi: ConstBool,
    bias_grad: ConstInt,
    sum_dq: ConstBool,
    sum_dkdv: ConstBool,
    part: ConstInt,
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
    AuxGrad0,
    AuxGrad1,
    AuxGrad2,
    AuxGrad3,
    DropoutSeed,
    dropout_threshold: int,
    dropout_scale: float,
    dropout_scale_lo: float,
    dropout: ConstBool,
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
    varlen: a packed batch (packed.py); with sum_dq, DQSum is [1, Hq, total_q padded, D] and each
    sequence adds into its own rows.
    The caller's functions (user.py) read Aux* and MaskAux*, and aux_grad adds into AuxGrad*
    (zeroed fp32 buffers; only this kernel calls it). block_sparse: the query tiles come from a
    block mask's lists (MaskCounts, MaskTiles: one row per key tile).
    part: DKDV_BOTH, or DKDV_VALUE or DKDV_KEY for a program that sums only dV or only dK (and
    dQ with sum_dq), holding one accumulator where both did not fit (wide heads): its launch
    writes that gradient alone.
    dropout: as the forward kernel (dropout.py), which dV's P and dS's dP follow.
    """
    if causal and sum_dq:
        # Causal key tiles near the start of the sequence are seen by the most query tiles.
        kv_tile, head, b = heaviest_first()
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
    seq = b  # the batch entry or, packed, the sequence: it picks ALiBi slopes
    stat_tile = 0  # LseBase2's and Delta's tile index of query tile 0
    if varlen:
        k_rows = sequence_rows(CuSeqlensK, seq, K, max_seqlen_k)
        q_rows = sequence_rows(CuSeqlensQ, seq, Q, max_seqlen_q)
        if not sum_dkdv:  # dK and dV themselves, not fp32 sums (zeroed, and cast whole)
            if kv_tile == 0:
                # Zeros in the rows outside every sequence and, where no query sees the
                # sequence's keys (its programs return below), in its own rows.
                written = k_rows.start
                if has_no_rows(q_rows):
                    written = k_rows.end
                gaps = Rows(written, k_rows.end)
                if part != DKDV_VALUE:
                    zero_rows_around(dK, CuSeqlensK, seq, kv_head, gaps, max_seqlen_k, HeadSplit(block_d, block_d_tail))
                if part != DKDV_KEY:
                    zero_rows_around(
                        dV, CuSeqlensK, seq, kv_head, gaps, max_seqlen_k, HeadSplit(block_dv, block_dv_tail)
                    )
        if past_the_end(kv_tile * block_n, k_rows):
            return
        if has_no_rows(q_rows):
            # No query sees these keys: their gradients are the zeros written above. Without
            # this return, a program with an aux gradient hung on the queries' empty slice
            # (perf-notes#packed-aux-gradients).
            return
        Q, dOut = rows_of(Q, q_rows), rows_of(dOut, q_rows)
        if sum_dq:
            # The statistics whole, from their first tile: slices would cost the fused backward's
            # programs (one CTA per SM) a descriptor's round trip each (packed.stat_first_tile).
            stat_tile = stat_first_tile(seq, q_rows, block_m)
        else:
            # At two CTAs per SM the other CTA covers those round trips, and the tile index's
            # register spilled the D=128 causal form.
            LseBase2, Delta = stat_rows_of(LseBase2, seq, q_rows), stat_rows_of(Delta, seq, q_rows)
        K, V, dK, dV = rows_of(K, k_rows), rows_of(V, k_rows), rows_of(dK, k_rows), rows_of(dV, k_rows)
        if sum_dq:
            # Each sequence's dQ sum is its own rows: a tile past the end adds nothing there.
            DQSum = rows_of(DQSum, q_rows)
        b = 0
    lengths = seqlens(Q, K)
    acc_dtype = accumulator_dtype(K.dtype)
    qk_scale_log2 = scale(qk_scale_log2, qk_scale_log2_lo, acc_dtype)
    softmax_scale = scale(softmax_scale, softmax_scale_lo, acc_dtype)
    softcap_in, softcap_log2 = softcap_values(softcap_in, softcap_in_lo, softcap, softcap_lo, acc_dtype)
    switches = Switches(
        windowed, capped, bias_mode, alibi, user_functions(SCORE_MOD, SCORE_MOD_GRAD, AUX_GRAD, MASK_MOD)
    )
    tiling = Tiling(block_m, block_n, HeadSplit(block_d, block_d_tail), HeadSplit(block_dv, block_dv_tail))

    # Bulk-copy loads also for a packed batch, whose dK/dV programs are long (packed.bulk_once).
    bulk_store = bulk_dkdv_stores(varlen, sum_dq, tiling)
    sums_dv = part != DKDV_KEY
    sums_dk = part != DKDV_VALUE
    if switches.user.aux_grad is not None:
        # A program whose query loops had no step hung when the kernel held an aux gradient's
        # atomic adds (a window or mask leaving key tiles unseen; perf-notes#unseen-key-tiles).
        # Such a tile returns at once, its gradients zeros.
        mods = head_mods(
            Bias, Slopes, seq, first_q_head, softcap_in, softcap_log2, window_left, window_right, acc_dtype, alibi
        )
        first_scoring = Scoring(qk_scale_log2, lengths, mods, switches, tiling, causal, 0, 0)
        if _seen_by_no_query(kv_tile, first_q_head, members, seq, first_scoring, MaskCounts, MaskTiles, block_sparse):
            nothing = ct.zeros((1, 1), acc_dtype)
            d_key_zeros = head_zeros(block_n, tiling.qk, acc_dtype) if sums_dk else nothing
            d_value_zeros = head_zeros(block_n, tiling.value, acc_dtype) if sums_dv else nothing
            _store_key_gradients(
                dK, dV, b, kv_head, kv_tile, d_key_zeros, d_value_zeros, tiling, sum_dkdv, sums_dk, sums_dv, bulk_store
            )
            if sums_dk and bias_grad == BIAS_ONE_ROW:
                for group_member in range(members):
                    d_bias = ct.zeros((1, 1, 1, block_n), DBias.dtype)
                    ct.store(DBias, index=(b, first_q_head + group_member, 0, kv_tile), tile=d_bias)
            return
    k = load_head(K, b, kv_head, kv_tile, block_n, tiling.qk)  # [block_n, D]
    cols = kv_tile * block_n + ct.arange(block_n, dtype=ct.int32)[:, None]  # [block_n, 1]
    # Placeholders where a part is not summed.
    v, d_key, d_value = 0, ct.zeros((1, 1), acc_dtype), ct.zeros((1, 1), acc_dtype)
    if sums_dk:
        v = load_head(V, b, kv_head, kv_tile, block_n, tiling.value)  # [block_n, Dv]
        d_key = head_zeros(block_n, tiling.qk, acc_dtype)
    if sums_dv:
        d_value = head_zeros(block_n, tiling.value, acc_dtype)
    holds_dq = sum_dq and _holds_dq_share(tiling.qk)

    for group_member in range(members):
        q_head = first_q_head + group_member
        mods = head_mods(
            Bias, Slopes, seq, q_head, softcap_in, softcap_log2, window_left, window_right, acc_dtype, alibi
        )
        user = user_args_with_grads(
            seq, q_head, Aux0, Aux1, Aux2, Aux3, MaskAux0, MaskAux1, MaskAux2, MaskAux3,
            (AuxGrad0, AuxGrad1, AuxGrad2, AuxGrad3),
        )  # fmt: skip
        drop = dropout_of(
            DropoutSeed, seq, q_head, dropout_threshold, dropout_scale, dropout_scale_lo, acc_dtype, dropout
        )
        scoring = Scoring(qk_scale_log2, lengths, mods, switches, tiling, causal, user, drop)
        # A held dQ share starts as zeros "for" query tile 0, which always exists: the first
        # step adds them there, so no step needs a branch (one spare reduction per head).
        pending_dq = head_zeros(block_m, tiling.qk, acc_dtype) if holds_dq else ct.zeros((1, 1), acc_dtype)
        state = KeyState(d_key, d_value, ct.zeros((block_n, 1), acc_dtype), pending_dq, 0)
        tile = KeyTile(
            k, v, Q, dOut, LseBase2, Delta, stat_tile, DBias, DQSum, softmax_scale, b, q_head, kv_tile, cols,
            scoring, bias_grad, sum_dq, sums_dv, sums_dk, _exp2_split(sum_dkdv, switches, tiling, K.dtype),
        )  # fmt: skip
        if block_sparse:
            lists = tile_lists(MaskCounts, MaskTiles, seq, q_head)
            state = over_listed_tiles(_dkdv_step, lists, kv_tile, state, tile)
        else:
            state = over_segments(_dkdv_loop, query_segments(kv_tile, scoring), state, tile)
        d_key, d_value = state.d_key, state.d_value
        if holds_dq:
            _add_pending_dq(DQSum, b, q_head, state, block_m, tiling.qk, varlen)
        if sums_dk and bias_grad == BIAS_ONE_ROW:
            d_bias = state.d_bias_row.reshape((1, 1, 1, block_n)).astype(DBias.dtype)
            ct.store(DBias, index=(b, q_head, 0, kv_tile), tile=d_bias)

    if sums_dk:
        d_key = head_scaled(d_key, softmax_scale, tiling.qk)
    _store_key_gradients(dK, dV, b, kv_head, kv_tile, d_key, d_value, tiling, sum_dkdv, sums_dk, sums_dv, bulk_store)


@ct.function
def _store_key_gradients(
    dK, dV, b, kv_head, kv_tile, d_key, d_value, tiling, sum_dkdv: ConstBool, sums_dk, sums_dv, bulk_store
):
    """Writes a key tile's dK and dV (those its program sums), or adds them into the fp32 sums
    of the fused grouped-query backward (sum_dkdv)."""
    block_n = tiling.block_n
    if sums_dk:
        if sum_dkdv:
            add_head(dK, b, kv_head, kv_tile, d_key, block_n, tiling.qk)
        else:
            store_head(dK, b, kv_head, kv_tile, d_key, block_n, tiling.qk, bulk_store)
    if sums_dv:
        if sum_dkdv:
            add_head(dV, b, kv_head, kv_tile, d_value, block_n, tiling.value)
        else:
            store_head(dV, b, kv_head, kv_tile, d_value, block_n, tiling.value, bulk_store)


@ct.function
def _seen_by_no_query(kv_tile, first_q_head, members, seq, scoring, MaskCounts, MaskTiles, block_sparse: ConstBool):
    """Whether no query tile of any of the program's query heads sees the key tile."""
    if block_sparse:
        steps = 0
        for group_member in range(members):
            lists = tile_lists(MaskCounts, MaskTiles, seq, first_q_head + group_member)
            # The counts of partly and fully visible tiles, each as a loaded one-element tile.
            # tileiras (cuda-tile 1.7) fails on the nearby forms: two gathers crash it on packed
            # batches (most dtypes), one (1, 1, 1, 2) tile reduced by ct.sum on 16-bit D=80-128 and 256.
            partial = ct.load(lists.counts, index=(lists.b, lists.h, kv_tile, 0), shape=(1, 1, 1, 1))
            full = ct.load(lists.counts, index=(lists.b, lists.h, kv_tile, 1), shape=(1, 1, 1, 1))
            steps = steps + ct.reshape(partial + full, ())
    else:
        segments = query_segments(kv_tile, scoring)
        steps = segments.end - segments.start
    return steps == 0


@ct.function
def _dq_step(tile, kv_tile, d_query, masked: ConstBool):
    """d_query plus one key tile's contribution (DqTile)."""
    scoring = tile.scoring
    tiling = scoring.tiling
    acc_dtype = accumulator_dtype(tile.q.main.dtype)
    k = load_head(tile.K, tile.b, tile.kv_head, kv_tile, tiling.block_n, tiling.qk)
    v = load_head(tile.V, tile.b, tile.kv_head, kv_tile, tiling.block_n, tiling.value)
    raw = head_dot(tile.q, k, ct.zeros((tiling.block_m, tiling.block_n), acc_dtype), tiling.qk)
    cols = key_columns(kv_tile, tiling.block_n, masked, scoring.switches)
    step_scores, capped_tanh, natural = scores(
        raw, tile.rows, cols, tile.q_tile, kv_tile, tile.q.main.dtype, scoring, False
    )
    probs = exp2(scores_log2(step_scores, scoring) - tile.lse)
    if masked:
        probs = ct.where(visible(tile.rows, cols, scoring), probs, 0.0)
    d_probs = head_dot(tile.d_out, v, ct.zeros((tiling.block_m, tiling.block_n), acc_dtype), tiling.value)
    d_probs = kept_scaled(d_probs, scoring.dropout, tile.rows, tile_columns(kv_tile, tiling.block_n))
    d_scores = raw_gradient(probs * (d_probs - tile.delta), capped_tanh, natural, step_scores, tile.rows, cols, scoring)
    return head_product(d_scores.astype(k.main.dtype), k, d_query, tiling.qk)


@ct.function
def _dq_loop(first, last, d_query, tile, masked: ConstBool):
    """d_query plus the contributions of key tiles [first, last)."""
    for kv_tile in range(first, last):
        d_query = _dq_step(tile, kv_tile, d_query, masked)
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
    DLse,
    Sinks,
    DSinks,
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
    block_dv: ConstInt,
    block_d_tail: ConstInt,
    block_dv_tail: ConstInt,
    causal: ConstBool,
    windowed: ConstBool,
    capped: ConstBool,
    bias_mode: ConstInt,
    alibi: ConstBool,
    lse_grad: ConstBool,
    sinks_grad: ConstBool,
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
    """dQ of one query tile, looping over the key tiles it sees; first the tile's row statistics
    (_row_stats), which the dK/dV kernel launched after it reads: no preprocess kernel, and Out
    costs a load of one tile per program instead of a pass of its own over Out and dOut.
    lse_grad: DLse, the LSE's gradient, folds into Delta. sinks_grad: the tile's share of the
    sinks' gradient goes to DSinks [B, Hq, query tiles]. Unused arrays are placeholders.
    varlen: a packed batch (packed.py); grid axis 2 counts its sequences, DSinks' axis 0 too.
    The caller's functions, block_sparse and dropout: as the forward kernel."""
    q_tile, q_head, b, kv_head = query_program(query_group_size, causal)
    seq = b  # the batch entry or, packed, the sequence: it picks ALiBi slopes and DSinks' row
    if varlen:
        q_rows = sequence_rows(CuSeqlensQ, seq, Q, max_seqlen_q)
        if q_tile == 0:
            zero_rows_around(dQ, CuSeqlensQ, seq, q_head, q_rows, max_seqlen_q, HeadSplit(block_d, block_d_tail))
        if past_the_end(q_tile * block_m, q_rows):
            return
        k_rows = sequence_rows(CuSeqlensK, seq, K, max_seqlen_k)
        Q, dOut, Out, Lse = rows_of(Q, q_rows), rows_of(dOut, q_rows), rows_of(Out, q_rows), rows_of(Lse, q_rows)
        LseBase2, Delta = stat_rows_of(LseBase2, seq, q_rows), stat_rows_of(Delta, seq, q_rows)
        dQ = rows_of(dQ, q_rows)
        if lse_grad:
            DLse = rows_of(DLse, q_rows)
        K, V = rows_of(K, k_rows), rows_of(V, k_rows)
        b = 0
    lengths = seqlens(Q, K)
    acc_dtype = accumulator_dtype(Q.dtype)
    qk_scale_log2 = scale(qk_scale_log2, qk_scale_log2_lo, acc_dtype)
    softmax_scale = scale(softmax_scale, softmax_scale_lo, acc_dtype)
    switches = Switches(
        windowed, capped, bias_mode, alibi, user_functions(SCORE_MOD, SCORE_MOD_GRAD, AUX_GRAD, MASK_MOD)
    )
    softcap_in, softcap_log2 = softcap_values(softcap_in, softcap_in_lo, softcap, softcap_lo, acc_dtype)
    mods = head_mods(Bias, Slopes, seq, q_head, softcap_in, softcap_log2, window_left, window_right, acc_dtype, alibi)
    user = user_args(seq, q_head, Aux0, Aux1, Aux2, Aux3, MaskAux0, MaskAux1, MaskAux2, MaskAux3)
    tiling = Tiling(block_m, block_n, HeadSplit(block_d, block_d_tail), HeadSplit(block_dv, block_dv_tail))
    drop = dropout_of(DropoutSeed, seq, q_head, dropout_threshold, dropout_scale, dropout_scale_lo, acc_dtype, dropout)
    scoring = Scoring(qk_scale_log2, lengths, mods, switches, tiling, causal, user, drop)

    # A packed batch's program loads these and stores dQ once: no bulk copies (tiles.load_tile).
    bulk = bulk_once(varlen, scoring.tiling)
    q = load_head(Q, b, q_head, q_tile, block_m, tiling.qk, bulk)
    d_out = load_head(dOut, b, q_head, q_tile, block_m, tiling.value, bulk)
    out = load_head(Out, b, q_head, q_tile, block_m, tiling.value, bulk)
    stats = _row_stats(out, d_out, tiling.value, Lse, Delta, LseBase2, b, q_head, q_tile, block_m, DLse, lse_grad, bulk)
    if sinks_grad:
        _sink_gradient_share(stats, Sinks, DSinks, seq, q_head, q_tile, lengths.q, block_m)
    rows = q_tile * block_m + ct.arange(block_m, dtype=ct.int32)[:, None]
    d_query = head_zeros(block_m, tiling.qk, acc_dtype)

    lse = alibi_shifted_lse(stats.lse_base2[:, None], q_tile, 0, scoring, Q.dtype, False)
    tile = DqTile(q, d_out, lse, stats.delta[:, None], K, V, b, kv_head, q_tile, rows, scoring)
    if block_sparse:
        d_query = over_listed_tiles(_dq_step, tile_lists(MaskCounts, MaskTiles, seq, q_head), q_tile, d_query, tile)
    else:
        d_query = over_segments(_dq_loop, key_segments(q_tile, scoring), d_query, tile)
    d_query = head_scaled(d_query, softmax_scale, tiling.qk)
    store_head(dQ, b, q_head, q_tile, d_query, block_m, tiling.qk, bulk)

"""The score modifiers in device code: bias, softcap and ALiBi applied to raw products q.k,
and the softcap's gradient. Which are on is compile-time (state.Switches); with all off, each
kernel compiles to the code it had without them. Window masks are in ranges.py.
"""

import cuda.tile as ct

from tilegym.ops.attention.kernels.state import HeadMods
from tilegym.ops.attention.kernels.tiles import ZERO_PAD, ConstBool, ConstInt, log2e, scale, sixteen_bits
from tilegym.ops.attention.kernels.user import score_modified, user_score_gradient, user_scored
from tilegym.ops.attention.score_mods import BIAS_NONE, BIAS_ONE_ROW


@ct.function
def head_mods(
    Bias, Slopes, b, q_head, softcap_in, softcap_log2, window_left, window_right, acc_dtype, alibi: ConstBool
):
    """HeadMods of one (batch, query head). A bias dimension of size 1 is shared by every batch
    or head: its index is clamped to 0."""
    bias_b = min(b, Bias.shape[0] - 1)
    bias_h = min(q_head, Bias.shape[1] - 1)
    slope_log2 = 0.0
    if alibi:
        slope = ct.load(Slopes, index=(min(b, Slopes.shape[0] - 1), q_head), shape=(1, 1))
        slope_log2 = slope.astype(acc_dtype) * log2e(acc_dtype)
    return HeadMods(Bias, bias_b, bias_h, slope_log2, softcap_in, softcap_log2, window_left, window_right)


@ct.function
def softcap_values(softcap_in, softcap_in_lo, softcap, softcap_lo, acc_dtype):
    """(scale / softcap, softcap * log2(e)) in the accumulator dtype, from their split arguments."""
    return scale(softcap_in, softcap_in_lo, acc_dtype), scale(softcap, softcap_lo, acc_dtype) * log2e(acc_dtype)


@ct.function
def keeps_raw_scores(switches):
    """Whether the forward keeps raw products q.k (ALiBi in their units) and their running max,
    scaling inside exp2.

    True for plain attention and ALiBi alone (masks aside), whose launcher makes the scale
    positive, so the largest product is the largest score (score_mods.ScoreMods.keeps_raw_scores).
    """
    plain = not switches.capped and switches.bias_mode == BIAS_NONE
    return plain and switches.user.score_mod is None


@ct.function
def keeps_scaled_scores(switches):
    """Whether the forward keeps scores that exp2's argument scales to base 2 (kept_to_log2):
    raw products (keeps_raw_scores) or a score function's natural-unit output."""
    return keeps_raw_scores(switches) or score_modified(switches)


@ct.function
def kept_to_log2(scoring, dtype):
    """The factor that turns the forward's kept scores (keeps_scaled_scores) into base 2."""
    if keeps_raw_scores(scoring.switches):
        result = scoring.qk_scale_log2
    else:
        result = log2e(dtype)
    return result


@ct.function
def scores_log2(step_scores, scoring):
    """scores() in base 2 for exp2's argument: natural-unit scores times log2(e), a multiply
    that the subtraction after it fuses into one multiply-add per score (converted ahead, the
    backward paid a multiply per score more, and another to give score_mod_grad its output)."""
    if score_modified(scoring.switches):
        result = step_scores * log2e(step_scores.dtype)
    else:
        result = step_scores
    return result


@ct.function
def lifts_padded_rows(switches):
    """Whether a query row past the sequence (Q loaded as zeros) may score far above 0: a
    caller's score function or a one-row bias can; the built-in softcap and ALiBi cannot."""
    return score_modified(switches) or switches.bias_mode == BIAS_ONE_ROW


@ct.function
def raw_scores(raw, q_tile, kv_tile, scoring, input_dtype):
    """Raw products q.k, minus ALiBi's slope / scale * distance where it is on: scores in raw
    units for a forward that keeps them (keeps_raw_scores), which saves a multiply per score.
    Shifted ALiBi (alibi_shifted) adds its per-key part alone."""
    if scoring.switches.alibi:
        raw_slope = scoring.mods.slope_log2 / scoring.qk_scale_log2
        if alibi_shifted(scoring, input_dtype):
            return _alibi_key_terms(raw_slope, q_tile, kv_tile, scoring, False, raw.dtype) + raw
        return (-raw_slope) * _alibi_distances(q_tile, kv_tile, scoring, False, raw.dtype) + raw
    return raw


@ct.function
def alibi_shifted(scoring, input_dtype):
    """Whether ALiBi's term -slope * (i + d - j), d = Sk - Sq, is split in two: a per-key part,
    slope * key_offset_j, added to each score, and a per-query part, -slope * query_offset_i,
    left to the row statistics (key_offset_j - query_offset_i = j - i - d). It costs an add
    per score instead of a distance and a fused multiply-add, and the backward folds the
    per-query part into the LSE it subtracts anyway (perf-notes#alibi-shifted).

    Causal only, where every visible pair has j <= i + d, so the distance needs no abs (a
    window or a full mask keeps the distance). Not with a score function, which sees true
    scores. 16-bit inputs only: a shifted score carries slope * query_offset_i (up to slope /
    scale * block_m), whose rounding adds some 1e-5 to the LSE; float32 and float64 inputs keep
    the exact distance. Offsets count from the tile's own diagonal (forward, dQ) or key tile
    (dK/dV), so far pairs, whose scores vanish, carry the large numbers."""
    switches = scoring.switches
    return switches.alibi and scoring.causal and switches.user.score_mod is None and sixteen_bits(input_dtype)


@ct.function
def _alibi_key_terms(slope, q_tile, kv_tile, scoring, transposed: ConstBool, dtype):
    """slope * key_offset_j of shifted ALiBi: key_offset_j is j - (q0 + d), q0 the query tile's
    first row ([1, block_n]), or j - j0, j0 the key tile's first key ([block_n, 1]) when
    transposed. slope * (j - j_first) is the same for every tile (computed once), so a tile
    costs one add per column."""
    tiling, lengths = scoring.tiling, scoring.seqlens
    if transposed:
        return slope * ct.arange(tiling.block_n, dtype=dtype)[:, None]
    first = kv_tile * tiling.block_n - (q_tile * tiling.block_m + (lengths.k - lengths.q))
    return slope * ct.arange(tiling.block_n, dtype=dtype)[None, :] + slope * ct.astype(first, dtype)


@ct.function
def alibi_query_offsets(q_tile, kv_tile, scoring, transposed: ConstBool, dtype):
    """query_offset_i of shifted ALiBi as floats, which the row statistics take: i - q0
    ([block_m, 1]), or i + d - j0 ([1, block_m]) when transposed (alibi_shifted)."""
    tiling, lengths = scoring.tiling, scoring.seqlens
    if transposed:
        first = q_tile * tiling.block_m + (lengths.k - lengths.q) - kv_tile * tiling.block_n
        return _positions(first, tiling.block_m, False, dtype)
    return ct.arange(tiling.block_m, dtype=dtype)[:, None]


@ct.function
def alibi_shifted_lse(lse_log2, q_tile, kv_tile, scoring, input_dtype, transposed: ConstBool):
    """The base-2 LSE that shifted scores (alibi_shifted) subtract: exp2(shifted - result) is
    exp2(true score - lse_log2). lse_log2 itself where ALiBi is not shifted."""
    if alibi_shifted(scoring, input_dtype):
        offsets = alibi_query_offsets(q_tile, kv_tile, scoring, transposed, lse_log2.dtype)
        return scoring.mods.slope_log2 * offsets + lse_log2
    return lse_log2


@ct.function
def alibi_true_row_max(row_max, q_tile, scoring, input_dtype, raw_units: ConstBool):
    """A forward's row max of shifted scores (alibi_shifted) as the row max of true scores (raw
    units or base 2, as the loop kept them); row_max itself where ALiBi is not shifted."""
    if alibi_shifted(scoring, input_dtype):
        slope = scoring.mods.slope_log2
        if raw_units:
            slope = slope / scoring.qk_scale_log2
        return (-slope) * alibi_query_offsets(q_tile, 0, scoring, False, row_max.dtype) + row_max
    return row_max


@ct.function
def _bias_tile(mods, q_tile, kv_tile, block_m: ConstInt, block_n: ConstInt, bias_mode: ConstInt, transposed: ConstBool):
    """The bias under a [block_m, block_n] score tile ([block_n, block_m] when transposed)."""
    if bias_mode == BIAS_ONE_ROW:
        shape = (1, 1, 1, block_n)
        tile = ct.load(mods.bias, index=(mods.bias_b, mods.bias_h, 0, kv_tile), shape=shape, padding_mode=ZERO_PAD)
        tile = tile.reshape((1, block_n))
    else:
        shape = (1, 1, block_m, block_n)
        index = (mods.bias_b, mods.bias_h, q_tile, kv_tile)
        tile = ct.load(mods.bias, index=index, shape=shape, padding_mode=ZERO_PAD)
        tile = tile.reshape((block_m, block_n))
    if transposed:
        tile = ct.transpose(tile)
    return tile


@ct.function
def _positions(first, size: ConstInt, column: ConstBool, dtype):
    """first, first + 1, ... first + size - 1 as floats, a [size, 1] tile ([1, size] if not
    column): one conversion per tile and a constant tile."""
    offsets = ct.arange(size, dtype=dtype)
    if column:
        offsets = offsets[:, None]
    else:
        offsets = offsets[None, :]
    return ct.astype(first, dtype) + offsets


@ct.function
def _alibi_distances(q_tile, kv_tile, scoring, transposed: ConstBool, dtype):
    """|i + Sk - Sq - j| under a score tile, as floats. Positions convert per row and per column,
    not per score (a conversion costs as much as an exp2); differences are exact below 2^24."""
    tiling, lengths = scoring.tiling, scoring.seqlens
    first_query = q_tile * tiling.block_m + (lengths.k - lengths.q)
    if transposed:
        # The dK/dV kernel converts integer positions: with the float offsets kept in registers
        # instead, its 64x64 tiles at two CTAs per SM spilled one.
        queries = first_query + ct.arange(tiling.block_m, dtype=ct.int32)
        keys = kv_tile * tiling.block_n + ct.arange(tiling.block_n, dtype=ct.int32)
        return ct.abs(queries[None, :].astype(dtype) - keys[:, None].astype(dtype))
    query_positions = _positions(first_query, tiling.block_m, True, dtype)
    return ct.abs(query_positions - _positions(kv_tile * tiling.block_n, tiling.block_n, False, dtype))


@ct.function
def scores(raw, rows, cols, q_tile, kv_tile, input_dtype, scoring, transposed: ConstBool):
    """(scores, tanh of the softcap, the natural-unit input of the caller's score_mod) of raw
    products q.k, with the switched-on modifiers; the last two are 0 where unused. Scores are
    in base 2, or natural units with a score function (user.user_scored; scores_log2 converts).

    raw is [block_m, block_n], or [block_n, block_m] when transposed (the dK/dV kernel).
    In natural units: s = scale * q.k, then s = softcap * tanh(s / softcap), then
    s += bias - slope * |i + Sk - Sq - j|, then s = score_mod(s, ...). Plain attention is one
    multiply. Shifted ALiBi (alibi_shifted) adds its per-key part only: the caller's row
    statistics take the rest (alibi_shifted_lse, alibi_true_row_max).
    """
    mods, switches = scoring.mods, scoring.switches
    if switches.capped:
        if sixteen_bits(input_dtype):
            # The hardware tanh is good to 2^-11, below what 16-bit inputs carry.
            capped_tanh = ct.tanh(raw * mods.softcap_in, rounding_mode=ct.RoundingMode.APPROX)
        else:
            capped_tanh = ct.tanh(raw * mods.softcap_in)
        result = capped_tanh * mods.softcap_log2
    else:
        capped_tanh = raw
        result = raw * scoring.qk_scale_log2
    if switches.bias_mode != BIAS_NONE:
        tiling = scoring.tiling
        bias = _bias_tile(mods, q_tile, kv_tile, tiling.block_m, tiling.block_n, switches.bias_mode, transposed)
        result = result + bias.astype(raw.dtype) * log2e(raw.dtype)
    if alibi_shifted(scoring, input_dtype):
        result = _alibi_key_terms(mods.slope_log2, q_tile, kv_tile, scoring, transposed, raw.dtype) + result
    elif switches.alibi:
        result = (-mods.slope_log2) * _alibi_distances(q_tile, kv_tile, scoring, transposed, raw.dtype) + result
    builtin = switches.capped or switches.bias_mode != BIAS_NONE or switches.alibi
    result, natural = user_scored(result, raw, scoring, rows, cols, builtin)
    return result, capped_tanh, natural


@ct.function
def pre_cap_gradient(d_scores, capped_tanh, capped: ConstBool):
    """The gradient with respect to scale * q.k from the gradient with respect to the softcap's
    output."""
    if capped:
        return d_scores * (1.0 - capped_tanh * capped_tanh)
    return d_scores


@ct.function
def raw_gradient(d_scores, capped_tanh, natural, step_scores, rows, cols, scoring):
    """The gradient with respect to scale * q.k from that with respect to the final scores
    (d_scores, natural units; step_scores the scores themselves, as scores() gave them): back
    through the caller's score_mod, then the softcap (bias and ALiBi add, which passes the
    gradient unchanged)."""
    d_scores = user_score_gradient(d_scores, natural, step_scores, rows, cols, scoring)
    return pre_cap_gradient(d_scores, capped_tanh, scoring.switches.capped)

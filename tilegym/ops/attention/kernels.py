"""cuTile kernels of fused multi-head attention: forward, forward with LSE and backward.

Pure device code. Host logic (validation, allocation, grids, tuning) lives in launch.py.

Layout: q, out, d_out [B, Hq, Sq, D]; k, v [B, Hkv, Sk, D]; lse, delta [B, Hq, Sq].
Every kernel is launched on a 3-D grid (sequence tile, head, batch). Tiles are loaded with
zero padding, so sequence lengths and head dims need not be multiples of a tile, and
stores past the end of an array are dropped: nothing outside the tensors is touched.

Causal masking is bottom-right aligned: query i sees key j iff j <= i + (Sk - Sq).
Scores are kept in base 2 (scaled by softmax_scale * log2(e)) so exp2 does the softmax.
"""

import cuda.tile as ct

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
def _query_program(query_group_size, causal: ConstBool):
    """(query tile, query head, batch, K/V head) of a program on a (query tiles, heads, batch) grid."""
    q_tile = ct.bid(0)
    if causal:
        # Causal tiles near the end of the sequence do the most work: start them first.
        q_tile = ct.num_blocks(0) - 1 - q_tile
    q_head = ct.bid(1)
    return q_tile, q_head, ct.bid(2), q_head // query_group_size


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
def _visible(rows, cols, seqlen_q, seqlen_k, causal: ConstBool):
    """Which (query, key) pairs a row attends to; rows and cols broadcast against each other."""
    inside = cols < seqlen_k
    if causal:
        inside = inside & (cols <= rows + (seqlen_k - seqlen_q))
    return inside


@ct.function
def _forward_step(
    q,
    K,
    V,
    b,
    kv_head,
    kv_tile,
    row_max,
    row_sum,
    acc,
    rows,
    qk_scale_log2,
    seqlen_q,
    seqlen_k,
    block_m: ConstInt,
    block_n: ConstInt,
    block_d: ConstInt,
    causal: ConstBool,
    masked: ConstBool,
):
    """One online-softmax update of a query tile with one key/value tile."""
    acc_dtype = _accumulator_dtype(q.dtype)
    k = _load_rows(K, b, kv_head, kv_tile, block_n, block_d)
    scores = ct.mma(q, ct.transpose(k), ct.zeros((block_m, block_n), acc_dtype)) * qk_scale_log2
    if masked:
        cols = kv_tile * block_n + ct.arange(block_n, dtype=ct.int32)[None, :]
        scores = ct.where(_visible(rows, cols, seqlen_q, seqlen_k, causal), scores, NEG_INF)
    new_max = ct.maximum(row_max, ct.max(scores, axis=1, keepdims=True))
    if masked:
        # A row that has seen no key yet keeps max -inf; subtract 0 instead to avoid inf - inf.
        new_max_safe = ct.where(new_max == NEG_INF, 0.0, new_max)
    else:
        new_max_safe = new_max
    probs = ct.exp2(scores - new_max_safe)
    rescale = ct.exp2(row_max - new_max_safe)
    row_sum = row_sum * rescale + ct.sum(probs, axis=1, keepdims=True)
    v = _load_rows(V, b, kv_head, kv_tile, block_n, block_d)
    acc = ct.mma(probs.astype(v.dtype), v, acc * rescale)
    return new_max, row_sum, acc


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
    block_m: ConstInt,
    block_n: ConstInt,
    block_d: ConstInt,
    causal: ConstBool,
    write_lse: ConstBool,
):
    q_tile, q_head, b, kv_head = _query_program(query_group_size, causal)
    seqlen_q = Q.shape[2]
    seqlen_k = K.shape[2]
    acc_dtype = _accumulator_dtype(Q.dtype)
    qk_scale_log2 = _scale(qk_scale_log2, qk_scale_log2_lo, acc_dtype)

    q = _load_rows(Q, b, q_head, q_tile, block_m, block_d)
    rows = q_tile * block_m + ct.arange(block_m, dtype=ct.int32)[:, None]
    row_max = ct.full((block_m, 1), NEG_INF, acc_dtype)
    row_sum = ct.zeros((block_m, 1), acc_dtype)
    acc = ct.zeros((block_m, block_d), acc_dtype)

    num_full, num_end = _causal_key_tiles(q_tile, seqlen_q, seqlen_k, block_m, block_n, causal)
    for kv_tile in range(num_full):
        row_max, row_sum, acc = _forward_step(
            q, K, V, b, kv_head, kv_tile, row_max, row_sum, acc, rows, qk_scale_log2,
            seqlen_q, seqlen_k, block_m, block_n, block_d, causal, False,
        )  # fmt: skip
    for kv_tile in range(num_full, num_end):
        row_max, row_sum, acc = _forward_step(
            q, K, V, b, kv_head, kv_tile, row_max, row_sum, acc, rows, qk_scale_log2,
            seqlen_q, seqlen_k, block_m, block_n, block_d, causal, True,
        )  # fmt: skip

    # Rows that saw no key (causal with Sq > Sk) have row_sum 0: output 0, LSE -inf.
    out = acc / ct.where(row_sum == 0.0, 1.0, row_sum)
    _store_rows(Out, b, q_head, q_tile, out, block_m, block_d)
    if write_lse:
        lse = (row_max + ct.log2(row_sum)) * _ln2(acc_dtype)
        ct.store(Lse, index=(b, q_head, q_tile), tile=lse.reshape((1, 1, block_m)).astype(Lse.dtype))


@ct.kernel
def attention_forward_kernel(
    Q,
    K,
    V,
    Out,
    qk_scale_log2: float,
    qk_scale_log2_lo: float,
    query_group_size: int,
    block_m: ConstInt,
    block_n: ConstInt,
    block_d: ConstInt,
    causal: ConstBool,
):
    """Inference forward: out = softmax(q k^T * scale) v, no LSE written."""
    _forward_tile(
        Q, K, V, Out, Out, qk_scale_log2, qk_scale_log2_lo, query_group_size, block_m, block_n, block_d, causal, False
    )


@ct.kernel
def attention_forward_lse_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    qk_scale_log2: float,
    qk_scale_log2_lo: float,
    query_group_size: int,
    block_m: ConstInt,
    block_n: ConstInt,
    block_d: ConstInt,
    causal: ConstBool,
):
    """Training forward: also writes lse = log(sum_j exp(score_ij)), the backward's statistic."""
    _forward_tile(
        Q, K, V, Out, Lse, qk_scale_log2, qk_scale_log2_lo, query_group_size, block_m, block_n, block_d, causal, True
    )


@ct.kernel
def attention_backward_preprocess_kernel(Out, dOut, Delta, block_m: ConstInt, block_d: ConstInt):
    """Delta_i = sum_d Out_id * dOut_id, in fp32 (fp64 for fp64 inputs)."""
    q_tile = ct.bid(0)
    q_head = ct.bid(1)
    b = ct.bid(2)
    acc_dtype = _accumulator_dtype(Out.dtype)
    out = _load_rows(Out, b, q_head, q_tile, block_m, block_d).astype(acc_dtype)
    d_out = _load_rows(dOut, b, q_head, q_tile, block_m, block_d).astype(acc_dtype)
    delta = ct.sum(out * d_out, axis=1)
    ct.store(Delta, index=(b, q_head, q_tile), tile=delta.reshape((1, 1, block_m)).astype(Delta.dtype))


@ct.function
def _base2_lse(Lse, b, q_head, q_tile, block_m: ConstInt):
    # A row that saw no key has LSE -inf; +inf makes its probabilities exp2(s - inf) = 0.
    lse = _load_row_stat(Lse, b, q_head, q_tile, block_m)
    return ct.where(lse == NEG_INF, POS_INF, lse * _log2e(lse.dtype))


@ct.function
def _dkdv_step(
    k,
    v,
    Q,
    dOut,
    Lse,
    Delta,
    b,
    q_head,
    q_tile,
    d_key,
    d_value,
    cols,
    qk_scale_log2,
    seqlen_q,
    seqlen_k,
    block_m: ConstInt,
    block_n: ConstInt,
    block_d: ConstInt,
    causal: ConstBool,
    masked: ConstBool,
):
    """Adds one query tile's contribution to a key tile's dK and dV (in key-major form)."""
    acc_dtype = _accumulator_dtype(k.dtype)
    q = _load_rows(Q, b, q_head, q_tile, block_m, block_d)
    d_out = _load_rows(dOut, b, q_head, q_tile, block_m, block_d)
    lse = _base2_lse(Lse, b, q_head, q_tile, block_m)[None, :]
    delta = _load_row_stat(Delta, b, q_head, q_tile, block_m)[None, :]

    scores_t = ct.mma(k, ct.transpose(q), ct.zeros((block_n, block_m), acc_dtype)) * qk_scale_log2
    probs_t = ct.exp2(scores_t - lse)
    if masked:
        rows = q_tile * block_m + ct.arange(block_m, dtype=ct.int32)[None, :]
        probs_t = ct.where(_visible(rows, cols, seqlen_q, seqlen_k, causal), probs_t, 0.0)
    d_value = ct.mma(probs_t.astype(d_out.dtype), d_out, d_value)
    d_probs_t = ct.mma(v, ct.transpose(d_out), ct.zeros((block_n, block_m), acc_dtype))
    d_scores_t = probs_t * (d_probs_t - delta)
    d_key = ct.mma(d_scores_t.astype(q.dtype), q, d_key)
    return d_key, d_value


@ct.kernel
def attention_backward_dkdv_kernel(
    Q,
    K,
    V,
    dOut,
    Lse,
    Delta,
    dK,
    dV,
    softmax_scale: float,
    softmax_scale_lo: float,
    qk_scale_log2: float,
    qk_scale_log2_lo: float,
    query_group_size: int,
    block_m: ConstInt,
    block_n: ConstInt,
    block_d: ConstInt,
    causal: ConstBool,
):
    """dK and dV of one key tile of one KV head.

    Loops over every query head of the GQA group and every query tile that sees the key
    tile, so the group's sum happens in registers: no atomics, deterministic.
    """
    kv_tile = ct.bid(0)
    kv_head = ct.bid(1)
    b = ct.bid(2)
    seqlen_q = Q.shape[2]
    seqlen_k = K.shape[2]
    acc_dtype = _accumulator_dtype(K.dtype)
    qk_scale_log2 = _scale(qk_scale_log2, qk_scale_log2_lo, acc_dtype)
    softmax_scale = _scale(softmax_scale, softmax_scale_lo, acc_dtype)

    k = _load_rows(K, b, kv_head, kv_tile, block_n, block_d)
    v = _load_rows(V, b, kv_head, kv_tile, block_n, block_d)
    cols = kv_tile * block_n + ct.arange(block_n, dtype=ct.int32)[:, None]
    d_key = ct.zeros((block_n, block_d), acc_dtype)
    d_value = ct.zeros((block_n, block_d), acc_dtype)

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

    for group_member in range(query_group_size):
        q_head = kv_head * query_group_size + group_member
        for q_tile in range(masked_start, full_start):
            d_key, d_value = _dkdv_step(
                k, v, Q, dOut, Lse, Delta, b, q_head, q_tile, d_key, d_value, cols, qk_scale_log2,
                seqlen_q, seqlen_k, block_m, block_n, block_d, causal, True,
            )  # fmt: skip
        for q_tile in range(full_start, num_q_tiles):
            d_key, d_value = _dkdv_step(
                k, v, Q, dOut, Lse, Delta, b, q_head, q_tile, d_key, d_value, cols, qk_scale_log2,
                seqlen_q, seqlen_k, block_m, block_n, block_d, causal, False,
            )  # fmt: skip

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
    kv_tile,
    d_query,
    rows,
    qk_scale_log2,
    seqlen_q,
    seqlen_k,
    block_m: ConstInt,
    block_n: ConstInt,
    block_d: ConstInt,
    causal: ConstBool,
    masked: ConstBool,
):
    acc_dtype = _accumulator_dtype(q.dtype)
    k = _load_rows(K, b, kv_head, kv_tile, block_n, block_d)
    v = _load_rows(V, b, kv_head, kv_tile, block_n, block_d)
    scores = ct.mma(q, ct.transpose(k), ct.zeros((block_m, block_n), acc_dtype)) * qk_scale_log2
    probs = ct.exp2(scores - lse)
    if masked:
        cols = kv_tile * block_n + ct.arange(block_n, dtype=ct.int32)[None, :]
        probs = ct.where(_visible(rows, cols, seqlen_q, seqlen_k, causal), probs, 0.0)
    d_probs = ct.mma(d_out, ct.transpose(v), ct.zeros((block_m, block_n), acc_dtype))
    d_scores = probs * (d_probs - delta)
    return ct.mma(d_scores.astype(k.dtype), k, d_query)


@ct.kernel
def attention_backward_dq_kernel(
    Q,
    K,
    V,
    dOut,
    Lse,
    Delta,
    dQ,
    softmax_scale: float,
    softmax_scale_lo: float,
    qk_scale_log2: float,
    qk_scale_log2_lo: float,
    query_group_size: int,
    block_m: ConstInt,
    block_n: ConstInt,
    block_d: ConstInt,
    causal: ConstBool,
):
    """dQ of one query tile, looping over the key tiles it sees."""
    q_tile, q_head, b, kv_head = _query_program(query_group_size, causal)
    seqlen_q = Q.shape[2]
    seqlen_k = K.shape[2]
    acc_dtype = _accumulator_dtype(Q.dtype)
    qk_scale_log2 = _scale(qk_scale_log2, qk_scale_log2_lo, acc_dtype)
    softmax_scale = _scale(softmax_scale, softmax_scale_lo, acc_dtype)

    q = _load_rows(Q, b, q_head, q_tile, block_m, block_d)
    d_out = _load_rows(dOut, b, q_head, q_tile, block_m, block_d)
    lse = _base2_lse(Lse, b, q_head, q_tile, block_m)[:, None]
    delta = _load_row_stat(Delta, b, q_head, q_tile, block_m)[:, None]
    rows = q_tile * block_m + ct.arange(block_m, dtype=ct.int32)[:, None]
    d_query = ct.zeros((block_m, block_d), acc_dtype)

    num_full, num_end = _causal_key_tiles(q_tile, seqlen_q, seqlen_k, block_m, block_n, causal)
    for kv_tile in range(num_full):
        d_query = _dq_step(
            q, d_out, lse, delta, K, V, b, kv_head, kv_tile, d_query, rows, qk_scale_log2,
            seqlen_q, seqlen_k, block_m, block_n, block_d, causal, False,
        )  # fmt: skip
    for kv_tile in range(num_full, num_end):
        d_query = _dq_step(
            q, d_out, lse, delta, K, V, b, kv_head, kv_tile, d_query, rows, qk_scale_log2,
            seqlen_q, seqlen_k, block_m, block_n, block_d, causal, True,
        )  # fmt: skip

    _store_rows(dQ, b, q_head, q_tile, d_query * softmax_scale, block_m, block_d)

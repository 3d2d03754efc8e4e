"""Tile loads and stores of the [B, H, S, D] arrays and [B, H, S] row statistics, and the
numerics every kernel shares (accumulator dtype, fp64-exact constants, exp2).

Tiles are loaded with zero padding, so sequence lengths and head dims need not be multiples of
a tile, and stores past the end of an array are dropped: nothing outside the tensors is touched.
"""

import cuda.tile as ct

from tilegym.ops.attention.kernels.state import SeqLens

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]

NEG_INF = float("-inf")
POS_INF = float("inf")
LN2 = 0.6931471805599453
LOG2E = 1.4426950408889634
ZERO_PAD = ct.PaddingMode.ZERO


@ct.function
def load_rows(array, b, h, tile_index, rows: ConstInt, cols: ConstInt, bulk: ConstBool = True):
    """A [rows, cols] tile of a [B, H, S, D] array, zero beyond S and D. bulk: the compiler may
    use a bulk tensor copy (TMA); see load_tile."""
    return load_tile(array, (b, h, tile_index, 0), (rows, cols), bulk)


@ct.function
def store_rows(array, b, h, tile_index, tile, rows: ConstInt, cols: ConstInt, bulk: ConstBool = True):
    store_tile(array, (b, h, tile_index, 0), tile, (rows, cols), bulk)


@ct.function
def load_tile(array, index, shape: ct.Constant[tuple], bulk: ConstBool):
    """A tile of shape (rows, cols) at index of a [B, H, S, D] array, zero-padded.

    Without bulk, no bulk tensor copy: a program that loads a tile of a sliced array once
    (packed.py) would first write the slice's copy descriptor to global memory and wait for it,
    a round trip that costs more than a plain load of one tile.
    """
    rows, cols = shape
    if bulk:
        tile = ct.load(array, index=index, shape=(1, 1, rows, cols), padding_mode=ZERO_PAD)
    else:
        tile = ct.load(array, index=index, shape=(1, 1, rows, cols), padding_mode=ZERO_PAD, allow_tma=False)
    return tile.reshape((rows, cols))


@ct.function
def store_tile(array, index, tile, shape: ct.Constant[tuple], bulk: ConstBool):
    """Stores a (rows, cols) tile at index of a [B, H, S, D] array (bulk: as load_tile)."""
    rows, cols = shape
    tile = tile.reshape((1, 1, rows, cols)).astype(array.dtype)
    if bulk:
        ct.store(array, index=index, tile=tile)
    else:
        ct.store(array, index=index, tile=tile, allow_tma=False)


@ct.function
def add_rows(array, b, h, tile_index, tile, rows: ConstInt, cols: ConstInt):
    """Adds a rows x cols fp32 tile into a tile-padded fp32 sum [B, H, S, D], a whole tile at
    once (one TMA reduction on sm_90, where a per-element atomic add is one REDG per value)."""
    view = array.tiled_view((1, 1, rows, cols))
    view.atomic_store_add((b, h, tile_index, 0), tile.reshape((1, 1, rows, cols)))


@ct.function
def load_row_stat(array, b, h, tile_index, rows: ConstInt):
    """A [rows] slice of a per-row statistic [B, H, S] (LSE or Delta)."""
    tile = ct.load(array, index=(b, h, tile_index), shape=(1, 1, rows), padding_mode=ZERO_PAD)
    return tile.reshape((rows,))


@ct.function
def store_row_stat(array, b, h, tile_index, tile, rows: ConstInt, bulk: ConstBool):
    """Stores a [rows] tile of a per-row statistic [B, H, S] (bulk: as load_tile)."""
    tile = tile.reshape((1, 1, rows)).astype(array.dtype)
    if bulk:
        ct.store(array, index=(b, h, tile_index), tile=tile)
    else:
        ct.store(array, index=(b, h, tile_index), tile=tile, allow_tma=False)


@ct.function
def seqlens(Q, K):
    """SeqLens as int32 also where the arrays are indexed with int64 (index_width.wide): the
    host keeps Sq + Sk below 2**29, so positions and tile numbers stay 32-bit."""
    return SeqLens(ct.astype(Q.shape[2], ct.int32), ct.astype(K.shape[2], ct.int32))


@ct.function
def accumulator_dtype(dtype):
    return ct.float64 if dtype == ct.float64 else ct.float32


@ct.function
def scale(hi, lo, acc_dtype):
    """A float kernel argument split by the host into hi + lo (launching.split_float): float
    arguments arrive as fp32, so fp64 kernels rebuild the exact value from both."""
    if acc_dtype == ct.float64:
        return hi.astype(ct.float64) + lo.astype(ct.float64)
    return hi


@ct.function
def ln2(dtype):
    # Float literals reach the kernel rounded to fp32: fp64 kernels compute log(2) instead.
    if dtype == ct.float64:
        return ct.log(ct.full((1,), 2.0, ct.float64))
    return LN2


@ct.function
def log2e(dtype):
    if dtype == ct.float64:
        return 1.0 / ln2(dtype)
    return LOG2E


@ct.function
def sixteen_bits(dtype):
    """Whether an input dtype is float16 or bfloat16 (a compile-time test)."""
    return dtype == ct.float16 or dtype == ct.bfloat16


@ct.function
def exp2(x):
    # Flushing subnormal results to zero lets exp2 compile to the bare hardware instruction
    # (without it every element pays a range test and two predicated multiplies). A
    # probability below 2^-126 of its row's maximum changes no sum we form.
    if x.dtype == ct.float64:
        return ct.exp2(x)
    return ct.exp2(x, flush_to_zero=True)


@ct.function
def exp2_on_fma(x):
    """2^x (flushed as exp2) on the FMA and integer pipes instead of the MUFU: round(x) goes to
    the exponent field (x + 1.5 * 2^23 holds it in its low bits), 2^f for the rest f in
    [-1/2, 1/2] is a cubic (relative error 1.7e-4, below the rounding of a 16-bit P). Inputs
    at or below -127 give 0."""
    x = ct.maximum(x, -127.0)
    shifted = x + 12582912.0
    f = x - (shifted - 12582912.0)
    power = f * (0.69331595 + f * (0.24195845 + f * 0.054636277)) + 1.0
    bits = ct.bitcast(power, ct.int32) + (ct.bitcast(shifted, ct.int32) << 23)
    return ct.bitcast(bits, ct.float32)


@ct.function
def exp2_split_pipes(x):
    """exp2 of a [rows, cols] fp32 tile, the left half of its columns on the MUFU (exp2), the
    right half on the FMA pipe (exp2_on_fma)."""
    rows, cols = x.shape[0], x.shape[1]
    left = ct.extract(x, (0, 0), (rows, cols // 2))
    right = ct.extract(x, (0, 1), (rows, cols // 2))
    return ct.cat((exp2(left), exp2_on_fma(right)), 1)

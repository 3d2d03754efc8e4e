"""Smallest cuTile kernels for reading racecheck's reports on our kernels (tests/ops/sanitize.py).

Each kernel has no race in its source: every program reads and writes only its own tiles.
"""

import cuda.tile as ct
import torch

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
ZERO = ct.PaddingMode.ZERO


@ct.kernel
def row_slice_copy(src, dst, rows: ConstInt):
    """Copies a [1, 1, rows] slice of a [B, H, S] array, as attention loads its LSE rows."""
    tile = ct.load(src, index=(ct.bid(2), ct.bid(1), ct.bid(0)), shape=(1, 1, rows), padding_mode=ct.PaddingMode.ZERO)
    ct.store(dst, index=(ct.bid(2), ct.bid(1), ct.bid(0)), tile=tile * 2.0)


@ct.kernel
def tile_copy(src, dst, rows: ConstInt, cols: ConstInt):
    """Copies a [1, 1, rows, cols] tile of a [B, H, S, D] array, as attention loads q."""
    index = (ct.bid(2), ct.bid(1), ct.bid(0), 0)
    tile = ct.load(src, index=index, shape=(1, 1, rows, cols), padding_mode=ct.PaddingMode.ZERO)
    ct.store(dst, index=index, tile=tile)


@ct.kernel
def matmul(a, b, c, tile_m: ConstInt, tile_n: ConstInt, tile_k: ConstInt):
    """c = a @ b over a K loop: the plain pattern racecheck reports nothing on."""
    m, n = ct.bid(0), ct.bid(1)
    acc = ct.full((tile_m, tile_n), 0.0, dtype=ct.float32)
    for kk in range(ct.cdiv(a.shape[1], tile_k)):
        a_tile = ct.load(a, index=(m, kk), shape=(tile_m, tile_k), padding_mode=ct.PaddingMode.ZERO)
        b_tile = ct.load(b, index=(kk, n), shape=(tile_k, tile_n), padding_mode=ct.PaddingMode.ZERO)
        acc = ct.mma(a_tile, b_tile, acc)
    ct.store(c, index=(m, n), tile=acc.astype(c.dtype))


@ct.kernel
def row_stat_columns(K, Q, Stat, Out, block_m: ConstInt, block_n: ConstInt, block_d: ConstInt, flat: ConstBool):
    """The dK/dV kernel's pattern: per query tile, scores in key-major form [block_n, block_m]
    minus that tile's row statistic along the columns, summed into [block_n, block_d].
    flat: the statistic loaded as [block_m] and indexed [None, :] (as the attention kernels do),
    else reshaped straight to [1, block_m]."""
    kv_tile, h, b = ct.bid(0), ct.bid(1), ct.bid(2)
    k = ct.load(K, index=(b, h, kv_tile, 0), shape=(1, 1, block_n, block_d), padding_mode=ZERO).reshape(
        (block_n, block_d)
    )
    acc = ct.zeros((block_n, block_d), ct.float32)  # [block_n, block_d]
    for q_tile in range(ct.cdiv(Q.shape[2], block_m)):
        q = ct.load(Q, index=(b, h, q_tile, 0), shape=(1, 1, block_m, block_d), padding_mode=ZERO).reshape(
            (block_m, block_d)
        )
        scores = ct.mma(k, ct.transpose(q), ct.zeros((block_n, block_m), ct.float32))  # [block_n, block_m]
        stat = ct.load(Stat, index=(b, h, q_tile), shape=(1, 1, block_m), padding_mode=ZERO)
        stat = stat.reshape((block_m,))[None, :] if flat else stat.reshape((1, block_m))  # [1, block_m]
        probabilities = ct.exp2(scores - stat)  # [block_n, block_m]
        acc = ct.mma(probabilities.astype(q.dtype), q, acc)
    ct.store(Out, index=(b, h, kv_tile, 0), tile=acc.reshape((1, 1, block_n, block_d)).astype(Out.dtype))


def run(name: str) -> None:
    stream = torch.cuda.current_stream().cuda_stream
    if name == "row_slice":
        src = torch.randn((1, 2, 130), device="cuda")
        dst = torch.empty_like(src)
        ct.launch(stream, (ct.cdiv(130, 64), 2, 1), row_slice_copy, (src, dst, 64))
        torch.cuda.synchronize()
        assert torch.equal(dst, src * 2)
    elif name == "tile":
        src = torch.randn((1, 2, 130, 128), device="cuda", dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        ct.launch(stream, (ct.cdiv(130, 64), 2, 1), tile_copy, (src, dst, 64, 128))
        torch.cuda.synchronize()
        assert torch.equal(dst, src)
    elif name.startswith("row_stat_columns"):
        q = torch.randn((1, 2, 130, 128), device="cuda", dtype=torch.bfloat16) / 4
        k = torch.randn((1, 2, 130, 128), device="cuda", dtype=torch.bfloat16) / 4
        stat = torch.randn((1, 2, 130), device="cuda")
        out = torch.empty((1, 2, 130, 128), device="cuda", dtype=torch.float32)
        flat = name == "row_stat_columns_flat"
        ct.launch(stream, (ct.cdiv(130, 64), 2, 1), row_stat_columns, (k, q, stat, out, 64, 64, 128, flat))
        torch.cuda.synchronize()
        expected = torch.exp2(k.float() @ q.float().transpose(-1, -2) - stat[:, :, None, :]) @ q.float()
        torch.testing.assert_close(out, expected, rtol=5e-2, atol=2e-1)
    else:
        a = torch.randn((256, 512), device="cuda", dtype=torch.bfloat16)
        b = torch.randn((512, 256), device="cuda", dtype=torch.bfloat16)
        c = torch.empty((256, 256), device="cuda", dtype=torch.bfloat16)
        ct.launch(stream, (2, 2, 1), matmul, (a, b, c, 128, 128, 64))
        torch.cuda.synchronize()
        torch.testing.assert_close(c.float(), a.float() @ b.float(), rtol=2e-2, atol=2e-1)

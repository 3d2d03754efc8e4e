"""The kernels and timing of experiment_fused_backward.py: a fused one-pass backward (dK, dV and
dQ from one kernel, dQ summed by fp32 atomics) beside our two backwards and SDPA's cuDNN
backend. Apart from the script so that its --help needs no GPU stack.
"""

import math
import os
from functools import partial
from unittest import mock

import cuda.tile as ct
import torch

from tilegym import autotune
from tilegym.autotune import TileConfig
from tilegym.ops.attention import configs, kernels, launch
from tilegym.ops.attention.kernels import (
    ConstBool,
    ConstInt,
    _add_tile,
    _causal_query_tiles,
    _load_row_stat,
    _load_rows,
    _store_rows,
    _visible,
)
from tilegym.ops.attention.score_mods import BIAS_NONE

# The kernels' score-modifier switches (windowed, capped, bias_mode, alibi), all off.
_NO_MODIFIERS = (False, False, BIAS_NONE, False)


@ct.function
def _fused_step(
    k, v, Q, dOut, LseBase2, Delta, DQsum, b, h, q_tile, d_key, d_value, cols, qk_scale_log2, seqlen_q, seqlen_k,
    block_m: ConstInt, block_n: ConstInt, block_d: ConstInt, causal: ConstBool, masked: ConstBool,
    tiled_sum: ConstBool,
):  # fmt: skip
    q = _load_rows(Q, b, h, q_tile, block_m, block_d)
    d_out = _load_rows(dOut, b, h, q_tile, block_m, block_d)
    lse = _load_row_stat(LseBase2, b, h, q_tile, block_m)[None, :]
    delta = _load_row_stat(Delta, b, h, q_tile, block_m)[None, :]
    rows = q_tile * block_m + ct.arange(block_m, dtype=ct.int32)[None, :]
    probs_t = ct.exp2(ct.mma(k, ct.transpose(q), ct.zeros((block_n, block_m), ct.float32)) * qk_scale_log2 - lse)
    if masked:
        probs_t = ct.where(_visible(rows, cols, seqlen_q, seqlen_k, causal, (), _NO_MODIFIERS), probs_t, 0.0)
    d_value = ct.mma(probs_t.astype(d_out.dtype), d_out, d_value)
    d_probs_t = ct.mma(v, ct.transpose(d_out), ct.zeros((block_n, block_m), ct.float32))
    d_scores_t = (probs_t * (d_probs_t - delta)).astype(q.dtype)
    d_key = ct.mma(d_scores_t, q, d_key)
    # This key tile's share of dQ, added to a tile-padded fp32 sum: no bounds checks needed.
    d_query = ct.mma(ct.transpose(d_scores_t), k, ct.zeros((block_m, block_d), ct.float32))
    if tiled_sum:
        _add_tile(DQsum, b, h, q_tile, d_query, block_m, block_d)  # the library's tile-wide sum
    else:
        query_rows = q_tile * block_m + ct.arange(block_m, dtype=ct.int32)[:, None]
        dims = ct.arange(block_d, dtype=ct.int32)[None, :]
        ct.atomic_add(DQsum, (b, h, query_rows, dims), d_query, check_bounds=False, memory_order=ct.MemoryOrder.RELAXED)
    return d_key, d_value


@ct.kernel
def fused_backward_kernel(
    Q, K, V, dOut, LseBase2, Delta, dK, dV, DQsum, softmax_scale: float, qk_scale_log2: float,
    block_m: ConstInt, block_n: ConstInt, block_d: ConstInt, causal: ConstBool, staggered: ConstBool,
    tiled_sum: ConstBool,
):  # fmt: skip
    """dK, dV of one key tile, and its contributions to dQ; grid (key tiles, heads, batch).

    staggered: each key tile starts its unmasked query tiles at a different one (rotated by its
    index), so programs running side by side add into different dQ rows.
    """
    kv_tile = ct.bid(0)
    h = ct.bid(1)
    b = ct.bid(2)
    seqlen_q = Q.shape[2]
    seqlen_k = K.shape[2]
    k = _load_rows(K, b, h, kv_tile, block_n, block_d)
    v = _load_rows(V, b, h, kv_tile, block_n, block_d)
    cols = kv_tile * block_n + ct.arange(block_n, dtype=ct.int32)[:, None]
    d_key = ct.zeros((block_n, block_d), ct.float32)
    d_value = ct.zeros((block_n, block_d), ct.float32)
    masked_start, full_start, num_q_tiles = _causal_query_tiles(kv_tile, seqlen_q, seqlen_k, block_m, block_n, causal)
    tile = (k, v, Q, dOut, LseBase2, Delta, DQsum, b, h)
    for q_tile in range(masked_start, full_start):
        d_key, d_value = _fused_step(
            *tile, q_tile, d_key, d_value, cols, qk_scale_log2, seqlen_q, seqlen_k,
            block_m, block_n, block_d, causal, True, tiled_sum,
        )  # fmt: skip
    num_full = num_q_tiles - full_start
    for step in range(num_full):
        if staggered:
            q_tile = full_start + (step + kv_tile) % num_full
        else:
            q_tile = full_start + step
        d_key, d_value = _fused_step(
            *tile, q_tile, d_key, d_value, cols, qk_scale_log2, seqlen_q, seqlen_k,
            block_m, block_n, block_d, causal, False, tiled_sum,
        )  # fmt: skip
    _store_rows(dK, b, h, kv_tile, d_key * softmax_scale, block_n, block_d)
    _store_rows(dV, b, h, kv_tile, d_value, block_n, block_d)


def fused_backward(
    d_out, q, k, v, out, lse, causal: bool, config: TileConfig, staggered: bool = False, tiled_sum: bool = False
):
    """(dq, dk, dv): preprocess, the fused kernel, then dQ scaled and cast from its fp32 sum."""
    batch, heads, seqlen, head_dim = q.shape
    stream = torch.cuda.current_stream()
    delta, lse_base2 = (torch.empty((batch, heads, seqlen), device=q.device, dtype=torch.float32) for _ in range(2))
    rows = configs.candidates(configs.BACKWARD_PREPROCESS, "sm_90", head_dim, q.element_size())[0].block_m
    preprocess_grid = (math.ceil(seqlen / rows), heads, batch)
    ct.launch(
        stream,
        preprocess_grid,
        kernels.attention_backward_preprocess_kernel,
        (out, d_out, lse, delta, lse_base2, rows, head_dim),
    )
    padded_rows = math.ceil(seqlen / config.block_m) * config.block_m
    dq_sum = torch.zeros((batch, heads, padded_rows, head_dim), device=q.device, dtype=torch.float32)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    scale = 1 / math.sqrt(head_dim)
    args = (q, k, v, d_out, lse_base2, delta, dk, dv, dq_sum, scale, scale * kernels.LOG2E)
    args += (config.block_m, config.block_n, head_dim, causal, staggered, tiled_sum)
    kernel = autotune.with_hints(fused_backward_kernel, config)
    ct.launch(stream, (math.ceil(seqlen / config.block_n), heads, batch), kernel, args)
    return dq_sum[:, :, :seqlen].mul(scale).to(q.dtype), dk, dv


def _config(spec: str) -> tuple[TileConfig, bool, bool]:
    """(config, staggered, tiled_sum) of "block_m,block_n[,warps[,occupancy]]" followed by
    flags: "s" staggered query order, "t" dQ summed tile-wide through a tiled view."""
    flags = spec[len(spec.rstrip("st")) :]
    staggered, tiled_sum = "s" in flags, "t" in flags
    numbers = [int(x) for x in spec.rstrip("st").strip(",").split(",")]
    block_m, block_n, warps, occupancy = (numbers + [0, 0])[:4]
    config = TileConfig(block_m, block_n, num_worker_warps=warps or None, occupancy=occupancy or None)
    return config, staggered, tiled_sum


def _median_ms(fn, *args) -> float:
    from triton.testing import do_bench

    return do_bench(partial(fn, *args), warmup=50, rep=200, return_mode="median")


def _library_backward(design: str, *arrays, problem):
    """launch.backward with TILEGYM_BACKWARD set to design ("two-kernel" or "fused")."""
    with mock.patch.dict(os.environ, TILEGYM_BACKWARD=design):
        return launch.backward(*arrays, problem)


def _cudnn_backward(inputs, d_out, out):
    return torch.autograd.grad(out, inputs, d_out, retain_graph=True)


def compare(head_dim: int, seqlen: int, causal: bool, specs) -> str:
    """One row: TFLOPS of the two-kernel backward, of each fused config (with its largest
    difference from the two-kernel gradients, relative to their max) and of cuDNN."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch, heads = 16384 // seqlen, 2048 // head_dim
    shape = (batch, heads, seqlen, head_dim)
    q, k, v, d_out = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    problem, _ = launch.check_inputs(q, k, v, None, causal)
    out, lse = launch.forward(q, k, v, problem, with_lse=True)
    tflops = 2.5 * 4 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1) / 1e9
    arrays = (d_out, q, k, v, out, lse)
    expected = _library_backward("two-kernel", *arrays, problem=problem)[:3]
    cells = [
        f"{design} {tflops / _median_ms(partial(_library_backward, design, problem=problem), *arrays):.0f}"
        for design in ("two-kernel", "fused")
    ]
    for spec in specs:
        config, staggered, tiled_sum = _config(spec)
        got = fused_backward(*arrays, causal, config, staggered, tiled_sum)
        diff = max(
            ((g.float() - e.float()).abs().max() / e.float().abs().max()).item()
            for g, e in zip(got, expected, strict=True)
        )
        ms = _median_ms(fused_backward, *arrays, causal, config, staggered, tiled_sum)
        cells.append(f"fused {spec} {tflops / ms:.0f} (rel diff {diff:.0e})")
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        sdpa_out = torch.nn.functional.scaled_dot_product_attention(*inputs, is_causal=causal)
        cells.append(f"cudnn {tflops / _median_ms(_cudnn_backward, inputs, d_out, sdpa_out):.0f}")
    return f"d{head_dim} S={seqlen} {'causal' if causal else 'full'} TFLOPS: " + ", ".join(cells)

"""Context parallelism of a packed batch: sequences one after another (FlashAttention's varlen
layout), each split over the ranks of a torch.distributed group in the zigzag layout
(sharding.PackedSharding).

As for one sequence (context.py), keys and values are all-gathered and every row's softmax is
computed whole, in one call: here one call of the packed kernels per rank, in which each chunk of
the rank's rows is a sequence of its own, given its sequence's keys up to its last row (causal)
or all of them. Those keys are gathered into one tensor, chunk after chunk, from the all-gather
(a row map built on the GPU: no host synchronisation), and their gradients added back into the
all-gather's layout in float32 before the reduce-scatter.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from tilegym import env
from tilegym.kept_values import KeptPerTensor
from tilegym.ops.attention.api import tile_fmha_functional
from tilegym.ops.attention.packing import (
    CHECK_VARLEN,
    CuSeqlens,
    _check_max_seqlen,
    _check_one_cu_seqlens,
    check_packed_inputs,
)
from tilegym.parallel.collectives import all_gather, gradient_buffer, reduce_scatter, world_of
from tilegym.parallel.context import as_length, capturing, check_shares, check_training, refuse_unaligned
from tilegym.parallel.functions import ChunkFunctions, WholeSizes
from tilegym.parallel.sharding import PackedSharding


@torch.compiler.disable
def context_parallel_attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    scaling: float | None = None,
    is_causal: bool = True,
    training: bool | None = None,
    *,
    group=None,
    window_size: tuple[int, int] | list[int] | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    return_lse: bool = False,
    score_mod: Callable | None = None,
    score_mod_grad: Callable | None = None,
    aux: tuple[Tensor, ...] | None = None,
    aux_grad: Callable | None = None,
    mask_mod: Callable | None = None,
    mask_aux: tuple[Tensor, ...] | None = None,
    block_mask=None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of a packed batch whose every sequence is split over the ranks of group, on
    each rank its rows; differentiable in q, k, v, sinks and aux tensors that require grad.

    Args:
        q, k, v: this rank's rows, ``[T, Hq, D]``, ``[T, Hkv, D]``, ``[T, Hkv, Dv]``: of each
            sequence in turn, its chunks r and 2W - 1 - r of 2W (``shard_packed`` cuts them from
            the whole batch). Every rank passes the same shapes and arguments.
        cu_seqlens: int32 ``[N + 1]`` on q's device, the whole batch's cumulative lengths (the
            same on every rank), running from 0 to W x T; every length a multiple of 2W.
            ``TILEGYM_CHECK_VARLEN=1`` checks that (and max_seqlen) on the host and raises;
            without it, lengths that break it give wrong rows but never a read or write outside
            the tensors (rows are clamped into them, as the packed kernels clamp sequences).
        max_seqlen: the longest sequence of the whole batch, a Python int (a multiple of 2W).
        scaling, is_causal, window_size, softcap, alibi_slopes, sinks: as tile_fmha_varlen on the
            whole batch (alibi_slopes ``[Hq]`` or ``[N, Hq]``). Without causal masking,
            window_size and alibi_slopes are refused (as context_parallel_attention).
        training, group, return_lse: as context_parallel_attention; lse is ``[Hq, T]``. Under
            torch.compile the call runs eagerly, as context_parallel_attention.
        score_mod, score_mod_grad, aux, aux_grad, mask_mod, mask_aux, block_mask: as
            context_parallel_attention, the functions seeing what they see on the whole packed
            batch: b the sequence, q_idx and kv_idx positions within it; a block mask made for
            the whole batch (create_block_mask with cu_seqlens as both cumulative lengths, N
            sequences, max_seqlen long).

    Returns:
        ``[T, Hq, Dv]``: this rank's rows of the whole batch's attention, or ``(out, lse)``.
    """
    rank, world = world_of(group)
    check_shares(q, k, v, "[T, H, D]", "this rank's rows of the packed batch", 0)
    if q.shape[0] % 2:
        raise ValueError(f"a rank holds two equal chunks of every sequence: {q.shape[0]} rows is not even")
    _check_one_cu_seqlens("cu_seqlens", cu_seqlens, q)
    longest = _check_max_seqlen("max_seqlen", max_seqlen)
    whole = WholeSizes(cu_seqlens.numel() - 1, q.shape[1], longest, CuSeqlens(cu_seqlens, cu_seqlens))
    functions = ChunkFunctions.of(
        q, 2, whole, score_mod=score_mod, score_mod_grad=score_mod_grad, aux=aux, aux_grad=aux_grad,
        mask_mod=mask_mod, mask_aux=mask_aux, block_mask=block_mask,
    )  # fmt: skip
    training = check_training(training, return_lse, q, k, v, sinks, *(functions.aux if functions else ()))
    refuse_unaligned(is_causal, window_size, alibi_slopes)
    sharding = PackedSharding(world)
    if longest % sharding.chunks:
        raise ValueError(
            f"max_seqlen ({longest}) must be a multiple of {sharding.chunks}: every sequence's length is, in the "
            f"zigzag layout over {world} ranks"
        )
    if env.flag(CHECK_VARLEN, False):
        sharding.check(cu_seqlens, world * q.shape[0], longest)
    if isinstance(alibi_slopes, Tensor) and alibi_slopes.dim() == 2:
        alibi_slopes = _twice(alibi_slopes)  # per chunk: two per sequence
    calls = _plan(sharding, cu_seqlens, rank, q.shape[0], longest, is_causal)
    # Every error the packed kernels' checks would raise, before the collective.
    keys_view = as_length(k, 0, calls.key_rows.numel())
    values_view = as_length(v, 0, calls.key_rows.numel())
    check_packed_inputs(
        q, keys_view, values_view, calls.cu_seqlens_q, calls.cu_seqlens_k, calls.max_seqlen_q, calls.max_seqlen_k,
        scaling, is_causal, window_size, softcap, alibi_slopes, sinks, read_contents=False,
    )  # fmt: skip

    with torch.set_grad_enabled(training and torch.is_grad_enabled()):
        keys, values = _SharedPackedKeys.apply(k, v, calls.key_rows, group)
        out, lse = tile_fmha_functional(
            q, keys, values, scaling, is_causal, training,
            window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, return_lse=True,
            cu_seqlens_q=calls.cu_seqlens_q, cu_seqlens_k=calls.cu_seqlens_k,
            max_seqlen_q=calls.max_seqlen_q, max_seqlen_k=calls.max_seqlen_k,
            **(functions.arguments(calls.offsets) if functions is not None else {}),
        )  # fmt: skip
    return (out, lse) if return_lse else out


def shard_packed(x: Tensor, cu_seqlens: Tensor, *, group=None) -> Tensor:
    """This rank's rows of x, a whole packed batch ``[total, ...]`` (inputs, labels): of each
    sequence, chunks r and 2W - 1 - r of 2W. Checks cu_seqlens on the host (one
    synchronisation): from 0 to total, every length a multiple of 2W."""
    rank, world = world_of(group)
    sharding = PackedSharding(world)
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    _check_one_cu_seqlens("cu_seqlens", cu_seqlens, x)
    sharding.check(cu_seqlens, x.shape[0])
    return x.index_select(0, sharding.local_rows(cu_seqlens, rank, x.shape[0] // world))


def unshard_packed(x: Tensor, cu_seqlens: Tensor, *, group=None) -> Tensor:
    """The whole packed batch on every rank from each rank's rows x (an all-gather; no gradient)."""
    _, world = world_of(group)
    sharding = PackedSharding(world)
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    _check_one_cu_seqlens("cu_seqlens", cu_seqlens, x)
    rows = torch.arange(world * x.shape[0], device=x.device)
    return all_gather(x.detach(), group).index_select(0, sharding.gathered_rows(cu_seqlens, rows, x.shape[0]))


def packed_positions(cu_seqlens: Tensor, local_total: int, *, group=None) -> Tensor:
    """int64 ``[local_total]``: the position of each of this rank's rows within its sequence
    (position_ids for rotary embeddings)."""
    rank, world = world_of(group)
    rows = PackedSharding(world).local_rows(cu_seqlens, rank, local_total)
    bounds = cu_seqlens.long()
    return rows - bounds[PackedSharding.sequence_of(bounds, rows)]


@dataclass(frozen=True)
class _ChunkCalls:
    """The packed call of one rank: each of its chunks a sequence (2 per sequence of the batch,
    in the order of its rows), with the keys that chunk sees laid one chunk after the other."""

    cu_seqlens_q: Tensor  # int32 [2N + 1]
    cu_seqlens_k: Tensor  # int32 [2N + 1]
    max_seqlen_q: int
    max_seqlen_k: int
    key_rows: Tensor  # int64: for each key row of the call, its row in the all-gather
    offsets: Tensor  # int32 [2N, 2]: each chunk's first query and first key within its sequence

    @classmethod
    def plan(cls, sharding: PackedSharding, cu_seqlens: Tensor, rank: int, local_total: int, longest: int, causal):
        bounds = cu_seqlens.long()
        chunk = (bounds[1:] - bounds[:-1]) // sharding.chunks
        if causal:  # chunk r sees its sequence's first r + 1 chunks, chunk 2W - 1 - r its first 2W - r
            seen = torch.stack([(rank + 1) * chunk, (sharding.chunks - rank) * chunk], dim=1).flatten()
            key_total = (sharding.chunks + 1) * local_total // 2
            longest_keys = (sharding.chunks - rank) * (longest // sharding.chunks)
        else:
            seen = _twice(chunk * sharding.chunks)
            key_total = 2 * sharding.world * local_total
            longest_keys = longest
        cu_q = F.pad(_twice(chunk).cumsum(0), (1, 0))
        cu_k = F.pad(seen.cumsum(0), (1, 0))
        key_index = torch.arange(key_total, device=cu_seqlens.device)
        call_sequence = PackedSharding.sequence_of(cu_k, key_index)
        rows = bounds[call_sequence // 2] + key_index - cu_k[call_sequence]
        first_query = torch.stack([rank * chunk, (sharding.chunks - 1 - rank) * chunk], dim=1).flatten()
        offsets = torch.stack([first_query, torch.zeros_like(first_query)], dim=1).int()  # keys from its start
        return cls(
            cu_q.int(), cu_k.int(), longest // sharding.chunks, longest_keys,
            sharding.gathered_rows(cu_seqlens, rows, local_total), offsets,
        )  # fmt: skip


def _twice(t: Tensor) -> Tensor:
    """Each row of t twice in a row, as repeat_interleave(2, dim=0) but as a view and a copy
    (no output size to work out: nothing that could wait on the GPU in a capture)."""
    return t.unsqueeze(1).expand(t.shape[0], 2, *t.shape[1:]).flatten(0, 1)


# A model passes one cu_seqlens tensor to all its layers: its plan (some fifteen small GPU
# operations) is made once per batch, not once per layer.
_PLANS = KeptPerTensor()


def _plan(sharding: PackedSharding, cu_seqlens: Tensor, rank: int, local_total: int, longest: int, causal: bool):
    """The rank's _ChunkCalls, kept per cu_seqlens tensor; made afresh inside a CUDA graph
    capture, where the graph's replays then make it from cu_seqlens's contents of the time."""
    context = (sharding, rank, local_total, longest, causal)
    if capturing():
        return _ChunkCalls.plan(sharding, cu_seqlens, *context[1:])
    return _PLANS.value_for(cu_seqlens, context, lambda: _ChunkCalls.plan(sharding, cu_seqlens, *context[1:]))


class _SharedPackedKeys(torch.autograd.Function):
    """(keys, values) of a rank's packed call, gathered from every rank's rows by key_rows. The
    backward adds their gradients in float32 (or wider) into the all-gather's layout, each row
    at most twice (the two chunks of a sequence), then reduce-scatters."""

    @staticmethod
    def forward(ctx, k: Tensor, v: Tensor, key_rows: Tensor, group) -> tuple:
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(key_rows)
        ctx.group, ctx.head_dim, ctx.local_shape = group, k.shape[-1], (*k.shape[:-1], k.shape[-1] + v.shape[-1])
        rows = all_gather(torch.cat([k, v], dim=-1), group).index_select(0, key_rows)
        return rows[..., : ctx.head_dim], rows[..., ctx.head_dim :]

    @staticmethod
    def backward(ctx, keys_grad, values_grad):
        (key_rows,) = ctx.saved_tensors
        some = keys_grad if keys_grad is not None else values_grad
        buffer = gradient_buffer(some, ctx.local_shape, ctx.group)
        for grad, columns in ((keys_grad, slice(None, ctx.head_dim)), (values_grad, slice(ctx.head_dim, None))):
            if grad is not None:
                # Deterministic: each row is added to at most twice, starting from zero.
                buffer[:, :, columns].index_put_((key_rows,), grad.to(buffer.dtype), accumulate=True)
        local = reduce_scatter(buffer, ctx.group).to(some.dtype)
        return local[..., : ctx.head_dim], local[..., ctx.head_dim :], None, None

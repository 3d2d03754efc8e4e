"""Context parallelism: attention over one sequence whose positions are split across the ranks
of a torch.distributed group.

Each rank holds a share of q, k and v (sharding.py). Keys and values are all-gathered (one
collective for both; their gradients come back by one reduce-scatter), then each chunk of the
rank's queries attends, in one call of our kernels, to the keys it can see. Every row's softmax
is thus computed whole, in one kernel: no partial results to merge, and every modifier that
reads a row whole (sinks) or positions (causal masking, windows, ALiBi) means what it means on
the whole sequence. Gathering keys rather than passing them around a ring costs memory for the
whole sequence's keys and values on every rank; with GQA they are a small part of the
activations. The collective is not overlapped with compute: for long sequences it is a few
percent of a step (docs/attention.md has the figures).

Causal masking needs the keys aligned: our kernels align the last query with the last key, so a
chunk of queries at positions [a, b) is given the keys [0, b) (or from a - left with a window),
and query a + i then sees exactly the keys up to a + i.
"""

import contextlib
from collections.abc import Callable

import torch
from torch import Tensor

from tilegym.ops.attention import dropout
from tilegym.ops.attention.api import tile_fmha_functional
from tilegym.ops.attention.problem import check_inputs
from tilegym.ops.attention.score_mods import check_bias
from tilegym.parallel.collectives import all_gather, broadcast, gradient_buffer, reduce_scatter, world_of
from tilegym.parallel.functions import ChunkFunctions, WholeSizes, dense_offsets
from tilegym.parallel.sharding import SequenceSharding, Span

_SEQUENCE_DIM = 2


@torch.compiler.disable
def context_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scaling: float | None = None,
    is_causal: bool = True,
    training: bool | None = None,
    *,
    group=None,
    layout: str = "zigzag",
    attn_bias: Tensor | None = None,
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
    dropout_p: float = 0.0,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of one sequence split along its positions over the ranks of group, on each
    rank its share; differentiable in q, k, v, attn_bias, sinks and aux tensors that require grad.

    Args:
        q, k, v: this rank's share, ``[B, Hq, L, D]``, ``[B, Hkv, L, D]``, ``[B, Hkv, L, Dv]``, the
            positions that sharding.SequenceSharding gives the rank for layout, in its order
            (``shard_sequence`` cuts them from a whole tensor). Every rank passes the same shapes,
            dtype and arguments, as for any collective; a sequence of world x L positions.
        scaling, is_causal, window_size, softcap, alibi_slopes, sinks: as tile_fmha_functional, on
            the whole sequence (Sq = Sk: self-attention). Causal masking, windows and ALiBi
            distances count global positions. Without causal masking, window_size and alibi_slopes
            are refused: the kernels align a chunk's queries with the end of its keys.
        attn_bias: as tile_fmha_functional, on the whole sequence: broadcastable to
            ``[B, Hq, S, S]`` with S = world x L, the same tensor on every rank (each chunk's call
            reads its rows and the keys it sees, as views).
        training: as tile_fmha_functional: True, differentiable; False, inference kernels; None,
            by grad mode and requires_grad of q, k, v, attn_bias, sinks.
        group: the torch.distributed process group (None: the default one); one GPU per rank.
        layout: "zigzag" (balanced under causal masking) or "contiguous" (sharding.py).
        return_lse: return ``(out, lse)``, lse ``[B, Hq, L]`` for this rank's rows, float32 (float64
            for float64 inputs).
        score_mod, score_mod_grad, aux, aux_grad, mask_mod, mask_aux: as tile_fmha_functional, with
            q_idx and kv_idx the whole sequence's positions (functions.py): at most 3 aux and 3
            mask_aux tensors (a slot carries each call's positions). block_mask: one made for the
            whole sequence (``[B or 1, Hq or 1, S, S]``), read as its mask_mod and mask_aux (each
            call makes its own tile lists).
        dropout_p: attention dropout's rate, as tile_fmha_functional (training calls). The mask is
            the one a single call on the whole sequence draws from the group's rank 0's seed (a
            broadcast per call): each rank's chunks draw their rows of it.

    Returns:
        ``[B, Hq, L, Dv]``: this rank's rows of the whole sequence's attention, or ``(out, lse)``.

    The gradients of k and v are this rank's share of the whole sequence's (summed over the
    ranks whose queries read them); those of attn_bias, sinks and aux tensors are this rank's
    rows' part: reduce them over the group like any replicated parameter's gradient. Under
    torch.compile the call runs eagerly (a graph break: its collectives are not traced); a CUDA
    graph captures it with its collectives (every rank capturing and replaying alike).

    Example, on each of 4 ranks (torchrun --nproc-per-node 4)::

        torch.distributed.init_process_group("nccl")
        rank = torch.distributed.get_rank()
        torch.cuda.set_device(rank)
        q, k, v = (shard_sequence(t, dim=2) for t in whole_qkv)  # 1/4 of each, zigzag
        out = context_parallel_attention(q, k, v)  # causal over all 4 shares
        out.sum().backward()
    """
    rank, world = world_of(group)
    check_shares(q, k, v, "[B, H, L, D]", "this rank's share of the sequence", _SEQUENCE_DIM)
    whole = WholeSizes(q.shape[0], q.shape[1], world * q.shape[_SEQUENCE_DIM])
    functions = ChunkFunctions.of(
        q, 1, whole, score_mod=score_mod, score_mod_grad=score_mod_grad, aux=aux, aux_grad=aux_grad, mask_mod=mask_mod,
        mask_aux=mask_aux, block_mask=block_mask,
    )  # fmt: skip
    training = check_training(training, return_lse, q, k, v, attn_bias, sinks, *(functions.aux if functions else ()))
    rate = dropout.check_rate(dropout_p)
    dropout.refuse_without_training(dropout_p, rate, training)
    refuse_unaligned(is_causal, window_size, alibi_slopes)
    sharding = SequenceSharding.of_share(layout, world, q.shape[_SEQUENCE_DIM])
    if attn_bias is not None:  # on the whole sequence; each call checks its views again
        check_bias(attn_bias, as_length(q, _SEQUENCE_DIM, sharding.length), sharding.length, q.shape[1])
    # Every error the kernels' checks would raise, raised before the collective: the widest
    # call (all keys) as stride-0 views of this rank's keys.
    check_inputs(
        q, as_length(k, _SEQUENCE_DIM, sharding.length), as_length(v, _SEQUENCE_DIM, sharding.length), scaling,
        is_causal,
        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
    )  # fmt: skip

    spans = sharding.spans(rank)
    # With dropout every chunk is given keys from the sequence's first: the kernels count a mask's
    # columns from the call's first key (dropout.with_first_row); a window hides the extra ones.
    seen = tuple(_keys_seen(span, is_causal, None if rate else window_size, sharding.length) for span in spans)
    seed = broadcast(dropout.call_seed(q.device), group) if rate else None
    with torch.set_grad_enabled(training and torch.is_grad_enabled()):
        keys_and_values = _SharedKeys.apply(k, v, sharding, group, seen)
        outs, lses = [], []
        for index, span in enumerate(spans):
            positions = {}
            if functions is not None:
                offsets = dense_offsets(q.shape[0], span.start, seen[index].start, q.device)
                positions = functions.arguments(offsets)
            with _chunk_seed(seed, span):
                out, lse = tile_fmha_functional(
                    q.narrow(_SEQUENCE_DIM, span.local_start, span.length),
                    *keys_and_values[2 * index : 2 * index + 2], scaling, is_causal, training,
                    attn_bias=_chunk_bias(attn_bias, span, seen[index]), window_size=window_size, softcap=softcap,
                    alibi_slopes=alibi_slopes, sinks=sinks, return_lse=True, dropout_p=rate, **positions,
                )  # fmt: skip
            outs.append(out)
            lses.append(lse)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=_SEQUENCE_DIM)
        lse = lses[0] if len(lses) == 1 else torch.cat(lses, dim=-1)
    return (out, lse) if return_lse else out


def shard_sequence(x: Tensor, dim: int = _SEQUENCE_DIM, *, group=None, layout: str = "zigzag") -> Tensor:
    """This rank's share of x, whose dim holds the whole sequence (inputs, labels, positions)."""
    rank, world = world_of(group)
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    return SequenceSharding(layout, world, x.shape[dim]).shard(x, rank, dim)


def unshard_sequence(x: Tensor, dim: int = _SEQUENCE_DIM, *, group=None, layout: str = "zigzag") -> Tensor:
    """The whole sequence on every rank from each rank's share x (an all-gather; no gradient)."""
    _, world = world_of(group)
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    sharding = SequenceSharding.of_share(layout, world, x.shape[dim])
    gathered = all_gather(x.detach().movedim(dim, 0), group)
    return sharding.unshard(gathered, dim=0).movedim(0, dim)


def sequence_positions(length: int, *, group=None, layout: str = "zigzag", device=None) -> Tensor:
    """int64 ``[length / world]``: the global positions this rank holds of a sequence of length
    (position_ids for rotary embeddings)."""
    rank, world = world_of(group)
    return SequenceSharding(layout, world, length).positions(rank, device=device)


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (the calls then keep nothing made
    in the capture for later calls)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_training(training, return_lse, *tensors) -> bool:
    """training as tile_fmha_functional reads it (None: by grad mode and the tensors'
    requires_grad), after checking it and return_lse."""
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if training is None:
        return torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in tensors)
    if not isinstance(training, bool):
        raise TypeError(f"training must be a bool or None, got {type(training).__name__}")
    return training


def refuse_unaligned(is_causal, window_size, alibi_slopes) -> None:
    """Without causal masking a chunk of queries gets all keys, so the kernels' alignment of its
    last query with the last key is not that of the whole sequence: the arguments that count
    positions are refused."""
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if not is_causal:
        for name, value in (("window_size", window_size), ("alibi_slopes", alibi_slopes)):
            if value is not None:
                raise ValueError(
                    f"{name} needs is_causal=True under context parallelism: without causal masking a "
                    "chunk's queries are not aligned with the end of the keys they see"
                )


def check_shares(q, k, v, shape: str, held: str, dim: int) -> None:
    """q, k and v: tensors of shape's rank (named in errors, with what they hold) that hold the
    same positions along dim."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != shape.count(",") + 1:
            raise ValueError(f"{name} must be {shape} ({held}), got {tuple(t.shape)}")
    lengths = {name: t.shape[dim] for name, t in (("q", q), ("k", k), ("v", v))}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"q, k and v must hold the same positions (self-attention), got {lengths} along dim {dim}")


def as_length(t: Tensor, dim: int, length: int) -> Tensor:
    """t as if it held length positions along dim: a stride-0 view, for the checks only."""
    size = (*t.shape[:dim], length, *t.shape[dim + 1 :])
    stride = (*t.stride()[:dim], 0, *t.stride()[dim + 1 :])
    return t.as_strided(size, stride)


def whole_keys(k: Tensor, v: Tensor, sharding: SequenceSharding, group) -> Tensor:
    """[B, Hkv, S, D + Dv]: the keys and values of every rank in sequence order, gathered by one
    collective (a buffer laid out sequence first; k and v side by side in its last dim)."""
    local = torch.cat([k.movedim(_SEQUENCE_DIM, 0), v.movedim(_SEQUENCE_DIM, 0)], dim=-1)  # [L, B, Hkv, D + Dv]
    return sharding.unshard(all_gather(local, group), dim=0).movedim(0, _SEQUENCE_DIM)


class _SharedKeys(torch.autograd.Function):
    """(keys, values) of each chunk of this rank's queries, views of the whole sequence's keys
    and values gathered from every rank. The backward adds each chunk's gradients in float32 (or
    wider) straight into the layout the reduce-scatter takes (every rank's share after the other), so
    no whole-sequence gradient is made per view, and partial sums are not rounded to 16 bits
    (a rank sums 2 chunks' parts, the reduce-scatter one part per rank)."""

    @staticmethod
    def forward(ctx, k: Tensor, v: Tensor, sharding: SequenceSharding, group, seen: tuple) -> tuple:
        ctx.set_materialize_grads(False)
        ctx.sharding, ctx.group, ctx.seen, ctx.head_dim = sharding, group, seen, k.shape[-1]
        whole = whole_keys(k, v, sharding, group)
        ctx.local_shape = (k.shape[_SEQUENCE_DIM], *k.shape[:_SEQUENCE_DIM], whole.shape[-1])
        views = []
        for keys in seen:
            views += [whole[:, :, keys, : ctx.head_dim], whole[:, :, keys, ctx.head_dim :]]
        return tuple(views)

    @staticmethod
    def backward(ctx, *grads):
        sharding, head_dim = ctx.sharding, ctx.head_dim
        local_shape = ctx.local_shape
        some = next(g for g in grads if g is not None)
        buffer = gradient_buffer(some, local_shape, ctx.group)
        size, places = sharding.chunk_length, sharding.gathered_order()
        for index, keys in enumerate(ctx.seen):
            for grad, columns in (
                (grads[2 * index], slice(None, head_dim)),
                (grads[2 * index + 1], slice(head_dim, None)),
            ):
                if grad is None or not size:
                    continue
                for chunk in range(keys.start // size, -(-keys.stop // size)):
                    lo, hi = max(keys.start, chunk * size), min(keys.stop, (chunk + 1) * size)
                    at = places[chunk] * size + lo - chunk * size
                    part = grad.narrow(_SEQUENCE_DIM, lo - keys.start, hi - lo).movedim(_SEQUENCE_DIM, 0)
                    buffer[at : at + hi - lo, ..., columns] += part
        local = reduce_scatter(buffer, ctx.group).to(some.dtype)
        dk = local[..., :head_dim].movedim(0, _SEQUENCE_DIM)
        dv = local[..., head_dim:].movedim(0, _SEQUENCE_DIM)
        return dk, dv, None, None, None


def _chunk_seed(seed: Tensor | None, span: Span):
    """Where a chunk's call draws its dropout seed: the call's (every rank's rank-0 seed) with
    the chunk's first position as its first row, so that the chunks draw the whole sequence's
    mask; nothing without dropout."""
    if seed is None:
        return contextlib.nullcontext()
    return dropout.drawn_as(dropout.with_first_row(seed, span.start))


def _chunk_bias(attn_bias: Tensor | None, span: Span, keys: slice) -> Tensor | None:
    """The view of the whole sequence's attn_bias that a chunk's call adds: its queries' rows and
    the keys it is given, where those dims are not broadcast (size 1). Its gradient flows back
    through the view into attn_bias's."""
    if attn_bias is None:
        return None
    bias = attn_bias
    if bias.dim() >= 2 and bias.shape[-2] > 1:
        bias = bias.narrow(-2, span.start, span.length)
    if bias.dim() >= 1 and bias.shape[-1] > 1:
        bias = bias.narrow(-1, keys.start, keys.stop - keys.start)
    return bias


def _keys_seen(span: Span, is_causal: bool, window_size, length: int) -> slice:
    """The keys a chunk of queries is given: all of them without causal masking; with it, those
    up to its last query (aligned with its end), from its first query's window on."""
    if not is_causal:
        return slice(0, length)
    left = -1 if window_size is None else window_size[0]
    start = 0 if left < 0 else max(0, span.start - left)
    return slice(start, span.stop)

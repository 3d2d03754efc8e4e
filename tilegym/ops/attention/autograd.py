"""The torch.autograd.Function that ties the training forward to the backward kernels."""

import torch

from tilegym.ops.attention import launch
from tilegym.ops.attention.packing import CuSeqlens
from tilegym.ops.attention.problem import AttentionProblem
from tilegym.ops.attention.score_mods import ModTensors


class AttentionFunction(torch.autograd.Function):
    """(out, lse), differentiable in q, k, v, attn_bias, sinks and the caller's aux tensors (with
    its aux_grad) through both outputs. Saves q, k, v, out and the LSE; the backward recomputes
    the probabilities from them.

    attn_bias and sinks are inputs so that they can receive a gradient; the kernels read
    mod_tensors, their normalized views, and the ALiBi slopes from there (no gradient).
    A gradient of the LSE folds into the backward's row statistic: dLSE_i adds dLSE_i * P_ij
    to each score's gradient, which is Delta_i - dLSE_i in place of Delta_i.
    """

    @staticmethod
    def forward(ctx, q, k, v, attn_bias, sinks, problem: AttentionProblem, mod_tensors: ModTensors, *aux):
        out, lse = launch.forward(q, k, v, problem, with_lse=True, mod_tensors=mod_tensors)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.problem = problem
        ctx.mod_tensors = mod_tensors
        ctx.sinks_dtype = None if sinks is None else sinks.dtype
        ctx.aux_dtypes = [t.dtype for t in aux]
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        if d_out is None:  # only the LSE was used
            d_out = torch.zeros_like(out)
        grads = launch.backward(
            d_out, q, k, v, out, lse, ctx.problem, mod_tensors=ctx.mod_tensors,
            bias_grad=ctx.needs_input_grad[3], d_lse=d_lse, sinks_grad=ctx.needs_input_grad[4],
        )  # fmt: skip
        d_sinks = None if grads.d_sinks is None else grads.d_sinks.to(ctx.sinks_dtype)
        return grads.dq, grads.dk, grads.dv, grads.d_bias, d_sinks, None, None, *_aux_grads(ctx, grads, 7)


class PackedAttentionFunction(torch.autograd.Function):
    """AttentionFunction of a packed batch: q, k, v [total, H, D], out [total_q, Hq, Dv], lse
    [Hq, total_q], all new tensors (no views, so callers may change them in place)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, problem: AttentionProblem, mod_tensors: ModTensors, cu_seqlens: CuSeqlens, *aux):
        out, lse = launch.forward_packed(q, k, v, problem, True, mod_tensors, cu_seqlens)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.problem = problem
        ctx.mod_tensors = mod_tensors
        ctx.cu_seqlens = cu_seqlens
        ctx.sinks_dtype = None if sinks is None else sinks.dtype
        ctx.aux_dtypes = [t.dtype for t in aux]
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, out, lse = ctx.saved_tensors
        if d_out is None:
            d_out = torch.zeros_like(out)
        grads = launch.backward_packed(
            d_out, q, k, v, out, lse, ctx.problem, ctx.mod_tensors, ctx.cu_seqlens, d_lse, ctx.needs_input_grad[3]
        )  # fmt: skip
        d_sinks = None if grads.d_sinks is None else grads.d_sinks.to(ctx.sinks_dtype)
        return grads.dq, grads.dk, grads.dv, d_sinks, None, None, None, *_aux_grads(ctx, grads, 7)


def _aux_grads(ctx, grads: launch.Gradients, first: int) -> list:
    """The aux tensors' gradients in their dtypes, None for those that want none; first: the
    index of the first aux tensor among the inputs of forward."""
    if grads.d_aux is None:
        return [None] * len(ctx.aux_dtypes)
    wanted = ctx.needs_input_grad[first:]
    return [d.to(dtype) if want else None for d, dtype, want in zip(grads.d_aux, ctx.aux_dtypes, wanted, strict=True)]

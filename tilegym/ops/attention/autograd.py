"""The torch.autograd.Function that ties the training forward to the backward kernels."""

import torch

from tilegym.ops.attention import launch
from tilegym.ops.attention.problem import AttentionProblem
from tilegym.ops.attention.score_mods import ModTensors


class AttentionFunction(torch.autograd.Function):
    """Saves q, k, v, out and the LSE; the backward recomputes the probabilities from them.

    attn_bias is an input so that it can receive a gradient; the kernels read mod_tensors,
    its normalized view, and the ALiBi slopes from there (they take no gradient).
    """

    @staticmethod
    def forward(ctx, q, k, v, attn_bias, problem: AttentionProblem, mod_tensors: ModTensors):
        out, lse = launch.forward(q, k, v, problem, with_lse=True, mod_tensors=mod_tensors)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.problem = problem
        ctx.mod_tensors = mod_tensors
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        bias_grad = ctx.needs_input_grad[3]
        dq, dk, dv, d_bias = launch.backward(
            d_out, q, k, v, out, lse, ctx.problem, mod_tensors=ctx.mod_tensors, bias_grad=bias_grad
        )
        return dq, dk, dv, d_bias, None, None

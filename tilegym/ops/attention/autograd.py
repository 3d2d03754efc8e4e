"""The torch.autograd.Function that ties the training forward to the backward kernels."""

import torch

from tilegym.ops.attention import launch


class AttentionFunction(torch.autograd.Function):
    """Saves q, k, v, out and the LSE; the backward recomputes the probabilities from them."""

    @staticmethod
    def forward(ctx, q, k, v, problem: launch.AttentionProblem):
        out, lse = launch.forward(q, k, v, problem, with_lse=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.problem = problem
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = launch.backward(d_out, q, k, v, out, lse, ctx.problem)
        return dq, dk, dv, None

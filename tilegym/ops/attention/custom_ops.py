"""The attention entry points as torch.library custom operators, for torch.compile.

Dynamo cannot trace into the launch code (it graph-breaks on the problem's dataclasses and
warns on every cuTile call), so under torch.compile the public functions call these operators
instead: opaque nodes with fake implementations for shapes, and a registered backward, so a
compiled training step keeps one graph (fullgraph=True holds). Eager calls keep the direct path
(AttentionFunction) and pay no operator dispatch.

Operator arguments are tensors and plain values only, so each operator validates its own
arguments (problem.check_inputs): at trace time in its fake implementation, with the same
errors as eager calls, and again when it runs.
"""

import torch
from torch import Tensor

from tilegym.ops.attention import launch
from tilegym.ops.attention.problem import check_inputs

_NAMESPACE = "tilegym"


def _problem(q, k, v, attn_bias, alibi_slopes, sinks, scaling, is_causal, window_size, softcap, bias_grad):
    return check_inputs(
        q, k, v, scaling, is_causal, attn_bias, None if window_size is None else tuple(window_size), softcap,
        alibi_slopes, bias_grad=bias_grad, sinks=sinks,
    )  # fmt: skip


def _absent(q: Tensor) -> Tensor:
    """An output the call does not produce (lse without with_lse, d_bias without bias_grad):
    the schema has no optional outputs."""
    return q.new_empty(0, dtype=torch.float32)


@torch.library.custom_op(f"{_NAMESPACE}::attention", mutates_args=())
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_bias: Tensor | None,
    alibi_slopes: Tensor | None,
    sinks: Tensor | None,
    scaling: float | None,
    is_causal: bool,
    window_size: list[int] | None,
    softcap: float | None,
    with_lse: bool,
) -> tuple[Tensor, Tensor]:
    """(out, lse); lse is empty unless with_lse."""
    args = (q, k, v, attn_bias, alibi_slopes, sinks, scaling, is_causal, window_size, softcap)
    problem, mod_tensors = _problem(*args, bias_grad=False)
    out, lse = launch.forward(q, k, v, problem, with_lse=with_lse, mod_tensors=mod_tensors)
    return out, _absent(q) if lse is None else lse


@attention.register_fake
def _attention_fake(q, k, v, attn_bias, alibi_slopes, sinks, scaling, is_causal, window_size, softcap, with_lse):
    args = (q, k, v, attn_bias, alibi_slopes, sinks, scaling, is_causal, window_size, softcap)
    problem, _ = _problem(*args, bias_grad=False)
    out = launch.output(q, problem)
    return out, launch.row_stat(problem, q.device) if with_lse else _absent(q)


@torch.library.custom_op(f"{_NAMESPACE}::attention_backward", mutates_args=())
def attention_backward(
    d_out: Tensor,
    d_lse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    attn_bias: Tensor | None,
    alibi_slopes: Tensor | None,
    sinks: Tensor | None,
    scaling: float | None,
    is_causal: bool,
    window_size: list[int] | None,
    softcap: float | None,
    bias_grad: bool,
    sinks_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, d_bias, d_sinks); d_bias is empty unless bias_grad, d_sinks unless sinks_grad."""
    args = (q, k, v, attn_bias, alibi_slopes, sinks, scaling, is_causal, window_size, softcap)
    problem, mod_tensors = _problem(*args, bias_grad=bias_grad)
    grads = launch.backward(
        d_out, q, k, v, out, lse, problem, mod_tensors=mod_tensors, bias_grad=bias_grad, d_lse=d_lse,
        sinks_grad=sinks_grad,
    )  # fmt: skip
    d_bias = _absent(q) if grads.d_bias is None else grads.d_bias
    d_sinks = _absent(q) if grads.d_sinks is None else grads.d_sinks.to(sinks.dtype)
    return grads.dq, grads.dk, grads.dv, d_bias, d_sinks


@attention_backward.register_fake
def _attention_backward_fake(
    d_out, d_lse, q, k, v, out, lse, attn_bias, alibi_slopes, sinks, scaling, is_causal, window_size, softcap,
    bias_grad, sinks_grad,
):  # fmt: skip
    grads = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)]
    d_bias = attn_bias.new_empty(attn_bias.shape) if bias_grad else _absent(q)  # contiguous, as summed
    d_sinks = sinks.new_empty(sinks.shape) if sinks_grad else _absent(q)
    return (*grads, d_bias, d_sinks)


def _setup_context(ctx, inputs, output):
    q, k, v, attn_bias, alibi_slopes, sinks, scaling, is_causal, window_size, softcap, with_lse = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_bias, alibi_slopes, sinks)
    ctx.set_materialize_grads(False)  # an unused LSE's gradient arrives as None, not zeros
    ctx.settings = (scaling, is_causal, window_size, softcap)


def _backward(ctx, d_out, d_lse):
    q, k, v, out, lse, attn_bias, alibi_slopes, sinks = ctx.saved_tensors
    bias_grad, sinks_grad = ctx.needs_input_grad[3], ctx.needs_input_grad[5]
    if d_out is None:
        d_out = torch.zeros_like(out)
    if d_lse is not None and d_lse.shape != lse.shape:  # the empty LSE of a call without one
        d_lse = None
    dq, dk, dv, d_bias, d_sinks = attention_backward(
        d_out, d_lse, q, k, v, out, lse, attn_bias, alibi_slopes, sinks, *ctx.settings, bias_grad, sinks_grad
    )  # fmt: skip
    d_bias = d_bias if bias_grad else None
    d_sinks = d_sinks if sinks_grad else None
    return dq, dk, dv, d_bias, None, d_sinks, None, None, None, None, None


attention.register_autograd(_backward, setup_context=_setup_context)

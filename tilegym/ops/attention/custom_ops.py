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
from tilegym.ops.attention.packing import check_packed_inputs
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


# ---- packed variable-length batches ----------------------------------------------------------


def _packed_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, sinks, scaling,
                    is_causal, window_size, softcap, read_contents=True):  # fmt: skip
    return check_packed_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scaling, is_causal,
        None if window_size is None else tuple(window_size), softcap, alibi_slopes, sinks, read_contents,
    )  # fmt: skip


@torch.library.custom_op(f"{_NAMESPACE}::attention_varlen", mutates_args=())
def attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    alibi_slopes: Tensor | None,
    sinks: Tensor | None,
    scaling: float | None,
    is_causal: bool,
    window_size: list[int] | None,
    softcap: float | None,
) -> tuple[Tensor, Tensor]:
    """(out [total_q, Hq, Dv], lse [Hq, total_q]) of a packed batch (api.tile_fmha_varlen)."""
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, sinks, scaling, is_causal,
            window_size, softcap)  # fmt: skip
    problem, mod_tensors, cu_seqlens = _packed_problem(*args)
    return launch.forward_packed(q, k, v, problem, True, mod_tensors, cu_seqlens)


@attention_varlen.register_fake
def _attention_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, sinks,
                           scaling, is_causal, window_size, softcap):  # fmt: skip
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, sinks, scaling, is_causal,
            window_size, softcap)  # fmt: skip
    _packed_problem(*args, read_contents=False)
    stat_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2])), q.new_empty((q.shape[1], q.shape[0]), dtype=stat_dtype)


@torch.library.custom_op(f"{_NAMESPACE}::attention_varlen_backward", mutates_args=())
def attention_varlen_backward(
    d_out: Tensor,
    d_lse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    alibi_slopes: Tensor | None,
    sinks: Tensor | None,
    scaling: float | None,
    is_causal: bool,
    window_size: list[int] | None,
    softcap: float | None,
    sinks_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, d_sinks) of a packed batch; d_sinks is empty unless sinks_grad."""
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, sinks, scaling, is_causal,
            window_size, softcap)  # fmt: skip
    problem, mod_tensors, cu_seqlens = _packed_problem(*args)
    grads = launch.backward_packed(d_out, q, k, v, out, lse, problem, mod_tensors, cu_seqlens, d_lse, sinks_grad)
    d_sinks = _absent(q) if grads.d_sinks is None else grads.d_sinks.to(sinks.dtype)
    return grads.dq, grads.dk, grads.dv, d_sinks


@attention_varlen_backward.register_fake
def _attention_varlen_backward_fake(d_out, d_lse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, alibi_slopes, sinks, scaling, is_causal, window_size, softcap,
                                    sinks_grad):  # fmt: skip
    grads = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)]
    d_sinks = sinks.new_empty(sinks.shape) if sinks_grad else _absent(q)
    return (*grads, d_sinks)


def _setup_varlen_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, sinks, *settings = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks)
    ctx.set_materialize_grads(False)
    ctx.lengths = (max_seqlen_q, max_seqlen_k)
    ctx.settings = tuple(settings)


def _varlen_backward(ctx, d_out, d_lse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks = ctx.saved_tensors
    sinks_grad = ctx.needs_input_grad[8]
    if d_out is None:
        d_out = torch.zeros_like(out)
    dq, dk, dv, d_sinks = attention_varlen_backward(
        d_out, d_lse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.lengths, alibi_slopes, sinks,
        *ctx.settings, sinks_grad,
    )  # fmt: skip
    return dq, dk, dv, None, None, None, None, None, d_sinks if sinks_grad else None, None, None, None, None


attention_varlen.register_autograd(_varlen_backward, setup_context=_setup_varlen_context)

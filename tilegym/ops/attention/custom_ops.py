"""The attention entry points as torch.library custom operators, for torch.compile.

Dynamo cannot trace into the launch code (it graph-breaks on the problem's dataclasses and
warns on every cuTile call), so under torch.compile the public functions call these operators
instead: opaque nodes with fake implementations for shapes, and a registered backward, so a
compiled training step keeps one graph (fullgraph=True holds). Eager calls keep the direct path
(AttentionFunction) and pay no operator dispatch.

Operator arguments are tensors and plain values only, so each operator validates its own
arguments (problem.check_inputs): at trace time in its fake implementation, with the same
errors as eager calls, and again when it runs. The caller's score and mask functions travel as
the key they are registered under (caller_functions.operator_key), their tensors as lists.
"""

import torch
from torch import Tensor

from tilegym.ops.attention import dropout, launch
from tilegym.ops.attention.caller_functions import from_operator
from tilegym.ops.attention.packing import check_packed_inputs
from tilegym.ops.attention.problem import check_inputs

_NAMESPACE = "tilegym"


def _problem(q, k, v, attn_bias, alibi_slopes, sinks, scaling, is_causal, window_size, softcap, functions, aux,
             mask_aux, dropout_p, dropout_seed, bias_grad):  # fmt: skip
    problem, mod_tensors = check_inputs(
        q, k, v, scaling, is_causal, attn_bias, None if window_size is None else tuple(window_size), softcap,
        alibi_slopes, bias_grad=bias_grad, sinks=sinks,
    )  # fmt: skip
    given = from_operator(functions, aux, mask_aux)
    if given is not None:
        # The key holds aux_grad only where an aux tensor takes a gradient; training's checks ran
        # when it was made.
        problem, mod_tensors = given.check(q, problem, mod_tensors, False, wants_aux_grad=given.aux_grad is not None)
    return _dropped(problem, mod_tensors, dropout_p, dropout_seed, q.device)


def _dropped(problem, mod_tensors, dropout_p: float, dropout_seed, device):
    """problem and mod_tensors with the operator's dropout: its seed drawn by the caller, in the
    graph, so that a compiled call draws a new one each time and its backward reuses it."""
    rate = dropout.check_rate(dropout_p)
    if rate and dropout_seed is None:
        raise ValueError("dropout_p > 0 needs a dropout_seed (dropout.new_seed)")
    return dropout.with_dropout(problem, mod_tensors, rate, device, dropout_seed)


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
    functions: str,
    aux: list[Tensor],
    mask_aux: list[Tensor],
    dropout_p: float = 0.0,
    dropout_seed: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(out, lse); lse is empty unless with_lse. functions: the key of the caller's functions
    ("" for none), aux and mask_aux their tensors; dropout_seed: dropout.new_seed's, with dropout_p."""
    args = (q, k, v, attn_bias, alibi_slopes, sinks, scaling, is_causal, window_size, softcap, functions, aux, mask_aux,
            dropout_p, dropout_seed)  # fmt: skip
    problem, mod_tensors = _problem(*args, bias_grad=False)
    out, lse = launch.forward(q, k, v, problem, with_lse=with_lse, mod_tensors=mod_tensors)
    return out, _absent(q) if lse is None else lse


@attention.register_fake
def _attention_fake(q, k, v, attn_bias, alibi_slopes, sinks, scaling, is_causal, window_size, softcap, with_lse,
                    functions, aux, mask_aux, dropout_p=0.0, dropout_seed=None):  # fmt: skip
    args = (q, k, v, attn_bias, alibi_slopes, sinks, scaling, is_causal, window_size, softcap, functions, aux, mask_aux,
            dropout_p, dropout_seed)  # fmt: skip
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
    functions: str,
    aux: list[Tensor],
    mask_aux: list[Tensor],
    dropout_p: float = 0.0,
    dropout_seed: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
    """(dq, dk, dv, d_bias, d_sinks, d_aux); d_bias is empty unless bias_grad, d_sinks unless
    sinks_grad, d_aux unless the functions' key holds an aux_grad (then one per aux tensor, in
    its dtype). dropout_p and dropout_seed: the forward's."""
    args = (q, k, v, attn_bias, alibi_slopes, sinks, scaling, is_causal, window_size, softcap, functions, aux, mask_aux,
            dropout_p, dropout_seed)  # fmt: skip
    problem, mod_tensors = _problem(*args, bias_grad=bias_grad)
    grads = launch.backward(
        d_out, q, k, v, out, lse, problem, mod_tensors=mod_tensors, bias_grad=bias_grad, d_lse=d_lse,
        sinks_grad=sinks_grad,
    )  # fmt: skip
    d_bias = _absent(q) if grads.d_bias is None else grads.d_bias
    d_sinks = _absent(q) if grads.d_sinks is None else grads.d_sinks.to(sinks.dtype)
    return grads.dq, grads.dk, grads.dv, d_bias, d_sinks, _aux_gradients(grads, aux)


@attention_backward.register_fake
def _attention_backward_fake(
    d_out, d_lse, q, k, v, out, lse, attn_bias, alibi_slopes, sinks, scaling, is_causal, window_size, softcap,
    bias_grad, sinks_grad, functions, aux, mask_aux, dropout_p=0.0, dropout_seed=None,
):  # fmt: skip
    grads = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)]
    d_bias = attn_bias.new_empty(attn_bias.shape) if bias_grad else _absent(q)  # contiguous, as summed
    d_sinks = sinks.new_empty(sinks.shape) if sinks_grad else _absent(q)
    return (*grads, d_bias, d_sinks, _fake_aux_gradients(functions, aux, mask_aux))


def _setup_context(ctx, inputs, output):
    # The dispatcher fills in the dropout arguments' defaults where the call left them out.
    q, k, v, attn_bias, alibi_slopes, sinks, scaling, is_causal, window_size, softcap, _, key, *lists = inputs
    aux, mask_aux, dropout_p, dropout_seed = lists
    out, lse = output
    _save(ctx, (q, k, v, out, lse, attn_bias, alibi_slopes, sinks, dropout_seed), key, aux, mask_aux)
    ctx.settings = (scaling, is_causal, window_size, softcap)
    ctx.dropout = (dropout_p, _dropout_gradients(dropout_seed))


def _dropout_gradients(dropout_seed) -> int:
    """How many gradients (all None) the backward returns for the dropout arguments: the
    autograd wrapper counts the inputs the call passed, and api passes both (with a seed) or
    neither."""
    return 0 if dropout_seed is None else 2


def _save(ctx, tensors: tuple, key: str, aux: list, mask_aux: list) -> None:
    """Saves an operator's tensors, the caller's functions' after them (_saved reads them back)."""
    ctx.save_for_backward(*tensors, *aux, *mask_aux)
    ctx.set_materialize_grads(False)  # an unused LSE's gradient arrives as None, not zeros
    ctx.functions = (len(tensors), key, len(aux))


def _saved(ctx) -> tuple:
    """(the tensors _save was given, the functions' key, aux, mask_aux)."""
    count, key, aux_count = ctx.functions
    saved = ctx.saved_tensors
    user_tensors = saved[count:]
    return saved[:count], key, list(user_tensors[:aux_count]), list(user_tensors[aux_count:])


def _backward(ctx, d_out, d_lse):
    (q, k, v, out, lse, attn_bias, alibi_slopes, sinks, dropout_seed), key, aux, mask_aux = _saved(ctx)
    bias_grad, sinks_grad = ctx.needs_input_grad[3], ctx.needs_input_grad[5]
    if d_out is None:
        d_out = torch.zeros_like(out)
    if d_lse is not None and d_lse.shape != lse.shape:  # the empty LSE of a call without one
        d_lse = None
    dq, dk, dv, d_bias, d_sinks, d_aux = attention_backward(
        d_out, d_lse, q, k, v, out, lse, attn_bias, alibi_slopes, sinks, *ctx.settings, bias_grad, sinks_grad,
        key, aux, mask_aux, ctx.dropout[0], dropout_seed,
    )  # fmt: skip
    d_bias = d_bias if bias_grad else None
    d_sinks = d_sinks if sinks_grad else None
    d_aux = _wanted_aux_gradients(d_aux, aux, ctx.needs_input_grad[12])
    return (dq, dk, dv, d_bias, None, d_sinks, None, None, None, None, None, None, d_aux, [None] * len(mask_aux),
            *[None] * ctx.dropout[1])  # fmt: skip


attention.register_autograd(_backward, setup_context=_setup_context)


def _aux_gradients(grads: launch.Gradients, aux: list) -> list:
    """The aux tensors' gradients in their dtypes; none where the key holds no aux_grad."""
    return [] if grads.d_aux is None else [d.to(t.dtype) for d, t in zip(grads.d_aux, aux, strict=True)]


def _fake_aux_gradients(functions: str, aux: list, mask_aux: list) -> list:
    given = from_operator(functions, aux, mask_aux)
    return [t.new_empty(t.shape) for t in aux] if given is not None and given.aux_grad is not None else []


def _wanted_aux_gradients(d_aux: list, aux: list, wanted) -> list:
    """A gradient per aux tensor (the operator's list input), None where autograd wants none."""
    if not d_aux:
        return [None] * len(aux)
    return [d if want else None for d, want in zip(d_aux, wanted, strict=True)]


# ---- packed variable-length batches ----------------------------------------------------------


def _packed_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, sinks, scaling,
                    is_causal, window_size, softcap, functions, aux, mask_aux, dropout_p, dropout_seed,
                    read_contents=True):  # fmt: skip
    problem, mod_tensors, cu_seqlens = check_packed_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scaling, is_causal,
        None if window_size is None else tuple(window_size), softcap, alibi_slopes, sinks, read_contents,
    )  # fmt: skip
    given = from_operator(functions, aux, mask_aux)
    if given is not None:
        problem, mod_tensors = given.check(
            q, problem, mod_tensors, False, cu_seqlens, wants_aux_grad=given.aux_grad is not None
        )  # fmt: skip
    problem, mod_tensors = _dropped(problem, mod_tensors, dropout_p, dropout_seed, q.device)
    return problem, mod_tensors, cu_seqlens


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
    functions: str,
    aux: list[Tensor],
    mask_aux: list[Tensor],
    dropout_p: float = 0.0,
    dropout_seed: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(out [total_q, Hq, Dv], lse [Hq, total_q]) of a packed batch (api.tile_fmha_varlen);
    functions, aux, mask_aux and dropout as attention's."""
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, sinks, scaling, is_causal,
            window_size, softcap, functions, aux, mask_aux, dropout_p, dropout_seed)  # fmt: skip
    problem, mod_tensors, cu_seqlens = _packed_problem(*args)
    return launch.forward_packed(q, k, v, problem, True, mod_tensors, cu_seqlens)


@attention_varlen.register_fake
def _attention_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, sinks,
                           scaling, is_causal, window_size, softcap, functions, aux, mask_aux, dropout_p=0.0,
                           dropout_seed=None):  # fmt: skip
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, sinks, scaling, is_causal,
            window_size, softcap, functions, aux, mask_aux, dropout_p, dropout_seed)  # fmt: skip
    problem, _, _ = _packed_problem(*args, read_contents=False)
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=problem.stat_dtype)
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2])), lse


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
    functions: str,
    aux: list[Tensor],
    mask_aux: list[Tensor],
    dropout_p: float = 0.0,
    dropout_seed: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
    """(dq, dk, dv, d_sinks, d_aux) of a packed batch; d_sinks is empty unless sinks_grad, d_aux
    as attention_backward's; dropout_p and dropout_seed: the forward's."""
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, sinks, scaling, is_causal,
            window_size, softcap, functions, aux, mask_aux, dropout_p, dropout_seed)  # fmt: skip
    problem, mod_tensors, cu_seqlens = _packed_problem(*args)
    grads = launch.backward_packed(d_out, q, k, v, out, lse, problem, mod_tensors, cu_seqlens, d_lse, sinks_grad)
    d_sinks = _absent(q) if grads.d_sinks is None else grads.d_sinks.to(sinks.dtype)
    return grads.dq, grads.dk, grads.dv, d_sinks, _aux_gradients(grads, aux)


@attention_varlen_backward.register_fake
def _attention_varlen_backward_fake(d_out, d_lse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, alibi_slopes, sinks, scaling, is_causal, window_size, softcap,
                                    sinks_grad, functions, aux, mask_aux, dropout_p=0.0,
                                    dropout_seed=None):  # fmt: skip
    grads = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)]
    d_sinks = sinks.new_empty(sinks.shape) if sinks_grad else _absent(q)
    return (*grads, d_sinks, _fake_aux_gradients(functions, aux, mask_aux))


def _setup_varlen_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, sinks, *settings = inputs
    *settings, key, aux, mask_aux, dropout_p, dropout_seed = settings
    out, lse = output
    saved = (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, dropout_seed)
    _save(ctx, saved, key, aux, mask_aux)
    ctx.lengths = (max_seqlen_q, max_seqlen_k)
    ctx.settings = tuple(settings)
    ctx.dropout = (dropout_p, _dropout_gradients(dropout_seed))


def _varlen_backward(ctx, d_out, d_lse):
    (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, dropout_seed), key, aux, mask_aux = _saved(ctx)
    sinks_grad = ctx.needs_input_grad[8]
    if d_out is None:
        d_out = torch.zeros_like(out)
    dq, dk, dv, d_sinks, d_aux = attention_varlen_backward(
        d_out, d_lse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.lengths, alibi_slopes, sinks,
        *ctx.settings, sinks_grad, key, aux, mask_aux, ctx.dropout[0], dropout_seed,
    )  # fmt: skip
    d_aux = _wanted_aux_gradients(d_aux, aux, ctx.needs_input_grad[14])
    return (dq, dk, dv, None, None, None, None, None, d_sinks if sinks_grad else None, None, None, None, None, None,
            d_aux, [None] * len(mask_aux), *[None] * ctx.dropout[1])  # fmt: skip


attention_varlen.register_autograd(_varlen_backward, setup_context=_setup_varlen_context)

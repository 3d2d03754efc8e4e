"""The public attention functions; argument checks happen in problem.check_inputs, before any launch.

Shapes: q ``[B, Hq, Sq, D]``; k ``[B, Hkv, Sk, D]``; v ``[B, Hkv, Sk, Dv]`` with Hq a multiple of
Hkv (GQA/MQA: query head h reads key/value head ``h // (Hq // Hkv)``); the output is
``[B, Hq, Sq, Dv]`` in q's dtype. Any strides work as long as the head dim is contiguous (a
``[B, S, H, D]`` tensor transposed to ``[B, H, S, D]`` is used without a copy). Dtypes: float16,
bfloat16, float32, float64, one for q, k and v. Head dims, D and Dv each: 32, 64, 80, 96, 128,
192, 256.

Causal masking is bottom-right aligned (as FlashAttention since 2.1; SDPA's ``is_causal`` is
top-left): query i sees key j iff ``j <= i + (Sk - Sq)``. For Sq = 3, Sk = 5 (x: seen)::

    keys:     0 1 2 3 4
    query 0:  x x x . .
    query 1:  x x x x .
    query 2:  x x x x x

A query that sees no key (Sq > Sk, or a window or bias that hides every key) outputs zeros,
has LSE -inf and gets zero gradients.

Score modifiers, keyword arguments of every function (score_mods.py has the exact math):

- attn_bias: a tensor broadcastable to ``[B, Hq, Sq, Sk]``, q's dtype or float32, added to the
  scaled scores; it receives a gradient (summed over its broadcast dims) when it requires one.
- window_size=(left, right): query i sees keys ``i + d - left ... i + d + right``, d = Sk - Sq,
  -1 (or any side that reaches every key) unbounded; with is_causal=True the right side is 0.
- softcap: scores become ``softcap * tanh(scores / softcap)`` before the bias (Gemma 2); 0 or
  None: none.
- alibi_slopes: float32 ``[Hq]`` or ``[B, Hq]``; adds ``-slope * |i + d - j|``, no gradient.
- sinks: ``[Hq]``, one logit per query head that joins every row's softmax denominator without
  a value (gpt-oss): ``p_ij = exp(s_ij) / (exp(sink_h) + sum_j exp(s_ij))``. The LSE includes
  it, so a row that sees no key has LSE ``sink_h``. It receives a gradient when it requires one,
  summed over batch and rows in a fixed order.

Score and mask functions written in cuTile, inlined into the kernels (dense and packed batches;
programmable.py and docs/attention.md have the contract):

- score_mod ``(score, b, h, q_idx, kv_idx, aux) -> score`` on natural-unit fp32 score tiles,
  applied after the modifiers above; score_mod_grad ``(grad, score, out, b, h, q_idx, kv_idx,
  aux) -> grad`` its derivative, required for training.
- aux: up to 4 tensors score_mod reads; aux_grad ``(grad, score, b, h, q_idx, kv_idx, aux,
  aux_grads)`` adds their gradients into aux_grads by score_functions.add_to_aux_grad (bitwise
  repeatable under torch.use_deterministic_algorithms(True)).
- mask_mod ``(b, h, q_idx, kv_idx, mask_aux) -> bool`` with mask_aux, or block_mask, a
  create_block_mask result reused across calls; and-ed with is_causal and window_size.

attn_bias, window_size, softcap and alibi_slopes are also functions, score_functions.additive_bias,
sliding_window, softcap and alibi: passed as score_mod or mask_mod they run the kernels' code for
the keyword argument wherever it computes the same (predefined.py).

Training calls (tile_fmha_with_backward, tile_fmha_varlen, tile_fmha_functional) also take
dropout_p: each probability that multiplies V is dropped with that probability and the kept ones
scaled by 1 / (1 - dropout_p) (dropout.py); the LSE is that of the undropped probabilities. Each
call draws its mask from PyTorch's CUDA generator, and its backward sees the same mask.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from tilegym.ops.attention import custom_ops, dropout, launch, predefined
from tilegym.ops.attention.autograd import AttentionFunction, PackedAttentionFunction
from tilegym.ops.attention.block_mask import BlockMask
from tilegym.ops.attention.caller_functions import CallerFunctions, closure_free, operator_key
from tilegym.ops.attention.packing import check_packed_inputs
from tilegym.ops.attention.problem import check_inputs

__all__ = ["tile_fmha", "fmha_forward_with_lse", "tile_fmha_with_backward", "tile_fmha_functional", "tile_fmha_varlen"]

Window = tuple[int, int] | list[int] | None


def tile_fmha(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scaling: float | None = None,
    is_causal: bool = True,
    *,
    attn_bias: Tensor | None = None,
    window_size: Window = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    score_mod: Callable | None = None,
    score_mod_grad: Callable | None = None,
    aux: tuple[Tensor, ...] | None = None,
    aux_grad: Callable | None = None,
    mask_mod: Callable | None = None,
    mask_aux: tuple[Tensor, ...] | None = None,
    block_mask: BlockMask | None = None,
) -> Tensor:
    """Attention output for inference: no LSE is written and nothing is saved for backward.

    Args:
        q: ``[B, Hq, Sq, D]`` queries, on a CUDA device.
        k, v: ``[B, Hkv, Sk, D]`` keys and ``[B, Hkv, Sk, Dv]`` values, q's dtype and device
            (Dv may differ from D).
        scaling: the softmax scale (SDPA's ``scale``); None: ``1 / sqrt(D)``.
        is_causal: bottom-right causal masking. Defaults to True (SDPA: False).
        attn_bias, window_size, softcap, alibi_slopes: score modifiers (see the module docstring).
        score_mod, score_mod_grad, aux, aux_grad, mask_mod, mask_aux, block_mask: score and mask
            functions in cuTile (see the module docstring).
        sinks: ``[Hq]`` one learnable logit per query head that joins each row's softmax
            denominator (gpt-oss); any float dtype, read as float32.

    Returns:
        ``[B, Hq, Sq, Dv]`` in q's dtype.

    Example::

        q = torch.randn(2, 16, 4096, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(2, 4, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        out = tile_fmha(q, k, v, is_causal=True)  # GQA 4:1
    """
    mods = _Mods(attn_bias, window_size, softcap, alibi_slopes, sinks)
    programs = CallerFunctions.of(score_mod, score_mod_grad, aux, aux_grad, mask_mod, mask_aux, block_mask)
    mods, programs = predefined.lower(mods, programs, q, k, is_causal)
    if torch.compiler.is_compiling() and _operator_takes(programs):
        out, _ = _custom_op(q, k, v, scaling, is_causal, mods, programs, with_lse=False, differentiable=False)
        return out
    if programs is not None:
        out, _ = _programmed_forward(q, k, v, scaling, is_causal, mods, programs, with_lse=False)
        return out
    problem, mod_tensors = mods.check(q, k, v, scaling, is_causal)
    out, _ = launch.forward(q, k, v, problem, with_lse=False, mod_tensors=mod_tensors)
    return out


def fmha_forward_with_lse(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scaling: float | None = None,
    is_causal: bool = True,
    *,
    attn_bias: Tensor | None = None,
    window_size: Window = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    score_mod: Callable | None = None,
    score_mod_grad: Callable | None = None,
    aux: tuple[Tensor, ...] | None = None,
    aux_grad: Callable | None = None,
    mask_mod: Callable | None = None,
    mask_aux: tuple[Tensor, ...] | None = None,
    block_mask: BlockMask | None = None,
) -> tuple[Tensor, Tensor]:
    """(out, lse) for inference; arguments as tile_fmha.

    lse is float32 ``[B, Hq, Sq]``: the natural log of the sum, over the keys a row sees, of
    exp(scaled score), the sink's exp included; -inf for a row that sees no key (without sinks).
    No gradient flows: tile_fmha_with_backward(..., return_lse=True) is the differentiable form.
    """
    mods = _Mods(attn_bias, window_size, softcap, alibi_slopes, sinks)
    programs = CallerFunctions.of(score_mod, score_mod_grad, aux, aux_grad, mask_mod, mask_aux, block_mask)
    mods, programs = predefined.lower(mods, programs, q, k, is_causal)
    if torch.compiler.is_compiling() and _operator_takes(programs):
        out, lse = _custom_op(q, k, v, scaling, is_causal, mods, programs, with_lse=True, differentiable=False)
        return out, lse.to(torch.float32)
    if programs is not None:
        out, lse = _programmed_forward(q, k, v, scaling, is_causal, mods, programs, with_lse=True)
        return out, lse.to(torch.float32)
    problem, mod_tensors = mods.check(q, k, v, scaling, is_causal)
    out, lse = launch.forward(q, k, v, problem, with_lse=True, mod_tensors=mod_tensors)
    return out, lse.to(torch.float32)


def tile_fmha_with_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scaling: float | None = None,
    is_causal: bool = True,
    *,
    attn_bias: Tensor | None = None,
    window_size: Window = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    score_mod: Callable | None = None,
    score_mod_grad: Callable | None = None,
    aux: tuple[Tensor, ...] | None = None,
    aux_grad: Callable | None = None,
    mask_mod: Callable | None = None,
    mask_aux: tuple[Tensor, ...] | None = None,
    block_mask: BlockMask | None = None,
    return_lse: bool = False,
    dropout_p: float = 0.0,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention output for training, differentiable with respect to q, k, v, attn_bias and
    sinks; arguments as tile_fmha.

    dropout_p: attention dropout's rate in [0, 1 - 2^-15], rounded to a multiple of 2^-16 (the
    module's docstring); 0: none.

    return_lse: return ``(out, lse)``, gradients flowing from both. lse is the natural log of each
    row's softmax denominator, ``[B, Hq, Sq]`` float32 (float64 for float64 inputs), -inf for a
    row that sees no key (without sinks). Its gradient folds into the backward at no extra pass:
    merging attention computed over chunks (context parallelism) needs it.

    Example::

        q, k, v = (torch.randn(4, 16, 4096, 128, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        out = tile_fmha_with_backward(q, k, v)  # causal
        out.sum().backward()                    # q.grad, k.grad, v.grad
    """
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    rate = dropout.check_rate(dropout_p)
    mods = _Mods(attn_bias, window_size, softcap, alibi_slopes, sinks)
    programs = CallerFunctions.of(score_mod, score_mod_grad, aux, aux_grad, mask_mod, mask_aux, block_mask)
    mods, programs = predefined.lower(mods, programs, q, k, is_causal)
    if torch.compiler.is_compiling() and _operator_takes(programs):
        out, lse = _custom_op(
            q, k, v, scaling, is_causal, mods, programs, with_lse=True, differentiable=True, rate=rate
        )
        return (out, lse) if return_lse else out
    if programs is not None:
        out, lse = _programmed_training(q, k, v, scaling, is_causal, mods, programs, rate)
        return (out, lse) if return_lse else out
    problem, mod_tensors = mods.check(q, k, v, scaling, is_causal)
    problem, mod_tensors = dropout.with_dropout(problem, mod_tensors, rate, q.device)
    # mods.attn_bias, not attn_bias: a ready-made bias function may have become it (predefined.py).
    if _needs_grad(q, k, v, mods.attn_bias, sinks):
        # The backward's kernels compile in the background while the forward's kernel compiles.
        bias_grad = mods.attn_bias is not None and mods.attn_bias.requires_grad
        sinks_grad = sinks is not None and sinks.requires_grad
        launch.compile_backward_ahead(q, k, v, problem, mod_tensors, bias_grad, sinks_grad)
    out, lse = AttentionFunction.apply(q, k, v, mods.attn_bias, sinks, problem, mod_tensors)
    return (out, lse) if return_lse else out


def tile_fmha_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scaling: float | None = None,
    is_causal: bool = True,
    *,
    window_size: Window = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    return_lse: bool = False,
    dropout_p: float = 0.0,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention over a packed batch of variable-length sequences, differentiable with respect to
    q, k, v and sinks. Arguments as FlashAttention's ``flash_attn_varlen_func``.

    Args:
        q: ``[total_q, Hq, D]``, the query rows of every sequence one after another.
        k, v: ``[total_k, Hkv, D]`` and ``[total_k, Hkv, Dv]``, likewise. Any strides with a
            contiguous head dim: q, k, v may be views of one packed ``[total, 3, H, D]`` tensor.
        cu_seqlens_q, cu_seqlens_k: int32 ``[N + 1]`` on q's device, the cumulative lengths:
            sequence s has query rows ``cu_seqlens_q[s]:cu_seqlens_q[s + 1]`` and key rows
            ``cu_seqlens_k[s]:cu_seqlens_k[s + 1]``. Rows past the last sequence are left out
            (output 0, LSE -inf, gradients 0).
        max_seqlen_q, max_seqlen_k: the longest query and key lengths, Python ints (a 0-d tensor
            is read with one host synchronisation). They size the grid: a longer sequence is cut
            to them. Inconsistent cumulative lengths never make a kernel read or write outside
            the tensors (they are clamped on the GPU); ``TILEGYM_CHECK_VARLEN=1`` checks them on
            the host (one synchronisation) and raises instead.
        scaling, is_causal, window_size, softcap, sinks: as tile_fmha, per sequence: causal
            masking is bottom-right within each sequence (query i of a sequence with Lq queries
            and Lk keys sees key j iff ``j <= i + Lk - Lq``).
        alibi_slopes: float32 ``[Hq]`` or ``[N, Hq]`` (one row per sequence).
        return_lse: return ``(out, lse)``, lse ``[Hq, total_q]`` float32 (float64 for float64
            inputs), natural log, gradients flowing from both.
        dropout_p: attention dropout's rate, as tile_fmha_with_backward (rows and
            columns of its mask count within each sequence).

    Returns:
        ``[total_q, Hq, Dv]`` in q's dtype, or ``(out, lse)``.

    Each call runs without a host synchronisation, in CUDA graphs too; the backward is
    deterministic. Example::

        lengths = [1000, 37, 3011]
        cu = torch.tensor([0, 1000, 1037, 4048], dtype=torch.int32, device="cuda")
        q, k, v = (torch.randn(4048, 8, 128, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        out = tile_fmha_varlen(q, k, v, cu, cu, max(lengths), max(lengths))
        out.sum().backward()
    """
    packed = _Packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    mods = _Mods(None, window_size, softcap, alibi_slopes, sinks)
    rate = dropout.check_rate(dropout_p)
    return _packed_attention(q, k, v, scaling, is_causal, mods, packed, return_lse, differentiable=True, rate=rate)


def tile_fmha_functional(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scaling: float | None = None,
    is_causal: bool = True,
    training: bool | None = None,
    *,
    attn_bias: Tensor | None = None,
    window_size: Window = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    score_mod: Callable | None = None,
    score_mod_grad: Callable | None = None,
    aux: tuple[Tensor, ...] | None = None,
    aux_grad: Callable | None = None,
    mask_mod: Callable | None = None,
    mask_aux: tuple[Tensor, ...] | None = None,
    block_mask: BlockMask | None = None,
    return_lse: bool = False,
    cu_seqlens_q: Tensor | None = None,
    cu_seqlens_k: Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    dropout_p: float = 0.0,
) -> Tensor | tuple[Tensor, Tensor]:
    """tile_fmha_with_backward or the inference kernels, by training: True, the differentiable
    path; False, the inference kernels (tile_fmha, or fmha_forward_with_lse with return_lse);
    None, the differentiable path iff grad mode is on and any of q, k, v, attn_bias, sinks
    requires grad. Other arguments as tile_fmha_with_backward.

    With cu_seqlens_q and cu_seqlens_k (and max_seqlen_q, max_seqlen_k), q, k and v are a packed
    batch, as tile_fmha_varlen takes it (no attn_bias); training=False then returns the same
    values without a gradient. A packed batch takes score_mod (b is the sequence, q_idx and kv_idx
    count within it) with its aux tensors and aux_grad, and mask_mod, or a block_mask made
    with the call's cu_seqlens_q and cu_seqlens_k (create_block_mask), seeing the same indices.

    dropout_p > 0 (attention dropout, as tile_fmha_with_backward) takes the differentiable path
    when training is None, and is refused with training=False: the inference kernels drop nothing."""
    rate = dropout.check_rate(dropout_p)
    if training is None:
        training = bool(rate) or _needs_grad(q, k, v, attn_bias, sinks, *CallerFunctions.aux_tensors_of(aux))
    elif not isinstance(training, bool):
        raise TypeError(f"training must be a bool or None, got {type(training).__name__}")
    else:
        dropout.refuse_without_training(dropout_p, rate, training)
    programs = {
        "score_mod": score_mod, "score_mod_grad": score_mod_grad, "aux": aux, "aux_grad": aux_grad,
        "mask_mod": mask_mod, "mask_aux": mask_aux, "block_mask": block_mask,
    }  # fmt: skip
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        if attn_bias is not None:
            raise ValueError(
                "attn_bias is not supported with a packed batch (cu_seqlens_q); use window_size or alibi_slopes"
            )
        packed = _Packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        mods = _Mods(None, window_size, softcap, alibi_slopes, sinks)
        functions = CallerFunctions.of(score_mod, score_mod_grad, aux, aux_grad, mask_mod, mask_aux, block_mask)
        mods, functions = predefined.lower(mods, functions, q, k, is_causal, (cu_seqlens_q, cu_seqlens_k))
        return _packed_attention(q, k, v, scaling, is_causal, mods, packed, return_lse, training, functions, rate)
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if value is not None:
            raise ValueError(f"{name} is given without cu_seqlens_q and cu_seqlens_k: a packed batch needs all four")
    mods = {
        "attn_bias": attn_bias, "window_size": window_size, "softcap": softcap, "alibi_slopes": alibi_slopes,
        "sinks": sinks, **programs,
    }  # fmt: skip
    if training:
        return tile_fmha_with_backward(q, k, v, scaling, is_causal, return_lse=return_lse, dropout_p=rate, **mods)
    if return_lse:
        return fmha_forward_with_lse(q, k, v, scaling, is_causal, **mods)
    return tile_fmha(q, k, v, scaling, is_causal, **mods)


@dataclass(frozen=True)
class _Mods:
    """The score-modifier arguments of one call, as the caller gave them."""

    attn_bias: Tensor | None
    window_size: Window
    softcap: float | None
    alibi_slopes: Tensor | None
    sinks: Tensor | None

    def check(self, q, k, v, scaling, is_causal):
        return check_inputs(
            q, k, v, scaling, is_causal, self.attn_bias, self.window_size, self.softcap, self.alibi_slopes,
            sinks=self.sinks,
        )  # fmt: skip


def _programmed_check(q, k, v, scaling, is_causal, mods: _Mods, programs: CallerFunctions, training: bool):
    problem, mod_tensors = mods.check(q, k, v, scaling, is_causal)
    return programs.check(q, problem, mod_tensors, training)


@torch.compiler.disable
def _programmed_forward(q, k, v, scaling, is_causal, mods: _Mods, programs: CallerFunctions, with_lse: bool):
    """The inference forward with the caller's functions. torch.compile runs it eagerly (a graph
    break) where the operator cannot take them (_operator_takes)."""
    problem, mod_tensors = _programmed_check(q, k, v, scaling, is_causal, mods, programs, training=False)
    return launch.forward(q, k, v, problem, with_lse=with_lse, mod_tensors=mod_tensors)


@torch.compiler.disable
def _programmed_training(q, k, v, scaling, is_causal, mods: _Mods, programs: CallerFunctions, rate: float):
    """(out, lse) through autograd with the caller's functions (see _programmed_forward), and
    dropout at rate."""
    aux = programs.aux_tensors()
    needs_grad = _needs_grad(q, k, v, mods.attn_bias, mods.sinks, *aux)
    problem, mod_tensors = _programmed_check(q, k, v, scaling, is_causal, mods, programs, needs_grad)
    problem, mod_tensors = dropout.with_dropout(problem, mod_tensors, rate, q.device)
    if needs_grad:
        bias_grad = mods.attn_bias is not None and mods.attn_bias.requires_grad
        sinks_grad = mods.sinks is not None and mods.sinks.requires_grad
        launch.compile_backward_ahead(q, k, v, problem, mod_tensors, bias_grad, sinks_grad)
    return AttentionFunction.apply(q, k, v, mods.attn_bias, mods.sinks, problem, mod_tensors, *mod_tensors.aux)


@dataclass(frozen=True)
class _Packed:
    """The packed-batch arguments of one call, as the caller gave them."""

    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int


def _packed_attention(
    q, k, v, scaling, is_causal, mods: _Mods, packed: _Packed, with_lse, differentiable: bool, programs=None, rate=0.0
):
    """out [total_q, Hq, Dv], or with_lse (out, lse [Hq, total_q]), of a packed batch: through
    autograd when differentiable and a gradient is wanted, else the forward alone. programs: the
    caller's score function (CallerFunctions), which positions within each sequence, `b` the sequence.
    rate: dropout's (checked)."""
    if not isinstance(with_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(with_lse).__name__}")
    if torch.compiler.is_compiling() and _operator_takes(programs):
        out, lse = _packed_custom_op(q, k, v, scaling, is_causal, mods, packed, programs, differentiable, rate)
    elif programs is not None:
        out, lse = _programmed_packed(
            q, k, v, scaling, is_causal, mods, packed, with_lse, differentiable, programs, rate
        )  # fmt: skip
    else:
        out, lse = _packed_eager(q, k, v, scaling, is_causal, mods, packed, with_lse, differentiable, rate=rate)
    return (out, lse) if with_lse else out


def _packed_eager(
    q, k, v, scaling, is_causal, mods: _Mods, packed: _Packed, with_lse: bool, differentiable: bool, programs=None,
    rate=0.0,
):  # fmt: skip
    """(out, lse or None) of a packed batch outside torch.compile, with dropout at rate."""
    problem, mod_tensors, cu_seqlens = check_packed_inputs(
        q, k, v, packed.cu_seqlens_q, packed.cu_seqlens_k, packed.max_seqlen_q, packed.max_seqlen_k, scaling,
        is_causal, mods.window_size, mods.softcap, mods.alibi_slopes, mods.sinks,
    )  # fmt: skip
    aux = () if programs is None else programs.aux_tensors()
    needs_grad = differentiable and _needs_grad(q, k, v, mods.sinks, *aux)
    if programs is not None:
        problem, mod_tensors = programs.check(q, problem, mod_tensors, needs_grad, cu_seqlens)
    problem, mod_tensors = dropout.with_dropout(problem, mod_tensors, rate, q.device)
    if needs_grad:
        sinks_grad = mods.sinks is not None and mods.sinks.requires_grad
        launch.compile_backward_ahead(q, k, v, problem, mod_tensors, False, sinks_grad, cu_seqlens)
        return PackedAttentionFunction.apply(q, k, v, mods.sinks, problem, mod_tensors, cu_seqlens, *mod_tensors.aux)
    return launch.forward_packed(q, k, v, problem, with_lse, mod_tensors, cu_seqlens)


# Where the operator cannot take the caller's functions (_operator_takes), torch.compile runs the
# call eagerly, at a graph break.
_programmed_packed = torch.compiler.disable(_packed_eager)


def _packed_custom_op(
    q, k, v, scaling, is_causal, mods: _Mods, packed: _Packed, programs: CallerFunctions | None, differentiable: bool,
    rate: float,
):  # fmt: skip
    """The packed call as custom_ops.attention_varlen (see _custom_op)."""
    training = differentiable and _needs_grad(q, k, v, mods.sinks, *_aux_of(programs))
    functions = _operator_functions(programs, training, differentiable)
    tensors = (q, k, v, mods.alibi_slopes, mods.sinks)
    if not differentiable:
        tensors = _detached(tensors)
    q, k, v, alibi_slopes, sinks = tensors
    window = list(mods.window_size) if isinstance(mods.window_size, tuple) else mods.window_size
    return custom_ops.attention_varlen(
        q, k, v, packed.cu_seqlens_q, packed.cu_seqlens_k, packed.max_seqlen_q, packed.max_seqlen_k, alibi_slopes,
        sinks, scaling, is_causal, window, mods.softcap, *functions, *_operator_dropout(rate, q),
    )  # fmt: skip


def _needs_grad(*tensors) -> bool:
    """Whether autograd will want a gradient of any of these (non-tensors are skipped)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _operator_takes(programs: CallerFunctions | None) -> bool:
    """Whether the operators can take the caller's functions: functions that close over nothing
    (caller_functions says why), and no block mask (an object whose tile lists live in it).
    torch.compile runs other calls eagerly, at a graph break."""
    if programs is None:
        return True
    return programs.block_mask is None and closure_free(*programs.functions)


def _custom_op(
    q, k, v, scaling, is_causal, mods: _Mods, programs: CallerFunctions | None, with_lse: bool, differentiable: bool,
    rate: float = 0.0,
):  # fmt: skip
    """The call as custom_ops.attention, which torch.compile keeps in its graph; the operator
    checks its arguments. Without differentiable, no gradient flows (as in the eager inference
    path). The caller's functions travel as their key (caller_functions.operator_key)."""
    training = differentiable and _needs_grad(q, k, v, mods.attn_bias, mods.sinks, *_aux_of(programs))
    functions = _operator_functions(programs, training, differentiable)
    tensors = (q, k, v, mods.attn_bias, mods.alibi_slopes, mods.sinks)
    if not differentiable:
        tensors = _detached(tensors)
    q, k, v, attn_bias, alibi_slopes, sinks = tensors
    # The schema takes a list of ints; anything else fails its check, which names the argument.
    window = list(mods.window_size) if isinstance(mods.window_size, tuple) else mods.window_size
    return custom_ops.attention(
        q, k, v, attn_bias, alibi_slopes, sinks, scaling, is_causal, window, mods.softcap, with_lse, *functions,
        *_operator_dropout(rate, q),
    )  # fmt: skip


def _operator_dropout(rate: float, q) -> tuple:
    """The operators' (dropout_p, dropout_seed), none without dropout: the seed drawn here, in the
    compiled graph, so that each run of it draws a new one."""
    return (rate, dropout.call_seed(q.device)) if rate else ()


def _aux_of(programs: CallerFunctions | None) -> tuple:
    return () if programs is None else programs.aux_tensors()


def _operator_functions(programs: CallerFunctions | None, training: bool, differentiable: bool) -> tuple:
    """(key, aux, mask_aux): the operators' arguments for the caller's functions, ("", [], [])
    without; the key registers them (caller_functions.operator_key)."""
    if programs is None:
        return "", [], []
    aux, mask_aux = programs.aux_tensors(), CallerFunctions.aux_tensors_of(programs.mask_aux)
    aux_requires_grad = any(isinstance(t, torch.Tensor) and t.requires_grad for t in aux)
    key = operator_key(*programs.functions, training, aux_requires_grad)
    return key, list(aux if differentiable else _detached(aux)), list(mask_aux)


def _detached(tensors: tuple) -> tuple:
    """tensors without autograd history (non-tensors, None included, as they are)."""
    return tuple([t.detach() if isinstance(t, torch.Tensor) else t for t in tensors])

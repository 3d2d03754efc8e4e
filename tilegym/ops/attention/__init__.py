"""Fused multi-head attention for inference and training, written in cuTile.

Shapes: q [B, Hq, Sq, D]; k, v [B, Hkv, Sk, D] with Hq a multiple of Hkv (GQA/MQA);
the output is shaped and typed like q. Causal masking is bottom-right aligned: query i
attends to key j iff j <= i + (Sk - Sq); a query that sees no key outputs zeros.

Every function also takes these keyword arguments (see score_mods.py for the exact math):
- attn_bias: a tensor broadcastable to [B, Hq, Sq, Sk], q's dtype or float32, added to the
  scaled scores; it receives a gradient (summed over its broadcast dims) when it requires one.
- window_size=(left, right): query i sees keys [i + d - left, i + d + right], d = Sk - Sq,
  -1 meaning unbounded; with is_causal=True the right side is 0.
- softcap: scores become softcap * tanh(scores / softcap) before the bias (Gemma 2).
- alibi_slopes: float32 [Hq] or [B, Hq]; adds -slope * |i + d - j|, no gradient.
"""

import torch

from tilegym.ops.attention import custom_ops, launch
from tilegym.ops.attention.autograd import AttentionFunction

__all__ = ["tile_fmha", "fmha_forward_with_lse", "tile_fmha_with_backward", "tile_fmha_functional"]


def tile_fmha(
    q, k, v, scaling=None, is_causal=True, *, attn_bias=None, window_size=None, softcap=None, alibi_slopes=None
):
    """Attention output for inference: no LSE is written and nothing is saved for backward."""
    if torch.compiler.is_compiling():
        out, _ = _custom_op(q, k, v, scaling, is_causal, attn_bias, window_size, softcap, alibi_slopes, False, False)
        return out
    problem, mod_tensors = launch.check_inputs(
        q, k, v, scaling, is_causal, attn_bias, window_size, softcap, alibi_slopes
    )
    out, _ = launch.forward(q, k, v, problem, with_lse=False, mod_tensors=mod_tensors)
    return out


def fmha_forward_with_lse(
    q, k, v, scaling=None, is_causal=True, *, attn_bias=None, window_size=None, softcap=None, alibi_slopes=None
):
    """(out, lse): lse is float32 [B, Hq, Sq], the natural log of the sum over the keys a row
    sees of exp(scaled score); -inf for a row that sees no key."""
    if torch.compiler.is_compiling():
        out, lse = _custom_op(q, k, v, scaling, is_causal, attn_bias, window_size, softcap, alibi_slopes, True, False)
        return out, lse.to(torch.float32)
    problem, mod_tensors = launch.check_inputs(
        q, k, v, scaling, is_causal, attn_bias, window_size, softcap, alibi_slopes
    )
    out, lse = launch.forward(q, k, v, problem, with_lse=True, mod_tensors=mod_tensors)
    return out, lse.to(torch.float32)


def tile_fmha_with_backward(
    q, k, v, scaling=None, is_causal=True, *, attn_bias=None, window_size=None, softcap=None, alibi_slopes=None
):
    """Attention output, differentiable with respect to q, k, v and attn_bias."""
    if torch.compiler.is_compiling():
        out, _ = _custom_op(q, k, v, scaling, is_causal, attn_bias, window_size, softcap, alibi_slopes, True, True)
        return out
    problem, mod_tensors = launch.check_inputs(
        q, k, v, scaling, is_causal, attn_bias, window_size, softcap, alibi_slopes
    )
    if _needs_grad(q, k, v, attn_bias):
        # The backward's kernels compile in the background while the forward's kernel compiles.
        bias_grad = attn_bias is not None and attn_bias.requires_grad
        launch.compile_backward_ahead(q, k, v, problem, mod_tensors, bias_grad)
    return AttentionFunction.apply(q, k, v, attn_bias, problem, mod_tensors)


def tile_fmha_functional(q, k, v, scaling=None, is_causal=True, training=None, **score_mods):
    """training=True: the differentiable path; False: the inference kernel; None: the
    differentiable path iff grad mode is on and any of q, k, v, attn_bias requires grad.
    score_mods: attn_bias, window_size, softcap, alibi_slopes."""
    unknown = set(score_mods) - {"attn_bias", "window_size", "softcap", "alibi_slopes"}
    if unknown:
        raise TypeError(f"tile_fmha_functional got unexpected keyword arguments: {', '.join(sorted(unknown))}")
    if training is None:
        training = _needs_grad(q, k, v, score_mods.get("attn_bias"))
    elif not isinstance(training, bool):
        raise TypeError(f"training must be a bool or None, got {type(training).__name__}")
    if training:
        return tile_fmha_with_backward(q, k, v, scaling, is_causal, **score_mods)
    return tile_fmha(q, k, v, scaling, is_causal, **score_mods)


def _needs_grad(*tensors) -> bool:
    """Whether autograd will want a gradient of any of these (non-tensors are skipped)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _custom_op(q, k, v, scaling, is_causal, attn_bias, window_size, softcap, alibi_slopes, with_lse, differentiable):
    """The call as custom_ops.attention, which torch.compile keeps in its graph; the operator
    checks its arguments. Without differentiable, no gradient flows (as in the eager inference
    path)."""
    tensors = (q, k, v, attn_bias, alibi_slopes)
    if not differentiable:
        tensors = tuple([t.detach() if isinstance(t, torch.Tensor) else t for t in tensors])
    q, k, v, attn_bias, alibi_slopes = tensors
    # The schema takes a list of ints; anything else fails its check, which names the argument.
    window = list(window_size) if isinstance(window_size, tuple) else window_size
    return custom_ops.attention(q, k, v, attn_bias, alibi_slopes, scaling, is_causal, window, softcap, with_lse)

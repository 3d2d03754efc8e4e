"""Fused multi-head attention for inference and training, written in cuTile.

Shapes: q [B, Hq, Sq, D]; k, v [B, Hkv, Sk, D] with Hq a multiple of Hkv (GQA/MQA);
the output is shaped and typed like q. Causal masking is bottom-right aligned: query i
attends to key j iff j <= i + (Sk - Sq); a query that sees no key outputs zeros.
"""

import torch

from tilegym.ops.attention import launch
from tilegym.ops.attention.autograd import AttentionFunction

__all__ = ["tile_fmha", "fmha_forward_with_lse", "tile_fmha_with_backward", "tile_fmha_functional"]


def tile_fmha(q, k, v, scaling=None, is_causal=True):
    """Attention output for inference: no LSE is written and nothing is saved for backward."""
    problem = launch.check_inputs(q, k, v, scaling, is_causal)
    out, _ = launch.forward(q, k, v, problem, with_lse=False)
    return out


def fmha_forward_with_lse(q, k, v, scaling=None, is_causal=True):
    """(out, lse): lse is float32 [B, Hq, Sq], the natural log of the sum over the keys a row
    sees of exp(scaled score); -inf for a row that sees no key."""
    problem = launch.check_inputs(q, k, v, scaling, is_causal)
    out, lse = launch.forward(q, k, v, problem, with_lse=True)
    return out, lse.to(torch.float32)


def tile_fmha_with_backward(q, k, v, scaling=None, is_causal=True):
    """Attention output, differentiable with respect to q, k and v."""
    problem = launch.check_inputs(q, k, v, scaling, is_causal)
    return AttentionFunction.apply(q, k, v, problem)


def tile_fmha_functional(q, k, v, scaling=None, is_causal=True, training=None):
    """training=True: the differentiable path; False: the inference kernel; None: the
    differentiable path iff grad mode is on and any of q, k, v requires grad."""
    if training is None:
        tensors = [t for t in (q, k, v) if isinstance(t, torch.Tensor)]
        training = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    elif not isinstance(training, bool):
        raise TypeError(f"training must be a bool or None, got {type(training).__name__}")
    if training:
        return tile_fmha_with_backward(q, k, v, scaling, is_causal)
    return tile_fmha(q, k, v, scaling, is_causal)

"""The built-in modifiers as score and mask functions: one way to ask for each.

Softcap, ALiBi, the additive bias and the sliding window are ready-made functions in
score_functions (softcap, alibi, additive_bias, sliding_window), each marked with what it
computes (a `predefined` attribute holding one of the records below). The keyword arguments
softcap=, alibi_slopes=, attn_bias= and window_size= are the same four, spelled as numbers and
tensors. A call that passes a marked function runs the kernels' own code for it, as if the
keyword argument had been given (lower): the kernels keep hand-made forms of these four (ALiBi
split between the scores and the row statistics, softcap's tanh kept for its derivative,
windows as tile ranges) that a function of one's own cannot reach (perf-notes#predefined-functions).

A marked function runs as the function it is (inlined like any other) wherever the built-in
code would compute something else or cannot take it: another modifier of the same kind in the
call, a modifier applied before it that it does not commute with (softcap after a bias), an
exact tanh asked of 16-bit inputs or the hardware tanh of 32/64-bit ones (a softcap left to pick
its tanh takes softcap='s, as a function too), lengths other than
the ones the function was made for, a packed batch whose sequences may each have their own
(alibi and sliding_window), tensors the keyword argument refuses, or a score_mod_grad or
aux_grad other than the one its factory gives (or none).
"""

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch

from tilegym.ops.attention.caller_functions import CallerFunctions


@dataclass(frozen=True)
class Softcap:
    """score -> cap * tanh(score / cap): softcap=cap. approximate: True, the hardware tanh, which
    softcap= uses for 16-bit inputs; False, the exact one, which it uses for 32- and 64-bit
    inputs; None, the one softcap= would take for the call's inputs. exact: for None, the
    (score_mod, score_mod_grad) with the exact tanh, run where the function stays one on wider
    inputs."""

    cap: float
    approximate: bool | None
    score_mod_grad: Callable
    exact: tuple | None = None


@dataclass(frozen=True)
class Alibi:
    """score - slopes[h] * |i + shift - j| with the slopes aux[0], float32 [Hq]:
    alibi_slopes=slopes where shift = Sk - Sq."""

    shift: int
    score_mod_grad: Callable


@dataclass(frozen=True)
class AdditiveBias:
    """score + bias[b, h, i, j], the bias aux[0] with each dim 1 or full: attn_bias=bias."""

    score_mod_grad: Callable
    aux_grad: Callable


@dataclass(frozen=True)
class Window:
    """Query i sees keys i + shift - left ... i + shift + right (-1: unbounded):
    window_size=(left, right) where shift = Sk - Sq."""

    left: int
    right: int
    shift: int


def mark(function: Callable, what) -> Callable:
    """function, marked as computing `what` (one of the records above)."""
    function.predefined = what
    return function


def lower(mods, functions, q, k, is_causal, cu_seqlens=None):
    """(mods, functions) of a call with its marked functions turned into the keyword arguments
    they stand for, where the built-in code computes the same (see the module docstring).

    mods: the call's modifier arguments (api._Mods); functions: its CallerFunctions or None;
    cu_seqlens: (cu_seqlens_q, cu_seqlens_k) of a packed batch. Reads shapes, dtypes and Python
    attributes only (no host sync), so torch.compile traces it; a call whose arguments are not
    what the checks accept is left as it is, for them to refuse. Functions of one's own cost two
    attribute reads; a lowered call rebuilds mods once (and functions once, where some remain)."""
    if functions is None:
        return mods, None
    score = getattr(functions.score_mod, "predefined", None)
    window = getattr(functions.mask_mod, "predefined", None)
    if score is None and window is None:
        return mods, functions
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        return mods, functions
    if q.dim() != (3 if cu_seqlens is not None else 4) or k.dim() != q.dim():
        return mods, functions
    lengths = _Lengths(q, k, cu_seqlens)
    keywords, changed = {}, {}
    if score is not None and _companions_given(functions, score):
        keyword = _score_keyword(mods, score, functions.aux_tensors(), q, lengths)
        if keyword is not None:
            keywords.update(keyword)
            changed.update(score_mod=None, score_mod_grad=None, aux=None, aux_grad=None)
    if "score_mod" not in changed and isinstance(score, Softcap) and score.exact and not _sixteen_bits(q):
        # A softcap left to pick its tanh stays a function on wider inputs: the exact tanh, as
        # softcap= takes for them (the hardware one has no float64 form).
        changed["score_mod"] = score.exact[0]
        if functions.score_mod_grad is score.score_mod_grad:
            changed["score_mod_grad"] = score.exact[1]
    if isinstance(window, Window) and _takes_window(mods, functions, window, lengths):
        keywords["window_size"] = (window.left, 0 if is_causal else window.right)
        changed["mask_mod"] = None
    if not changed:
        return mods, functions
    # Anything left (a tensor or gradient function without its function) stays, for the checks
    # to refuse; None where nothing is (CallerFunctions.of).
    left = (changed.get(field.name, getattr(functions, field.name)) for field in fields(functions))
    return replace(mods, **keywords) if keywords else mods, CallerFunctions.of(*left)


def _sixteen_bits(q) -> bool:
    return q.dtype in (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class _Lengths:
    """The call's tensors whose lengths a marked function must have been made for."""

    q: torch.Tensor
    k: torch.Tensor
    cu_seqlens: tuple | None

    def shift_is(self, shift: int) -> bool:
        """Whether every sequence's Sk - Sq is shift: the dense call's lengths, or a packed call
        whose queries and keys share one cumulative-length tensor (shift 0)."""
        if self.cu_seqlens is not None:
            cu_seqlens_q, cu_seqlens_k = self.cu_seqlens
            return shift == 0 and cu_seqlens_q is cu_seqlens_k
        return self.k.shape[2] - self.q.shape[2] == shift

    @property
    def q_heads(self) -> int:
        return self.q.shape[1]


def _companions_given(functions, score) -> bool:
    """Whether the call's score_mod_grad and aux_grad are the marked function's own, as its
    factory gives them: another or a missing one runs the function as given, with the checks a
    function gets (a missing score_mod_grad is an error in training, dtype or not)."""
    aux_grad = getattr(score, "aux_grad", None)
    return functions.score_mod_grad is score.score_mod_grad and functions.aux_grad is aux_grad


def _score_keyword(mods, score, aux: tuple, q, lengths: _Lengths) -> dict | None:
    """The keyword argument score stands for ({name: value}), or None where it stays a function."""
    if isinstance(score, Softcap):
        # The built-in softcap comes first: after a bias or ALiBi the function computes another thing.
        builtin_before = mods.attn_bias is not None or mods.alibi_slopes is not None
        other_tanh = score.approximate not in (None, _sixteen_bits(q))
        if mods.softcap or builtin_before or aux or other_tanh:
            return None
        return {"softcap": score.cap}
    if isinstance(score, Alibi):
        slopes = aux[0] if len(aux) == 1 else None
        if mods.alibi_slopes is not None or not lengths.shift_is(score.shift) or not _slopes_fit(slopes, q, lengths):
            return None
        return {"alibi_slopes": slopes}
    if isinstance(score, AdditiveBias):
        bias = aux[0] if len(aux) == 1 else None
        if mods.attn_bias is not None or lengths.cu_seqlens is not None or not _bias_fits(bias, q, lengths):
            return None
        return {"attn_bias": bias}
    return None


def _slopes_fit(slopes, q, lengths: _Lengths) -> bool:
    """Whether alibi_slopes takes slopes as the function reads them: float32 [Hq], no gradient
    wanted (the function path refuses one without an aux_grad)."""
    return (
        isinstance(slopes, torch.Tensor) and slopes.dtype == torch.float32 and slopes.device == q.device
        and tuple(slopes.shape) == (lengths.q_heads,) and not slopes.requires_grad
    )  # fmt: skip


def _bias_fits(bias, q, lengths: _Lengths) -> bool:
    """Whether attn_bias takes bias as the function reads it: 4-D, each dim 1 or the call's."""
    if not isinstance(bias, torch.Tensor) or bias.dim() != 4 or bias.device != q.device:
        return False
    if bias.dtype not in (q.dtype, torch.float32):
        return False
    full = (q.shape[0], q.shape[1], q.shape[2], lengths.k.shape[2])
    return all(size in (1, whole) for size, whole in zip(bias.shape, full, strict=True))


def _takes_window(mods, functions, window: Window, lengths: _Lengths) -> bool:
    """Whether window_size computes the marked window: no window of its own, no tensors or block
    mask with it, and the lengths the function was made for."""
    if mods.window_size is not None or functions.mask_aux or functions.block_mask is not None:
        return False
    return lengths.shift_is(window.shift)

"""The caller's score and mask functions inside the kernels.

Each kernel module names them by the globals below (None: not given). A call with functions
runs a copy of the kernel whose globals name the caller's instead (programmable.py): cuTile
reads a kernel's globals when it compiles it, and calls a Python function it finds there as
kernel code, inlined. The kernel body gathers them into state.UserFunctions, which every
helper reads as compile-time constants: with none given, their code is not emitted.

Units: the functions see natural-unit scores (the softmax scale applied, FlashAttention's and
FlexAttention's convention) as fp32 tiles (fp64 for fp64 inputs). The kernels keep a score
function's output in those units too: exp2's argument converts it to base 2 inside its fused
multiply-add, and score_mod_grad gets it as it was returned. The input costs a multiply per
score (one more where built-in modifiers give base-2 scores first).
Index tiles broadcast against the score tile: q_idx is [block_m, 1] and kv_idx [1, block_n],
or [1, block_m] and [block_n, 1] in the dK/dV kernel, whose tiles are key-major. So the
functions must be elementwise.
"""

import cuda.tile as ct

from tilegym.ops.attention.kernels.state import TileLists, UserArgs, UserFunctions
from tilegym.ops.attention.kernels.tiles import ConstBool, ln2

# Overridden in a kernel's copy by programmable.user_kernel.
SCORE_MOD = None
SCORE_MOD_GRAD = None
AUX_GRAD = None
MASK_MOD = None


@ct.function
def user_functions(score_mod, score_mod_grad, aux_grad, mask_mod):
    return UserFunctions(score_mod, score_mod_grad, aux_grad, mask_mod)


@ct.function
def user_args(b, h, Aux0, Aux1, Aux2, Aux3, MaskAux0, MaskAux1, MaskAux2, MaskAux3):
    """UserArgs of one (batch entry, query head), without aux gradients."""
    return UserArgs(b, h, (Aux0, Aux1, Aux2, Aux3), (MaskAux0, MaskAux1, MaskAux2, MaskAux3), (), False)


@ct.function
def user_args_with_grads(b, h, Aux0, Aux1, Aux2, Aux3, MaskAux0, MaskAux1, MaskAux2, MaskAux3, grads):
    """UserArgs whose aux_grads are grads (a tuple of arrays), which aux_grad adds into here."""
    return UserArgs(b, h, (Aux0, Aux1, Aux2, Aux3), (MaskAux0, MaskAux1, MaskAux2, MaskAux3), grads, True)


@ct.function
def score_modified(switches):
    """Whether the caller gave a score function."""
    return switches.user.score_mod is not None


@ct.function
def user_scored(scores_log2, raw, scoring, rows, cols, builtin: ConstBool):
    """(score_mod's output, natural units; its input) given base-2 scores and the raw products
    q.k they come from; (scores_log2, 0) without a score_mod. builtin: whether built-in
    modifiers changed the scores first (else the input is one multiply of the raw products)."""
    switches, args = scoring.switches, scoring.user
    score_mod = switches.user.score_mod
    if score_mod is not None:
        dtype = scores_log2.dtype
        if builtin:
            natural = scores_log2 * ln2(dtype)
        else:
            natural = raw * (scoring.qk_scale_log2 * ln2(dtype))
        result = ct.astype(score_mod(natural, args.b, args.h, rows, cols, args.aux), dtype)
    else:
        natural = 0
        result = scores_log2
    return result, natural


@ct.function
def user_score_gradient(d_scores, natural, modified, rows, cols, scoring):
    """The gradient with respect to score_mod's input from that with respect to its output,
    by score_mod_grad (given the input, natural, and the output, modified); after adding the
    aux tensors' share (aux_grad) where there is one.

    aux_grad gets zeros past the last key: the dK/dV kernel computes the rows of padded keys
    unmasked (their dK and dV rows are never stored), and an aux index may well reach them."""
    user, args = scoring.switches.user, scoring.user
    if user.score_mod is not None:
        if user.aux_grad is not None and args.sums_aux_grads:
            real = ct.where(cols < scoring.seqlens.k, d_scores, 0.0)
            user.aux_grad(real, natural, args.b, args.h, rows, cols, args.aux, args.aux_grads)
        d_input = user.score_mod_grad(d_scores, natural, modified, args.b, args.h, rows, cols, args.aux)
        result = ct.astype(d_input, d_scores.dtype)
    else:
        result = d_scores
    return result


@ct.function
def user_visible(inside, rows, cols, switches, args):
    """inside, and where the caller's mask_mod says so."""
    mask_mod = switches.user.mask_mod
    if mask_mod is not None:
        result = inside & mask_mod(args.b, args.h, rows, cols, args.mask_aux)
    else:
        result = inside
    return result


@ct.function
def tile_lists(Counts, Tiles, b, h):
    """TileLists of a block mask at a batch entry and head, which broadcast where the mask's
    dims are 1."""
    return TileLists(Counts, Tiles, min(b, Counts.shape[0] - 1), min(h, Counts.shape[1] - 1))


@ct.function
def over_listed_tiles(step, lists, row, state, program):
    """state after step(program, tile, state, masked) over row's partly visible tiles (masked)
    and then its fully visible ones, in ascending order (a fixed order: sums are repeatable)."""
    partial = ct.gather(lists.counts, (lists.b, lists.h, row, 0))
    for i in range(partial):
        state = step(program, ct.gather(lists.tiles, (lists.b, lists.h, row, 0, i)), state, True)
    full = ct.gather(lists.counts, (lists.b, lists.h, row, 1))
    for i in range(full):
        state = step(program, ct.gather(lists.tiles, (lists.b, lists.h, row, 1, i)), state, False)
    return state

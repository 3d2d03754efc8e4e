"""The caller's score and mask functions of one call and their tensors, as given; their check
against the call's problem; and how they cross a torch.library operator under torch.compile.

A function cannot pass through an operator's schema, so a compiled call passes a key instead:
operator_key, which dynamo runs once while tracing (its result becomes a constant of the
graph), registers the functions under their fingerprint and returns it; the operator finds them
by it (from_operator). A key is only as good as dynamo's guards, which tell functions apart by
their code object alone: a closure of the same code over other values would reuse a graph
whose key does not describe it. So only functions that close over nothing take this path
(closure_free); a call with a closure runs eagerly at a graph break, where the functions are
read afresh every call. (score_functions' factories make closure-free copies with a code
object each.)
"""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tilegym.ops.attention import programmable
from tilegym.ops.attention.block_mask import BlockMask, check_block_mask
from tilegym.ops.attention.programmable import UserFunctions


@dataclass(frozen=True)
class CallerFunctions:
    """The caller's score and mask functions and their tensors, as given (programmable.py)."""

    score_mod: Callable | None
    score_mod_grad: Callable | None
    aux: tuple | None
    aux_grad: Callable | None
    mask_mod: Callable | None
    mask_aux: tuple | None
    block_mask: BlockMask | None

    @classmethod
    def of(cls, *given) -> "CallerFunctions | None":
        return None if all(value is None for value in given) else cls(*given)

    @property
    def functions(self) -> tuple:
        """(score_mod, score_mod_grad, aux_grad, mask_mod), None where not given."""
        return self.score_mod, self.score_mod_grad, self.aux_grad, self.mask_mod

    def aux_tensors(self) -> tuple:
        return self.aux_tensors_of(self.aux)

    @staticmethod
    def aux_tensors_of(aux) -> tuple:
        """aux as given (None, one tensor, a tuple or a list) as a tuple, unchecked."""
        return tuple(aux) if isinstance(aux, (tuple, list)) else () if aux is None else (aux,)

    def check(self, q, problem, mod_tensors, training: bool, cu_seqlens=None, wants_aux_grad=None):
        """(problem, mod_tensors) with the caller's functions and tensors, checked; cu_seqlens: a
        packed call's CuSeqlens. wants_aux_grad: whether aux_grad runs; None: where training
        and some aux tensor requires grad (an operator's tensors carry no autograd state: its
        key says, and training's checks ran when it was made)."""
        mask = check_block_mask(
            self.block_mask, self.mask_mod, self.mask_aux, q, problem.batch, problem.q_heads, problem.seqlen_q,
            problem.seqlen_k, cu_seqlens,
        )  # fmt: skip
        aux = programmable.check_aux(self.aux, q, "aux", read=not problem.scores_nothing)
        requires_grad = any(t.requires_grad for t in aux)
        if wants_aux_grad is None:
            # aux_grad runs (its atomic adds cost) only where some aux tensor takes a gradient.
            wants_aux_grad = training and requires_grad
        if self.aux_grad is not None and self.score_mod is None:
            raise ValueError("aux_grad is given without score_mod")
        functions = programmable.memo_user_functions(
            self.score_mod, self.score_mod_grad, self.aux_grad if wants_aux_grad else None,
            None if mask is None else mask.mask_mod,
        )  # fmt: skip
        if aux and self.score_mod is None:
            raise ValueError("aux is given without score_mod (mask_mod reads mask_aux)")
        check_training(self.score_mod, self.score_mod_grad, self.aux_grad, training, requires_grad)
        mods = dataclasses.replace(problem.mods, user=functions)
        problem = dataclasses.replace(problem, mods=mods)
        return problem, dataclasses.replace(mod_tensors, aux=aux, block_mask=mask)


def check_training(score_mod, score_mod_grad, aux_grad, training: bool, aux_requires_grad: bool) -> None:
    """What a differentiable call with these functions needs."""
    if training and score_mod is not None and score_mod_grad is None:
        raise ValueError(
            "score_mod_grad is needed for the backward of score_mod: the gradient of score_mod's output "
            "with respect to its input score (e.g. `lambda grad, score, out, b, h, q_idx, kv_idx, aux: grad` "
            "for an additive score_mod)"
        )
    if training and aux_grad is None and aux_requires_grad:
        raise ValueError("an aux tensor requires grad but no aux_grad is given to compute its gradient")


# ---- through an operator ------------------------------------------------------------------------

# UserFunctions by fingerprint, for the operators of compiled graphs. Never dropped: a graph
# holds its key as long as it lives, and distinct functions each compile kernels of their own
# (far larger than an entry here).
_registered: dict[str, UserFunctions] = {}


@torch.compiler.assume_constant_result
def closure_free(*functions) -> bool:
    """Whether none of the functions (None where not given) closes over values: whether their
    key may pass through an operator (see the module docstring)."""
    return all(function is None or not getattr(function, "__closure__", None) for function in functions)


@torch.compiler.assume_constant_result
def operator_key(score_mod, score_mod_grad, aux_grad, mask_mod, training: bool, aux_requires_grad: bool) -> str:
    """The key under which an operator finds these closure-free functions (from_operator), after
    the checks of a differentiable call; aux_grad is kept only where an aux tensor takes a
    gradient."""
    check_training(score_mod, score_mod_grad, aux_grad, training, aux_requires_grad)
    wanted = aux_grad if training and aux_requires_grad else None
    functions = programmable.memo_user_functions(score_mod, score_mod_grad, wanted, mask_mod)
    if functions is None:
        return ""
    _registered[functions.fingerprint] = functions
    return functions.fingerprint


def from_operator(key: str, aux: list, mask_aux: list) -> CallerFunctions | None:
    """The CallerFunctions an operator was given by key (operator_key), with its tensors; None
    for the empty key (no functions)."""
    if not key:
        return None
    functions = _registered.get(key)
    if functions is None:
        raise ValueError(
            f"no score or mask functions are registered under {key[:16]}...: an operator's functions key comes "
            "from the attention functions under torch.compile, in this process"
        )
    return CallerFunctions(
        functions.score_mod, functions.score_mod_grad, tuple(aux) or None, functions.aux_grad, functions.mask_mod,
        tuple(mask_aux) or None, None,
    )  # fmt: skip

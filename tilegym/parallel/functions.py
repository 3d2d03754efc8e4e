"""The caller's score and mask functions under context parallelism, given whole-sequence
positions.

A call of the kernels counts q_idx and kv_idx from its own first query and key (and, on a
packed batch, b over its own sequences). Under context parallelism a call holds a chunk of the
sequence, so each function runs wrapped in a copy that adds the call's offsets before calling
it: an int32 table ``[rows, 2]`` appended to aux (and to mask_aux), whose row b holds the
positions of the first query and the first key of the call's row b. The offsets are data, not
compile-time constants, so one kernel serves every rank and chunk. The copies pass aux on
whole, so the caller's functions read their own tensors at their own slots. A packed call holds
two chunks of each sequence as sequences of its own: the caller's b is the call's b // 2.

A block mask made for the whole sequence (or packed batch) is read as its mask_mod and
mask_aux: its tile lists cover the whole sequence's tiles, each call a chunk's, so each call
makes its own lists, as from mask_mod.
"""

import types
from dataclasses import dataclass
from functools import lru_cache

import cuda.tile as ct
import torch
from torch import Tensor

from tilegym.ops.attention.block_mask import check_block_mask
from tilegym.ops.attention.packing import CuSeqlens
from tilegym.ops.attention.programmable import AUX_SLOTS, check_aux, memo_user_functions
from tilegym.ops.attention.score_functions import own_code_copy

# Each wrapper's own globals (_at_global_positions): the caller's function, the slot of aux that
# holds the offsets, and how many rows of a call make one of the caller's.
_CALLER = _OFFSETS_SLOT = _CALL_ROWS_PER_ROW = None


def _score_at_global_positions(score, b, h, q_idx, kv_idx, aux):
    offsets = aux[_OFFSETS_SLOT]
    row = b // _CALL_ROWS_PER_ROW
    return _CALLER(score, row, h, q_idx + ct.gather(offsets, (b, 0)), kv_idx + ct.gather(offsets, (b, 1)), aux)


def _score_grad_at_global_positions(grad, score, out, b, h, q_idx, kv_idx, aux):
    offsets = aux[_OFFSETS_SLOT]
    row = b // _CALL_ROWS_PER_ROW
    return _CALLER(
        grad, score, out, row, h, q_idx + ct.gather(offsets, (b, 0)), kv_idx + ct.gather(offsets, (b, 1)), aux
    )


def _aux_grad_at_global_positions(grad, score, b, h, q_idx, kv_idx, aux, aux_grads):
    offsets = aux[_OFFSETS_SLOT]
    row = b // _CALL_ROWS_PER_ROW
    _CALLER(
        grad, score, row, h, q_idx + ct.gather(offsets, (b, 0)), kv_idx + ct.gather(offsets, (b, 1)), aux, aux_grads
    )


def _mask_at_global_positions(b, h, q_idx, kv_idx, mask_aux):
    offsets = mask_aux[_OFFSETS_SLOT]
    row = b // _CALL_ROWS_PER_ROW
    return _CALLER(row, h, q_idx + ct.gather(offsets, (b, 0)), kv_idx + ct.gather(offsets, (b, 1)), mask_aux)


_TEMPLATES = {
    "score_mod": _score_at_global_positions,
    "score_mod_grad": _score_grad_at_global_positions,
    "aux_grad": _aux_grad_at_global_positions,
    "mask_mod": _mask_at_global_positions,
}


@lru_cache(maxsize=256)
def _at_global_positions(role: str, function: types.FunctionType, offsets_slot: int, call_rows_per_row: int):
    """function wrapped for role (one of _TEMPLATES): the same object for the same arguments,
    whose fingerprint (programmable.fingerprint) follows the function's through its globals."""
    template = _TEMPLATES[role]
    namespace = {
        **template.__globals__,
        "_CALLER": function, "_OFFSETS_SLOT": offsets_slot, "_CALL_ROWS_PER_ROW": call_rows_per_row,
    }  # fmt: skip
    wrapped = own_code_copy(template, namespace)
    wrapped.__qualname__ = f"{template.__qualname__}[{function.__qualname__}]"
    if getattr(function, "elementwise", False):  # a few elementwise operations still: two more per row
        wrapped.elementwise = True
    wrapped.wraps = function  # the caller's function (the tests' stand-in reads it)
    return wrapped


@dataclass(frozen=True)
class WholeSizes:
    """What a block mask made for the caller's whole sequence covers: batch entries (a packed
    batch's sequences), query heads, the length (the longest sequence), and a packed batch's
    cumulative lengths (the very tensor the call takes)."""

    batch: int
    heads: int
    length: int
    cu_seqlens: CuSeqlens | None = None


@dataclass(frozen=True)
class ChunkFunctions:
    """The caller's functions and their tensors, ready for calls whose rows are chunks of the
    caller's rows (call_rows_per_row of them per row)."""

    functions: dict  # role -> the caller's function
    aux: tuple
    mask_aux: tuple
    call_rows_per_row: int

    @classmethod
    def of(
        cls,
        q: Tensor,
        call_rows_per_row: int,
        whole: WholeSizes,
        *,
        score_mod=None,
        score_mod_grad=None,
        aux=None,
        aux_grad=None,
        mask_mod=None,
        mask_aux=None,
        block_mask=None,
    ) -> "ChunkFunctions | None":
        """None without functions. Checks what context parallelism adds to the functions' own
        checks (those run in the calls): a block mask made for the whole sequence or batch
        (whole), read as its mask_mod and mask_aux; one aux slot left for the offsets."""
        if block_mask is not None:
            block_mask = check_block_mask(
                block_mask, mask_mod, mask_aux, q, whole.batch, whole.heads, whole.length, whole.length,
                whole.cu_seqlens,
            )  # fmt: skip
            mask_mod, mask_aux = block_mask.mask_mod, block_mask.mask_aux
        # The calls' own checks of the functions (Python functions, no gradient function
        # without score_mod), before the collective; kept for the same function objects.
        checked = memo_user_functions(score_mod, score_mod_grad, aux_grad, mask_mod)
        aux, mask_aux = check_aux(aux, q, "aux", read=False), check_aux(mask_aux, q, "mask_aux", read=False)
        if checked is None:
            if aux or mask_aux:
                raise ValueError("aux and mask_aux need score_mod or mask_mod")
            return None
        functions = checked.given()
        for name, tensors in (("aux", aux), ("mask_aux", mask_aux)):
            if len(tensors) >= AUX_SLOTS:
                raise ValueError(
                    f"{name} holds {len(tensors)} tensors; under context parallelism at most {AUX_SLOTS - 1} (one "
                    "slot carries each call's positions)"
                )
        return cls(functions, aux, mask_aux, call_rows_per_row)

    def arguments(self, offsets: Tensor) -> dict:
        """tile_fmha_functional's keyword arguments for a call whose row b starts at the
        positions offsets[b] (int32 ``[call rows, 2]``: first query, first key)."""
        arguments = {}
        for role, function in self.functions.items():
            slot = len(self.mask_aux) if role == "mask_mod" else len(self.aux)
            arguments[role] = _at_global_positions(role, function, slot, self.call_rows_per_row)
        # Tensors without the function that reads them go on as given, for the calls' checks.
        arguments["aux"] = (*self.aux, offsets) if "score_mod" in self.functions else self.aux or None
        arguments["mask_aux"] = (*self.mask_aux, offsets) if "mask_mod" in self.functions else self.mask_aux or None
        return arguments


def dense_offsets(batch: int, first_query: int, first_key: int, device) -> Tensor:
    """int32 ``[batch, 2]``: every row of a dense call starts at the same positions."""
    offsets = torch.full((batch, 2), first_query, dtype=torch.int32, device=device)
    offsets[:, 1] = first_key
    return offsets

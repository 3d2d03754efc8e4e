"""How the aux tensors' gradients are summed: the caller's aux_grad adds each score's share
with score_functions.add_to_aux_grad (device code), into fp32 (fp64) buffers by atomic adds,
or, under torch.use_deterministic_algorithms(True), into fixed-point integers whose sum does
not depend on the order of the adds. This module holds the host's part: the buffers, their
sums, the constants both share.

Fixed point: a share x adds round(x * 2^32) to an int64, so the sum is exact to 2^-32 per share
(fp32 shares of magnitude 2^-8 and above convert exactly) and bitwise repeatable; integer
adds wrap, so the sum is right whatever the order as long as the final sum fits. To know that
it fits, each entry also sums a ceiling of its shares' magnitudes (in units of 2^-8, a share
of 2^30 or more, inf or NaN counting past the limit); an entry whose magnitudes reach 2^31
gives NaN, never a wrapped number. The buffer of an aux tensor of shape S is int64 [2, *S]:
the sums, then the magnitudes.
"""

import math
from functools import lru_cache

import torch

from tilegym.ops.attention import programmable

# A share x adds round(x * FIXED_SCALE); its magnitude adds ceil(|x| * MAGNITUDE_SCALE).
FIXED_SCALE = 2.0**32
MAGNITUDE_SCALE = 2.0**8
# Shares this large or larger (and inf, NaN) count MAGNITUDE_LIMIT at once: NaN for the entry.
SHARE_LIMIT = 2.0**30
# An entry is exact while the sum of its magnitudes stays below 2^31 (|fixed sum| < 2^63).
MAGNITUDE_LIMIT = 2.0**31 * MAGNITUDE_SCALE


def buffers(aux: tuple, dtype: torch.dtype, deterministic: bool) -> tuple:
    """Uninitialized buffers aux_grad adds into, one per aux tensor: dtype (fp32 or fp64) of the
    tensor's shape, or fixed-point int64 [2, *shape] when deterministic."""
    if deterministic:
        return tuple(torch.empty((2, *t.shape), dtype=torch.int64, device=t.device) for t in aux)
    return tuple(torch.empty(t.shape, dtype=dtype, device=t.device) for t in aux)


def read_wide(aux: tuple) -> tuple:
    """aux as the backward's kernels read it where aux_grad runs: 16-bit float tensors as float32
    copies, the same values. Where a score function reads a 16-bit aux tensor per score and
    aux_grad adds per score, the compiler fails to schedule the dK/dV kernel's loop (cuda-tile
    1.7, tileiras: "Invalid use-def chain in LoopSchedule")."""
    return tuple(t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for t in aux)


def sums(buffer: torch.Tensor) -> torch.Tensor:
    """The gradient a buffer holds: itself, or its fixed-point sums as float32 (NaN where their
    magnitudes reached the limit)."""
    if buffer.dtype != torch.int64:
        return buffer
    fixed, magnitudes = buffer[0], buffer[1]
    exact = (magnitudes >= 0) & (magnitudes < int(MAGNITUDE_LIMIT))
    return torch.where(exact, fixed.to(torch.float64) / FIXED_SCALE, math.nan).to(torch.float32)


@lru_cache(maxsize=256)
def adds_atomically(aux_grad) -> bool:
    """Whether aux_grad (or a function it calls) adds with ct.atomic_add itself, which is not
    repeatable under torch.use_deterministic_algorithms; add_to_aux_grad is."""
    return _names_atomic_add(aux_grad, set())


def _names_atomic_add(function, seen: set) -> bool:
    if getattr(function, "sums_repeatably", False) or function in seen:
        return False
    seen.add(function)
    names = programmable.code_names(function.__code__)
    if "atomic_add" in names:
        return True
    called = (function.__globals__.get(name) for name in names)
    closed = (cell.cell_contents for cell in function.__closure__ or ())
    return any(_names_atomic_add(value, seen) for value in (*called, *closed) if callable(value) and
               hasattr(value, "__code__"))  # fmt: skip

"""Packed variable-length batches on the host: the checks of a call's packed tensors, cumulative
lengths and longest lengths, and the views that let the dense launch path run them.

A packed tensor is [total, H, D], the rows of every sequence one after another (FlashAttention's
varlen layout). Its view heads_major(t) = [1, H, total, D] is a dense tensor of one batch entry,
which the kernels slice per sequence (kernels/packed.py): no copy, any row stride.
"""

import dataclasses
import math
from dataclasses import dataclass

import torch

from tilegym import env
from tilegym.ops.attention import problem as problem_mod
from tilegym.ops.attention import score_mods
from tilegym.ops.attention.problem import _MAX_GRID_YZ, AttentionProblem, Packing, _check_all_inputs, check_tensor
from tilegym.ops.attention.score_mods import ModTensors

CHECK_VARLEN = "TILEGYM_CHECK_VARLEN"
PACKED_LAYOUT = ("total", "heads", "head_dim")
# Rows that each sequence's rows of a backward row statistic start at a multiple of
# (kernels/packed.py, stat_rows): a multiple of every query tile (16 to 128 rows), so that the
# fused backward's dK/dV loop loads a tile of them from the whole array at a tile index, with no
# bulk-copy descriptor of a slice to build per program (perf-notes#packed-stats-tile-aligned).
# From slices aligned to 4 rows (16 bytes of fp32) it built two of those descriptors.
STAT_ALIGN = 128


@dataclass(frozen=True)
class CuSeqlens:
    """The cumulative lengths of a packed batch, int32 [N + 1] each: sequence s has query rows
    [q[s], q[s + 1]) and key rows [k[s], k[s + 1])."""

    q: torch.Tensor
    k: torch.Tensor


def heads_major(packed: torch.Tensor) -> torch.Tensor:
    """[total, H, D] as the [1, H, total, D] view the kernels take."""
    return packed.permute(1, 0, 2).unsqueeze(0)


def empty_rows(total: int, heads: int, head_dim: int, like: torch.Tensor) -> torch.Tensor:
    """An uninitialized [total, H, D] tensor in like's dtype and device, as its heads_major view.
    The kernel writing it zeros the rows outside every sequence (kernels/packed.py)."""
    return heads_major(torch.empty((total, heads, head_dim), dtype=like.dtype, device=like.device))


def row_stat(problem: AttentionProblem, device) -> torch.Tensor:
    """An uninitialized [Hq, total_q] LSE of a packed problem, which the kernels take as [1, Hq,
    total_q]: fp64 for fp64 inputs, else fp32. The forward kernel writes -inf in the rows outside
    every sequence (kernels/packed.py)."""
    return torch.empty((problem.q_heads, problem.packing.total_q), dtype=problem.stat_dtype, device=device)


def backward_row_stats(problem: AttentionProblem, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The row statistics of a packed problem's backward, Delta and the base-2 LSE, each [1, Hq,
    stat_rows_total]: the two halves of one allocation, so that one memset zeroes both (the
    second starts Hq * stat_rows_total values in, 16-byte aligned as rows of whole tiles). Each
    sequence's rows start at a multiple of STAT_ALIGN (kernels/packed.py, stat_rows). Zeroed: the
    dK/dV loop's last query tile of a sequence reads the rows after it up to the next multiple of
    STAT_ALIGN, which hold no sequence's statistics: zeros there, as past the end of a dense
    sequence, while Q and dOut load zeros; or, after the last sequence, those the preprocess run
    as one gives rows outside every sequence (Delta 0, their output being zeros, and a base-2 LSE
    of +inf: probability 0)."""
    rows = stat_rows_total(problem.packing.total_q, problem.batch)
    both = torch.zeros((2, 1, problem.q_heads, rows), dtype=problem.stat_dtype, device=device)
    return both[0], both[1]


def stat_rows_total(total_q: int, sequences: int) -> int:
    """Rows of a packed backward row statistic: each of the sequences may start up to
    STAT_ALIGN - 1 rows further than the one before (kernels/packed.py, stat_rows), and the count
    is a multiple of STAT_ALIGN, so that the last sequence's last tile is whole, the rows of
    every head start 16-byte aligned, and the kernels compiled for one batch serve the next."""
    return math.ceil((total_q + (STAT_ALIGN - 1) * sequences) / STAT_ALIGN) * STAT_ALIGN


def search_steps(sequences: int) -> int:
    """Halvings of [0, sequences) that find any row's sequence (kernels/packed.py,
    stat_rows_of_rows)."""
    return sequences.bit_length()


# Packed calls, by _call_key.
_checked_calls = problem_mod.CheckedCalls()


def check_packed_inputs(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    scaling,
    is_causal,
    window_size=None,
    softcap=None,
    alibi_slopes=None,
    sinks=None,
    read_contents=True,
) -> tuple[AttentionProblem, ModTensors, CuSeqlens]:
    """Validate a packed call before any launch; errors name the argument (_check_in_full).

    A call like one checked before takes its problem, unless TILEGYM_CHECK_VARLEN asks for the
    cumulative lengths' contents to be checked.
    """
    contents = read_contents and env.flag(CHECK_VARLEN, False)
    lengths = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    modifiers = (window_size, softcap, alibi_slopes, sinks)
    key = None if contents else _call_key(q, k, v, *lengths, scaling, is_causal, *modifiers)
    problem = _checked_calls.find(key)
    if problem is not None:
        mod_tensors = score_mods.kernel_tensors(alibi_slopes, sinks, q.dtype, problem.q_heads)
        return problem, mod_tensors, CuSeqlens(cu_seqlens_q, cu_seqlens_k)
    checked = _check_in_full(q, k, v, *lengths, scaling, is_causal, *modifiers, read_contents)
    _checked_calls.keep(key, checked[0], q, k, v)
    return checked


def _call_key(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scaling, is_causal, *modifiers):
    """Everything the checks of a packed call read, or None where a value's type alone needs the
    full checks (a tensor subclass, a 0-d tensor length, ...); modifiers: window_size, softcap,
    alibi_slopes and sinks."""
    key = problem_mod.call_key(q, k, v, scaling, is_causal, *modifiers)
    lengths = (cu_seqlens_q, cu_seqlens_k)
    if key is None or any(type(cu) is not torch.Tensor for cu in lengths):
        return None
    if type(max_seqlen_q) is not int or type(max_seqlen_k) is not int:
        return None
    return (key, *[(cu.shape, cu.stride(), cu.dtype, cu.device) for cu in lengths], max_seqlen_q, max_seqlen_k)


def _check_in_full(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scaling, is_causal, window_size, softcap,
    alibi_slopes, sinks, read_contents,
) -> tuple[AttentionProblem, ModTensors, CuSeqlens]:  # fmt: skip
    """Every check of a packed call.

    The problem's batch counts the sequences and its seqlen_q, seqlen_k are the longest lengths
    (at most the totals): they size the grid, and the kernels clamp every sequence to them.
    read_contents: whether TILEGYM_CHECK_VARLEN may read the cumulative lengths (not while
    torch.compile traces, where they have no values).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, PACKED_LAYOUT)
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must have the same total and heads, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    cu_seqlens = check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q)
    sequences = cu_seqlens_q.numel() - 1
    if sequences > _MAX_GRID_YZ:
        raise ValueError(f"at most {_MAX_GRID_YZ} sequences are supported, got {sequences}")
    total_q, total_k = q.shape[0], k.shape[0]
    max_q = min(_check_max_seqlen("max_seqlen_q", max_seqlen_q), total_q)
    max_k = min(_check_max_seqlen("max_seqlen_k", max_seqlen_k), total_k)
    problem, mod_tensors = _check_all_inputs(
        heads_major(q), heads_major(k), heads_major(v), scaling, is_causal, None, window_size, softcap, None, False,
        sinks,
    )  # fmt: skip
    slopes = score_mods.check_alibi(alibi_slopes, q, problem.q_heads, batch=sequences)
    if read_contents and env.flag(CHECK_VARLEN, False):
        _check_contents("cu_seqlens_q", cu_seqlens_q, total_q, max_q)
        _check_contents("cu_seqlens_k", cu_seqlens_k, total_k, max_k)
    problem = dataclasses.replace(
        problem,
        batch=sequences,
        seqlen_q=max_q,
        seqlen_k=max_k,
        mods=dataclasses.replace(problem.mods, alibi=slopes is not None),
        packing=Packing(total_q, total_k),
    )
    return problem, dataclasses.replace(mod_tensors, slopes=slopes), cu_seqlens


def check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q: torch.Tensor) -> CuSeqlens:
    """The cumulative lengths of a packed batch (of a call, or of a block mask made for one):
    each int32, 1-D, contiguous, on q's device, the two of one length."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check_one_cu_seqlens(name, cu, q)
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have one length (sequences + 1), got {cu_seqlens_q.numel()} "
            f"and {cu_seqlens_k.numel()}"
        )
    return CuSeqlens(cu_seqlens_q, cu_seqlens_k)


def _check_one_cu_seqlens(name: str, cu, q: torch.Tensor) -> None:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be torch.int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be 1-D [sequences + 1], got shape {tuple(cu.shape)}")
    if cu.device != q.device:
        raise ValueError(f"{name} must be on q's device ({q.device}), got {cu.device}")
    if cu.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {cu.stride(0)}")


def _check_max_seqlen(name: str, value) -> int:
    """value as an int: a Python int, or a 0-d integer tensor (which costs a host sync)."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point():
        if value.dtype == torch.bool:
            raise TypeError(f"{name} must be an int, got a bool tensor")
        value = int(value.item())
    elif isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int (or a 0-d integer tensor), got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def _check_contents(name: str, cu: torch.Tensor, total: int, max_len: int) -> None:
    """TILEGYM_CHECK_VARLEN: the cumulative lengths start at 0, never decrease, end at most at
    total, and no length passes max_len. One host sync; without it, the kernels clamp instead."""
    values = cu.tolist()
    lengths = [end - start for start, end in zip(values[:-1], values[1:], strict=True)]
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    if any(length < 0 for length in lengths):
        where = next(s for s, length in enumerate(lengths) if length < 0)
        raise ValueError(f"{name} must not decrease, got {values[where]} then {values[where + 1]} at sequence {where}")
    if values[-1] > total:
        raise ValueError(f"{name} ends at {values[-1]}, past the {total} rows of the packed tensor")
    longest = max(lengths, default=0)
    if longest > max_len:
        raise ValueError(f"{name} has a sequence of {longest} rows, longer than its max_seqlen ({max_len})")


def tiles(length: int, block: int) -> int:
    """Tiles along a packed problem's sequence axis: at least one, so that an empty grid never
    launches (a program past its sequence's end does nothing)."""
    return max(math.ceil(length / block), 1)

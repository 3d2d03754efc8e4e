"""One attention call's problem: its validated sizes and switches (AttentionProblem), and the
checks that refuse bad input with an error naming the argument, before anything launches."""

import math
from dataclasses import dataclass, fields
from functools import lru_cache

import torch

from tilegym import index_width
from tilegym.launching import pow2_ceil
from tilegym.ops.attention import configs, score_mods
from tilegym.ops.attention.score_mods import PLAIN, ModTensors, ScoreMods

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_MAX_GRID_YZ = 65535
# Kernels add sequence positions, window sides and tile counts in int32: these bounds keep every
# such sum below 2**31 (_check_index_ranges). They are far beyond what fits in GPU memory.
_MAX_SEQLEN_SUM = 2**29
LOG2E = math.log2(math.e)
_FP32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class Packing:
    """A packed variable-length batch (kernels/packed.py): AttentionProblem.batch counts its
    sequences and seqlen_q, seqlen_k are the longest lengths the call was given; the arrays
    hold total_q and total_k rows."""

    total_q: int
    total_k: int


def sizes_score_nothing(batch: int, q_heads: int, seqlen_q: int, seqlen_k: int, packed: bool) -> bool:
    """Whether a call of these sizes computes no score and launches no kernel: no rows, or a
    dense batch without keys (a packed batch still runs, for its rows' statistics)."""
    return batch == 0 or q_heads == 0 or seqlen_q == 0 or (seqlen_k == 0 and not packed)


@dataclass(frozen=True)
class AttentionProblem:
    """Validated sizes of one attention call."""

    batch: int
    q_heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    dtype: torch.dtype
    softmax_scale: float
    causal: bool
    mods: ScoreMods = PLAIN
    # Some tensor has a size or stride beyond int32: the kernels' int64-indexed twins run.
    wide_index: bool = False
    # V's and the output's head dim where it differs from Q's and K's (None: the same).
    head_dim_v: int | None = None
    # A packed variable-length batch (None: dense [B, H, S, D] tensors).
    packing: Packing | None = None

    def __hash__(self) -> int:
        # A call looks its problem up in a dozen memos (shape key, configs, launch forms); the
        # hash dataclass would generate walks every field, the modifiers' too, each time.
        found = self.__dict__.get("_hash")
        if found is None:
            found = hash(tuple(getattr(self, field.name) for field in fields(self)))
            object.__setattr__(self, "_hash", found)
        return found

    def __getstate__(self) -> dict:
        # String hashes differ between processes: an unpickled problem finds its hash again.
        return {name: value for name, value in self.__dict__.items() if name != "_hash"}

    @property
    def value_dim(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def tuning_head_dim(self) -> int:
        """The head dim whose config tables serve this problem's pair (configs.tables_head_dim)."""
        return configs.tables_head_dim(self.head_dim, self.value_dim)

    @property
    def stat_dtype(self) -> torch.dtype:
        """The dtype of the row statistics and of fp32 sums (the sinks' shares, dBias and aux
        partial sums): fp64 for fp64 inputs, else fp32."""
        return score_mods.stat_dtype(self.dtype)

    @property
    def query_group_size(self) -> int:
        return self.q_heads // self.kv_heads

    @property
    def is_empty(self) -> bool:
        return self.batch == 0 or self.q_heads == 0 or self.seqlen_q == 0

    @property
    def scores_nothing(self) -> bool:
        """Whether the call computes no score and launches no kernel (sizes_score_nothing)."""
        return sizes_score_nothing(self.batch, self.q_heads, self.seqlen_q, self.seqlen_k, self.packing is not None)

    def shape_key(self, arch: str) -> str:
        """Calls with equal keys share a tuned config: sequence lengths are rounded up to powers of two."""
        return (
            f"{arch}|{str(self.dtype).removeprefix('torch.')}|d{self.head_dim}"
            f"{'' if self.head_dim_v is None else f'v{self.head_dim_v}'}|g{self.query_group_size}"
            f"|{'causal' if self.causal else 'full'}|sq{pow2_ceil(self.seqlen_q)}|sk{pow2_ceil(self.seqlen_k)}"
            f"{self.mods.key()}{'|int64-index' if self.wide_index else ''}{'|varlen' if self.packing else ''}"
        )


DENSE_LAYOUT = ("batch", "heads", "seq_len", "head_dim")


def check_tensor(name: str, t, layout: tuple[str, ...] = DENSE_LAYOUT) -> None:
    """q, k or v: a tensor of layout's rank in a supported dtype."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != len(layout):
        raise ValueError(f"{name} must have {len(layout)} dimensions [{', '.join(layout)}], got shape {tuple(t.shape)}")
    if t.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise TypeError(f"{name} has dtype {t.dtype}; supported dtypes are {names}")


class CheckedCalls:
    """Problems of calls that passed every check, by a key of everything the checks read (None:
    no key): a training loop repeats a few calls, whose full checks cost the host tens of
    microseconds. Bounded: cleared when full."""

    MAX = 1024

    def __init__(self):
        self._problems: dict[tuple, AttentionProblem] = {}

    def __len__(self) -> int:
        return len(self._problems)

    def find(self, key: tuple | None) -> "AttentionProblem | None":
        return None if key is None else self._problems.get(key)

    def keep(self, key: tuple | None, problem: "AttentionProblem", q, k, v) -> None:
        # Whether a tensor spanning more than 2**31 bytes needs int64 indexing also depends on its
        # address (index_width), which a key leaves out: such calls are checked in full each time.
        if key is None or any(index_width.spans_past_int32(t) for t in (q, k, v)):
            return
        if len(self._problems) >= self.MAX:
            self._problems.clear()
        self._problems[key] = problem


# Dense calls without attn_bias, by call_key. A bias is checked in full each time: its view for
# the kernels depends on its strides and on its gradient.
_checked_calls = CheckedCalls()


def check_inputs(
    q,
    k,
    v,
    scaling,
    is_causal,
    attn_bias=None,
    window_size=None,
    softcap=None,
    alibi_slopes=None,
    bias_grad=None,
    sinks=None,
) -> tuple[AttentionProblem, ModTensors]:
    """Validate everything before any launch; errors name the argument and what was expected.

    bias_grad: whether attn_bias will get a gradient; None reads attn_bias.requires_grad.
    """
    key = None
    if attn_bias is None:
        key = call_key(q, k, v, scaling, is_causal, window_size, softcap, alibi_slopes, sinks)
    problem = _checked_calls.find(key)
    if problem is not None:
        return problem, score_mods.kernel_tensors(alibi_slopes, sinks, q.dtype, problem.q_heads)
    problem, mod_tensors = _check_all_inputs(
        q, k, v, scaling, is_causal, attn_bias, window_size, softcap, alibi_slopes, bias_grad, sinks
    )
    _checked_calls.keep(key, problem, q, k, v)
    return problem, mod_tensors


def call_key(q, k, v, scaling, is_causal, window_size=None, softcap=None, alibi_slopes=None, sinks=None):
    """Everything the checks of a call without attn_bias read, or None where a value's type alone
    needs the full checks (a tensor subclass, a scaling that is not a float, ...)."""
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return None
    if type(is_causal) is not bool or not (scaling is None or type(scaling) is float):
        return None
    modifiers = score_mods.modifiers_key(window_size, softcap, alibi_slopes, sinks)
    if modifiers is None:
        return None
    return (
        q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
        q.device, k.device, v.device, scaling, is_causal, *modifiers,
    )  # fmt: skip


def _check_all_inputs(
    q, k, v, scaling, is_causal, attn_bias, window_size, softcap, alibi_slopes, bias_grad, sinks=None
) -> tuple[AttentionProblem, ModTensors]:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k and v must have the same batch, heads and length, got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    batch, q_heads, seqlen_q, head_dim = q.shape
    _, kv_heads, seqlen_k, kv_head_dim = k.shape
    value_dim = v.shape[3]
    if k.shape[0] != batch:
        raise ValueError(f"k and v must have the batch size of q ({batch}), got {k.shape[0]}")
    if kv_head_dim != head_dim:
        raise ValueError(f"k must have the head dim of q ({head_dim}), got {kv_head_dim}")
    if head_dim not in configs.HEAD_DIMS:
        raise ValueError(f"head dim {head_dim} is not supported; supported head dims are {configs.HEAD_DIMS}")
    if value_dim not in configs.HEAD_DIMS:
        raise ValueError(f"v's head dim {value_dim} is not supported; supported head dims are {configs.HEAD_DIMS}")
    if kv_heads == 0 and q_heads != 0:
        raise ValueError(f"k and v have 0 heads but q has {q_heads}")
    if kv_heads and q_heads % kv_heads:
        raise ValueError(f"q's head count ({q_heads}) must be a multiple of k's and v's ({kv_heads}) for GQA/MQA")
    if batch > _MAX_GRID_YZ or q_heads > _MAX_GRID_YZ:
        raise ValueError(f"batch ({batch}) and heads ({q_heads}) must each be at most {_MAX_GRID_YZ}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if scaling is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    elif isinstance(scaling, bool) or not isinstance(scaling, (int, float)):
        raise TypeError(f"scaling must be a float or None, got {type(scaling).__name__}")
    else:
        softmax_scale = score_mods.as_float(scaling)
        if not math.isfinite(softmax_scale) or abs(softmax_scale) * LOG2E > _FP32_MAX:
            raise ValueError(f"scaling must be finite and within the float32 range, got {scaling}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.device.type != "cuda":
            raise ValueError(f"{name} must be a CUDA tensor, got a tensor on {t.device}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got q on {q.device}, k on {k.device}, v on {v.device}")
    window, causal = score_mods.check_window(window_size, is_causal, seqlen_q, seqlen_k)
    bias_mode, bias = score_mods.check_bias(attn_bias, q, seqlen_k, q_heads, bias_grad)
    slopes = score_mods.check_alibi(alibi_slopes, q, q_heads)
    kernel_sinks = score_mods.check_sinks(sinks, q, q_heads)
    mods = ScoreMods(
        bias_mode=bias_mode,
        bias_shape=None if attn_bias is None else tuple(attn_bias.shape),
        window=window,
        softcap=score_mods.check_softcap(softcap, softmax_scale),
        alibi=slopes is not None,
        sinks=kernel_sinks is not None,
    )
    _check_index_ranges(q_heads, seqlen_q, seqlen_k)
    sizes = (batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim, value_dim)
    wide_index = any(index_width.needs_int64(t) for t in (q, k, v, bias) if t is not None)
    bias_size = 0 if bias is None else bias.element_size()
    wide_index = wide_index or _allocations_need_int64(*sizes, q.dtype.itemsize, bias_size, bias_mode)
    problem = AttentionProblem(
        batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim, q.dtype, softmax_scale, causal, mods, wide_index,
        None if value_dim == head_dim else value_dim,
    )  # fmt: skip
    return problem, ModTensors(bias, slopes, kernel_sinks)


def _check_index_ranges(q_heads: int, seqlen_q: int, seqlen_k: int) -> None:
    """Refuses sizes whose int32 position arithmetic in the kernels could overflow: positions
    plus window reaches (up to about 2 (Sq + Sk)) and program numbers (tiles times heads)."""
    if seqlen_q + seqlen_k > _MAX_SEQLEN_SUM:
        raise ValueError(f"seqlen_q + seqlen_k is {seqlen_q + seqlen_k}; at most 2**29 are supported (int32 positions)")
    if q_heads * (seqlen_q + seqlen_k) > index_width.INT32_MAX:
        raise ValueError(
            f"heads * (seqlen_q + seqlen_k) is {q_heads * (seqlen_q + seqlen_k)}; "
            "at most 2**31 - 1 are supported (int32 program numbers)"
        )


def _allocations_need_int64(*sizes) -> bool:
    """Whether a tensor a call allocates needs the int64-indexed kernels (_allocation_shapes_need_int64).
    Cached for int sizes, since calls with attn_bias are checked in full every time;
    symbolic sizes (torch.compile's fake tensors) cannot be cached and are computed each time."""
    if all(type(size) is int for size in sizes):
        return _cached_allocations_need_int64(*sizes)
    return _allocation_shapes_need_int64(*sizes)


def _allocation_shapes_need_int64(
    batch, q_heads, kv_heads, seqlen_q, seqlen_k, head_dim, value_dim, itemsize, bias_size, bias_mode
):
    """Whether a tensor a call allocates needs the int64-indexed kernels (index_width): out and
    dQ, dK and dV, the row statistics, the dBias workspace (fp32 or the bias's dtype, bias_size
    bytes; 0: no bias) and the fused backward's fp32 sums over rows padded to whole tiles of any
    config."""
    stat_size = 8 if itemsize == 8 else 4
    padded = configs.MAX_BLOCK
    tile = configs.head_dim_tile(max(head_dim, value_dim))
    shapes = [
        ((batch, q_heads, seqlen_q, max(head_dim, value_dim)), itemsize),
        ((batch, kv_heads, seqlen_k, max(head_dim, value_dim)), itemsize),
        ((batch, q_heads, seqlen_q), stat_size),
        ((batch, q_heads, seqlen_q + padded, tile), 4),
        ((batch, kv_heads, seqlen_k + padded, tile), 4),
    ]
    if bias_size:
        rows = 1 if bias_mode == score_mods.BIAS_ONE_ROW else seqlen_q
        shapes += [((batch, q_heads, rows, seqlen_k), size) for size in {bias_size, stat_size}]
    return any(index_width.contiguous_needs_int64(shape, size) for shape, size in shapes)


_cached_allocations_need_int64 = lru_cache(maxsize=1024)(_allocation_shapes_need_int64)

"""Score modifiers: additive bias (with its gradient), sliding window, softcap, ALiBi and
learnable sinks (with their gradient).

Validates the keyword arguments of the public functions and turns them into what the
kernels take: compile-time switches, all off for plain attention (which then compiles to
the same code as without modifiers), and runtime values.

In natural units, for query i and key j with d = Sk - Sq (bottom-right alignment):
    s = scale * q_i . k_j
    s = softcap * tanh(s / softcap)                          softcap
    s = s + bias[b, h, i, j] - slope[b, h] * |i + d - j|      attn_bias, alibi_slopes
    query i sees key j iff i + d - left <= j <= i + d + right  window_size=(left, right)
and causal attention is the window (-1, 0). A sink adds one logit per query head to each row's
softmax denominator, taking probability mass without giving a value:
    p_ij = exp(s_ij) / (exp(sink[h]) + sum_j' exp(s_ij'))      sinks
and LSE includes it. A row that sees no key, or only -inf biases, outputs zeros and has LSE
-inf (without sinks) or sink[h] (with them).
"""

import math
from dataclasses import dataclass
from functools import cached_property

import torch

# How the bias spans the query axis, a compile-time switch of the kernels.
BIAS_NONE = 0
BIAS_ONE_ROW = 1  # one row of key biases shared by every query: [.., 1, Sk]
BIAS_PER_ROW = 2  # a row per query: [.., Sq, Sk]

_UNBOUNDED = -1
_FP32_MAX = 3.4028234663852886e38
_MAX_INT32 = 2**31 - 1


@dataclass(frozen=True)
class ScoreMods:
    """The modifiers of one call, without their tensors: hashable, part of the tuning key."""

    bias_mode: int = BIAS_NONE
    bias_shape: tuple[int, ...] | None = None  # the caller's shape, which dBias takes
    window: tuple[int, int] | None = None  # (left, right), -1 unbounded; causal merged in
    softcap: float = 0.0  # 0: off
    alibi: bool = False
    sinks: bool = False
    # The caller's score and mask functions (programmable.UserFunctions), None without any. Not
    # imported here: the kernels import this module, and the kernel cache keys them by the
    # source of every module they import.
    user: object = None
    # Attention dropout's rate (dropout.py), 0: off. Not a score switch: every variant takes it.
    dropout: float = 0.0

    @cached_property
    def switches(self) -> frozenset:
        """The score switches this call sets, named as variants.SCORE_SWITCHES names them: a
        variant runs the call only if it takes them all (variants.Variant.modifiers). Worked out
        once per ScoreMods: every launch's candidates, dispatch and scale ask."""
        used = {
            "bias_mode": self.bias_mode != BIAS_NONE,
            "windowed": self.window is not None,
            "capped": bool(self.softcap),
            "alibi": self.alibi,
            "functions": self.user is not None and self.user.score_mod is not None,
            "masks": self.user is not None and self.user.mask_mod is not None,
        }
        return frozenset(name for name, on in used.items() if on)

    @property
    def plain_scores(self) -> bool:
        """No modifier but sinks: the scores and masks of plain attention, so the plain kernels'
        configs and the fixed-max forward apply (sinks touch only each row's epilogue and
        statistics)."""
        return not self.switches

    @property
    def keeps_raw_scores(self) -> bool:
        """The forward keeps raw products q.k (ALiBi in their units) and scales inside exp2, which
        needs a positive scale: no bias, softcap or score function (kernels/modifiers.py)."""
        return self.switches.isdisjoint({"bias_mode", "capped", "functions"})

    def key(self) -> str:
        """Suffix of the tuning key: empty for plain attention."""
        parts = []
        if self.bias_mode != BIAS_NONE:
            parts.append("bias-row" if self.bias_mode == BIAS_ONE_ROW else "bias")
        if self.window is not None:
            parts.append("window")
        if self.softcap:
            parts.append("softcap")
        if self.alibi:
            parts.append("alibi")
        if self.sinks:
            parts.append("sinks")
        if self.dropout:
            parts.append("dropout")
        return "".join(f"|{part}" for part in parts) + ("" if self.user is None else self.user.key())


PLAIN = ScoreMods()


@dataclass(frozen=True)
class ModTensors:
    """The modifiers' tensors as the kernels take them (None when unused)."""

    bias: torch.Tensor | None = None  # [1 or B, 1 or Hq, 1 or Sq, Sk], unit stride along keys
    slopes: torch.Tensor | None = None  # float32 [1 or B, Hq], contiguous
    sinks: torch.Tensor | None = None  # float32 (float64 for float64 inputs) [Hq], contiguous
    aux: tuple = ()  # the caller's tensors for score_mod (programmable.py), as given
    block_mask: object = None  # the caller's mask (block_mask.BlockMask), or None
    dropout_seed: torch.Tensor | None = None  # int32 [4] (dropout.new_seed) with dropout


NO_TENSORS = ModTensors()


def check_window(window_size, is_causal: bool, seqlen_q: int, seqlen_k: int) -> tuple[tuple[int, int] | None, bool]:
    """(window, causal) with causal merged in: (-1, 0) is plain causal, (-1, -1) no window.

    A side that reaches every key of every query is unbounded, whatever its size: the left side
    from seqlen_k - 1 (query i's first key is at i + d - left, d = Sk - Sq, and i + d < Sk),
    the right side from seqlen_q - 1 (its last key at i + d + right >= Sk - 1). So the kernels
    only ever see sides below the sequence lengths, and no side can overflow their int32 sums.
    """
    if window_size is None:
        return None, is_causal
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a (left, right) pair of ints, got {window_size!r}")
    for side in window_size:
        if isinstance(side, bool) or not isinstance(side, int):
            raise TypeError(f"window_size must be a (left, right) pair of ints, got {window_size!r}")
        if side < _UNBOUNDED:
            raise ValueError(f"window_size sides must be >= 0, or -1 for unbounded, got {window_size!r}")
    left, right = window_size
    if is_causal:
        if right > 0:
            raise ValueError(
                f"window_size={tuple(window_size)} with is_causal=True: a causal query sees no key to its "
                "right, so the right side must be 0 or -1"
            )
        right = 0
    if left >= seqlen_k - 1:
        left = _UNBOUNDED
    if right >= seqlen_q - 1 and not is_causal:
        right = _UNBOUNDED
    if (left, right) == (_UNBOUNDED, _UNBOUNDED):
        return None, False
    if (left, right) == (_UNBOUNDED, 0):
        return None, True
    return (left, right), False


def check_softcap(softcap, softmax_scale: float) -> float:
    """softcap as a float: 0.0 (None or 0, as FlashAttention reads it) turns it off."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float or None, got {type(softcap).__name__}")
    value = as_float(softcap)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"softcap must be a finite number > 0 (or 0 / None for none), got {softcap}")
    if value and not (abs(softmax_scale) / value <= _FP32_MAX and value <= _FP32_MAX):
        raise ValueError(f"softcap {softcap} with scale {softmax_scale} leaves the float32 range")
    return value


def as_float(value: int | float) -> float:
    """value as a float, inf for an int beyond the float range (float() raises OverflowError)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def check_bias(
    attn_bias, q: torch.Tensor, seqlen_k: int, q_heads: int, needs_grad: bool | None = None
) -> tuple[int, torch.Tensor | None]:
    """(bias mode, the bias as the kernels take it) of attn_bias, broadcastable to [B, Hq, Sq, Sk].

    needs_grad: whether attn_bias will get a gradient; None reads attn_bias.requires_grad.
    """
    if attn_bias is None:
        return BIAS_NONE, None
    if not isinstance(attn_bias, torch.Tensor):
        raise TypeError(f"attn_bias must be a torch.Tensor or None, got {type(attn_bias).__name__}")
    if needs_grad is None:
        needs_grad = attn_bias.requires_grad
    if attn_bias.dtype not in (q.dtype, torch.float32):
        raise TypeError(f"attn_bias must have q's dtype ({q.dtype}) or torch.float32, got {attn_bias.dtype}")
    if attn_bias.device != q.device:
        raise ValueError(f"attn_bias must be on q's device ({q.device}), got {attn_bias.device}")
    target = (q.shape[0], q_heads, q.shape[2], seqlen_k)
    shape = tuple(attn_bias.shape)
    padded = padded_shape(shape)
    if len(shape) > 4 or any(size not in (1, full) for size, full in zip(padded, target, strict=True)):
        raise ValueError(
            f"attn_bias of shape {shape} does not broadcast to [batch, q heads, Sq, Sk] = {list(target)}: "
            "each dimension must be 1 or the full size"
        )
    if attn_bias.numel() > _MAX_INT32:
        raise ValueError(f"attn_bias has {attn_bias.numel()} elements; at most 2**31 - 1 are supported")
    bias = attn_bias.reshape(padded) if attn_bias.dim() < 4 else attn_bias
    # An expanded (stride-0) batch or head dim is read once; dBias keeps those dims whole anyway.
    # The query dim may only shrink when no gradient is asked for: dBias needs its rows.
    for dim in (0, 1, 2):
        if bias.shape[dim] > 1 and bias.stride(dim) == 0 and (dim < 2 or not needs_grad):
            bias = bias.narrow(dim, 0, 1)
    if bias.shape[3] != seqlen_k:
        bias = bias.expand(*bias.shape[:3], seqlen_k)
    if bias.stride(3) != 1 and seqlen_k > 1:
        bias = bias.contiguous()
    mode = BIAS_ONE_ROW if bias.shape[2] == 1 else BIAS_PER_ROW
    return mode, bias.detach()


def check_alibi(alibi_slopes, q: torch.Tensor, q_heads: int, batch: int | None = None) -> torch.Tensor | None:
    """alibi_slopes, float32 [Hq] or [B, Hq], as a contiguous [1 or B, Hq]; batch: B where it is
    not q's first dim (the sequences of a packed batch)."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a torch.Tensor or None, got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be torch.float32, got {alibi_slopes.dtype}")
    if alibi_slopes.device != q.device:
        raise ValueError(f"alibi_slopes must be on q's device ({q.device}), got {alibi_slopes.device}")
    batch = q.shape[0] if batch is None else batch
    if tuple(alibi_slopes.shape) not in ((q_heads,), (batch, q_heads)):
        raise ValueError(
            f"alibi_slopes must have shape [q heads] = [{q_heads}] or [batch, q heads] = [{batch}, {q_heads}], "
            f"got {list(alibi_slopes.shape)}"
        )
    return kernel_slopes(alibi_slopes, q_heads)


def kernel_slopes(alibi_slopes: torch.Tensor, q_heads: int) -> torch.Tensor:
    """Checked alibi_slopes as the kernels take them: a contiguous float32 [1 or B, Hq]."""
    return alibi_slopes.detach().reshape(-1, q_heads).contiguous()


SINK_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_sinks(sinks, q: torch.Tensor, q_heads: int) -> torch.Tensor | None:
    """sinks, one logit per query head [Hq], as the kernels take it: contiguous float32 (float64
    for float64 inputs). Its own dtype may be any float dtype; its gradient comes back in it."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor or None, got {type(sinks).__name__}")
    if sinks.dtype not in SINK_DTYPES:
        raise TypeError(f"sinks must be a floating-point tensor, got {sinks.dtype}")
    if sinks.device != q.device:
        raise ValueError(f"sinks must be on q's device ({q.device}), got {sinks.device}")
    if tuple(sinks.shape) != (q_heads,):
        raise ValueError(f"sinks must have shape [q heads] = [{q_heads}], got {list(sinks.shape)}")
    return kernel_sinks(sinks, q.dtype)


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the row statistics and fp32 sums of inputs of this dtype: fp64 for fp64
    inputs, else fp32 (AttentionProblem.stat_dtype)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def kernel_sinks(sinks: torch.Tensor, q_dtype: torch.dtype) -> torch.Tensor:
    """Checked sinks as the kernels take them: contiguous, in the row statistics' dtype."""
    return sinks.detach().to(stat_dtype(q_dtype)).contiguous()


def kernel_tensors(alibi_slopes, sinks, q_dtype: torch.dtype, q_heads: int) -> ModTensors:
    """The ModTensors of a call without attn_bias whose arguments passed their checks before
    (modifiers_key): this call's slopes and sinks as the kernels take them."""
    if alibi_slopes is None and sinks is None:
        return NO_TENSORS
    slopes = None if alibi_slopes is None else kernel_slopes(alibi_slopes, q_heads)
    return ModTensors(slopes=slopes, sinks=None if sinks is None else kernel_sinks(sinks, q_dtype))


_UNKEYED = object()  # a value whose type alone calls for the full checks


def modifiers_key(window_size, softcap, alibi_slopes, sinks) -> tuple | None:
    """Everything the checks of these arguments read (the window's sides, softcap's value, the
    slopes' and the sinks' shape, dtype and device; the checks of the call's other arguments read
    the rest), () for none of them, or None where a value's type alone calls for the full checks:
    a window that is not a pair of ints, a softcap that is not an int or a float, a tensor
    subclass other than a Parameter."""
    if window_size is None and softcap is None and alibi_slopes is None and sinks is None:
        return ()
    key = (_window_key(window_size), _softcap_key(softcap), _tensor_key(alibi_slopes), _tensor_key(sinks))
    return None if any(part is _UNKEYED for part in key) else key


def _window_key(window_size):
    if window_size is None:
        return None
    if type(window_size) not in (tuple, list) or len(window_size) != 2:
        return _UNKEYED
    if any(type(side) is not int for side in window_size):
        return _UNKEYED
    return tuple(window_size)


def _softcap_key(softcap):
    return softcap if softcap is None or type(softcap) in (int, float) else _UNKEYED


def _tensor_key(t):
    if t is None:
        return None
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        return _UNKEYED
    return t.shape, t.dtype, t.device


def padded_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A bias shape as four dims, 1 for each missing leading dim."""
    return (1,) * (4 - len(shape)) + tuple(shape)


def reduce_bias_grad(d_bias: torch.Tensor, mods: ScoreMods, dtype: torch.dtype) -> torch.Tensor:
    """dBias of the caller's bias from the kernels' [B, Hq, 1 or Sq, Sk] buffer: sums over the
    dims the bias was broadcast along."""
    shape = mods.bias_shape
    padded = padded_shape(shape)
    summed = [dim for dim in range(4) if padded[dim] == 1 and d_bias.shape[dim] != 1]
    if summed:
        d_bias = d_bias.sum(dim=summed, keepdim=True)
    return d_bias.reshape(shape).to(dtype)
